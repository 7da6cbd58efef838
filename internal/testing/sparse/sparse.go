// Package sparse makes the sparse files that tests use as backing devices:
// real files, so the tests exercise pread/pwrite, fdatasync and hole
// punching as production does, yet with no blocks allocated until written.
//
// It is test support only: test files import it, production code never
// does, and it imports nothing from this module.
package sparse

import (
	"os"
	"testing"
)

// Create creates (or truncates) the file at path as a hole of size bytes
// and returns path, failing the test on any error.
func Create(t testing.TB, path string, size int64) string {
	t.Helper()
	if err := os.WriteFile(path, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(path, size); err != nil {
		t.Fatal(err)
	}
	return path
}
