// Package golden compares test output with golden files kept under a
// package's testdata/, and rewrites them when the test binary runs with
// -update. Parser output, mapping plans, flush plans, discard merges and
// snapshot COW images are checked this way, so that a change in what the
// code decides shows up as a reviewable diff of a text file.
//
// It is test support only: test files import it, production code never does.
//
//	go test ./table/ -run TestParseGolden            # compare
//	go test ./table/ -run TestParseGolden -update    # accept the new output
package golden

import (
	"flag"
	"fmt"
	"os"
	"strings"
	"testing"
)

var update = flag.Bool("update", false, "rewrite the golden files under testdata/ instead of comparing with them")

// Check fails t unless got equals the contents of the file at path
// (relative to the package directory, e.g. testdata/x.golden). With -update
// it writes got to path instead, so the next run without it compares equal.
func Check(t testing.TB, path, got string) {
	t.Helper()
	if *update {
		if err := os.WriteFile(path, []byte(got), 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	want, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("%v (go test -update creates it)", err)
	}
	if got != string(want) {
		t.Errorf("%s differs from the golden file (go test -update rewrites it), first at %s\n--- got\n%s--- want\n%s",
			path, firstDiff(got, string(want)), got, want)
	}
}

// firstDiff names the first line where got and want differ and shows both
// versions of it, which is where a reader wants to look first in a long file.
func firstDiff(got, want string) string {
	g, w := strings.Split(got, "\n"), strings.Split(want, "\n")
	for i := range max(len(g), len(w)) {
		var a, b string
		if i < len(g) {
			a = g[i]
		}
		if i < len(w) {
			b = w[i]
		}
		if a != b {
			return fmt.Sprintf("line %d:\n got  %q\n want %q", i+1, a, b)
		}
	}
	return "the end" // unreachable while got != want
}
