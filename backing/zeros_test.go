package backing

import (
	"strings"
	"testing"
)

// WriteZeros writes zeros over data, in 1 MiB pieces, allocating nothing.
func TestWriteZeros(t *testing.T) {
	const size = 3<<20 + 512
	m := NewMem("a", size)
	data := make([]byte, size)
	for i := range data {
		data[i] = 0xff
	}
	m.WriteAt(data, 0)
	r := NewRecorder(m)
	if err := WriteZeros(r, 512, size-512); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, size)
	m.ReadAt(got, 0)
	if got[511] != 0xff || strings.ContainsFunc(string(got[512:]), func(c rune) bool { return c != 0 }) {
		t.Fatal("range not zeroed, or zeroed outside it")
	}
	if n := r.Count(OpWrite); n != 3 {
		t.Errorf("%d writes, want 3 of 1 MiB", n)
	}
	if zeros != [len(zeros)]byte{} {
		t.Error("the shared zero buffer was written")
	}
	if n := testing.AllocsPerRun(10, func() { WriteZeros(m, 0, size) }); n != 0 {
		t.Errorf("%v allocations per call", n)
	}
}
