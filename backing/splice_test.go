package backing

import (
	"bytes"
	"errors"
	"io"
	"math/rand/v2"
	"os"
	"path/filepath"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"
)

// newPipe returns a pipe with room for n bytes, closed with the test.
func newPipe(t *testing.T, n int) (r, w int) {
	t.Helper()
	var fds [2]int
	if err := unix.Pipe2(fds[:], unix.O_CLOEXEC); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Close(fds[0]); unix.Close(fds[1]) })
	if _, err := unix.FcntlInt(uintptr(fds[1]), unix.F_SETPIPE_SZ, n); err != nil {
		t.Fatal(err)
	}
	return fds[0], fds[1]
}

// inPipe is how many bytes wait in the pipe.
func inPipe(t *testing.T, r int) int {
	t.Helper()
	n, err := unix.IoctlGetInt(r, unix.TIOCINQ) // FIONREAD
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// drain reads n bytes from the pipe.
func drain(t *testing.T, r, n int) []byte {
	t.Helper()
	p := make([]byte, n)
	for got := 0; got < n; {
		k, err := unix.Read(r, p[got:])
		if err != nil || k == 0 {
			t.Fatalf("pipe read after %d of %d bytes: %v", got, n, err)
		}
		got += k
	}
	return p
}

func randomFile(t *testing.T, size int) (string, []byte) {
	t.Helper()
	data := make([]byte, size)
	rng := rand.New(rand.NewPCG(1, 2))
	for i := range data {
		data[i] = byte(rng.Uint32())
	}
	path := filepath.Join(t.TempDir(), "f.img")
	if err := os.WriteFile(path, data, 0o600); err != nil {
		t.Fatal(err)
	}
	return path, data
}

// A file splices exactly the bytes ReadAt would read, fails like ReadAt
// past its end, and reports a pipe it cannot write to as its error.
func TestFileSplice(t *testing.T) {
	path, data := randomFile(t, 2<<20)
	f, err := OpenFile(path, false)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	r, w := newPipe(t, 1<<20)
	for _, c := range []struct {
		off int64
		n   int
	}{{0, 1 << 20}, {4096 + 123, 300000}, {2<<20 - 1000, 1000}} {
		ok, err := Splice(f, w, c.off, c.n)
		if !ok || err != nil {
			t.Fatalf("splice %d+%d: ok %v, %v", c.off, c.n, ok, err)
		}
		if got := drain(t, r, c.n); !bytes.Equal(got, data[c.off:c.off+int64(c.n)]) {
			t.Fatalf("splice %d+%d moved other bytes than the file holds", c.off, c.n)
		}
	}

	ok, err := Splice(f, w, 2<<20-100, 200)
	if !ok || !errors.Is(err, io.ErrUnexpectedEOF) {
		t.Fatalf("splice past the end: ok %v, %v; want a short read", ok, err)
	}
	if n := inPipe(t, r); n != 100 {
		t.Fatalf("%d bytes in the pipe after the short splice, want the 100 there were", n)
	}

	r2, w2 := newPipe(t, 1<<20)
	unix.Close(r2)
	if ok, err := Splice(f, w2, 0, 4096); !ok || !errors.Is(err, syscall.EPIPE) {
		t.Fatalf("splice into a pipe nobody reads: ok %v, %v; want EPIPE", ok, err)
	}
}

// A hole map splices ranges that are all data through the file below, and
// declines, moving nothing, ranges with a hole it knows (a sparse read
// answers those as holes) and ranges outside the device. A device with no
// Splicer below it declines too.
func TestHoleMapSplice(t *testing.T) {
	h := NewHoleMap(openSparse(t, 1<<20))
	data := fill(256<<10, 0x5a)
	if _, err := h.WriteAt(data, 0); err != nil {
		t.Fatal(err)
	}
	r, w := newPipe(t, 1<<20)

	if ok, err := Splice(h, w, 4096, 128<<10); !ok || err != nil {
		t.Fatalf("splice of data: ok %v, %v", ok, err)
	}
	if got := drain(t, r, 128<<10); !bytes.Equal(got, data[4096:4096+128<<10]) {
		t.Fatal("splice of data moved other bytes")
	}
	for _, c := range []struct {
		what string
		off  int64
		n    int
	}{{"a range with a hole", 0, 1 << 20}, {"a hole", 512 << 10, 128 << 10}, {"a range past the end", 1<<20 - 4096, 8192}} {
		if ok, err := Splice(h, w, c.off, c.n); ok || err != nil {
			t.Errorf("splice of %s: ok %v, %v; want declined", c.what, ok, err)
		}
		if n := inPipe(t, r); n != 0 {
			t.Fatalf("splice of %s left %d bytes in the pipe", c.what, n)
		}
	}
	if ok, err := Splice(NewHoleMap(NewMem("m", 1<<20)), w, 0, 4096); ok || err != nil {
		t.Errorf("splice from memory: ok %v, %v; want declined", ok, err)
	}
}
