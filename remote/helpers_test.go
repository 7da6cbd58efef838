package remote

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nbdmapper/nbdmapper/internal/testing/nbdtest"
	"github.com/nbdmapper/nbdmapper/internal/testing/sparse"
)

// shortDir is a directory for unix sockets.
func shortDir(t testing.TB) string { return nbdtest.ShortDir(t) }

// startNbdkit runs nbdkit on dir/NAME.sock with its log filter (see
// nbdtest.StartNbdkit).
func startNbdkit(t testing.TB, dir, name string, args ...string) *nbdtest.Peer {
	t.Helper()
	return nbdtest.StartNbdkit(t, dir, name, nbdtest.PeerOptions{}, args...)
}

func sparseFile(t testing.TB, dir, name string, size int64) string {
	t.Helper()
	return sparse.Create(t, filepath.Join(dir, name), size)
}

// testOptions are Options for tests: short waits, so a test of a lost
// remote does not idle, and panics fail the test.
func testOptions(t testing.TB) Options {
	return Options{
		Timeout:    20 * time.Second,
		BackoffMin: 5 * time.Millisecond,
		BackoffMax: 100 * time.Millisecond,
		OnPanic:    func(v any, stack []byte) { t.Errorf("panic: %v\n%s", v, stack) },
	}
}

func openURI(t testing.TB, uri string, opts Options) *Device {
	t.Helper()
	u, err := ParseURI(uri)
	if err != nil {
		t.Fatal(err)
	}
	d, err := Open(uri, u, false, opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Close() })
	return d
}

func readFile(t testing.TB, path string, off, n int64) []byte {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	b := make([]byte, n)
	if _, err := f.ReadAt(b, off); err != nil {
		t.Fatal(err)
	}
	return b
}

func pattern(n int, seed byte) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = seed + byte(i*7) + byte(i>>9)
	}
	return b
}

func mustEqual(t testing.TB, what string, got, want []byte) {
	t.Helper()
	if !bytes.Equal(got, want) {
		i := 0
		for i < len(got) && i < len(want) && got[i] == want[i] {
			i++
		}
		t.Fatalf("%s: differs at byte %d of %d", what, i, len(want))
	}
}

func stringsReader(s string) *strings.Reader { return strings.NewReader(s) }

func itoa(v int64) string { return fmt.Sprint(v) }

// readBack reads [off, off+len(want)) from d and compares it with want.
func readBack(t testing.TB, d *Device, off int64, want []byte) {
	t.Helper()
	back := make([]byte, len(want))
	if _, err := d.ReadAt(back, off); err != nil {
		t.Fatalf("read %d+%d: %v", off, len(want), err)
	}
	mustEqual(t, "read back", back, want)
}

// syncedFile syncs d and compares the server's whole file with want.
func syncedFile(t testing.TB, d *Device, file string, want []byte) {
	t.Helper()
	if err := d.Sync(); err != nil {
		t.Fatal(err)
	}
	mustEqual(t, "the server's file", readFile(t, file, 0, int64(len(want))), want)
}
