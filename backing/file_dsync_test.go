package backing

import (
	"bytes"
	"errors"
	"io"
	"testing"

	"golang.org/x/sys/unix"
)

func TestWriteAtDSync(t *testing.T) {
	cases := []struct {
		name string
		off  int64
		size int
	}{
		{"one sector", 0, 512},
		{"unaligned", 1000, 3},
		{"large", 4096, 256 << 10},
	}
	f, err := OpenFile(sparseFile(t, 1<<20), false)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			p := bytes.Repeat([]byte{byte(tc.size)}, tc.size)
			n, err := f.WriteAtDSync(p, tc.off)
			if err != nil || n != tc.size {
				t.Fatalf("WriteAtDSync: %d, %v", n, err)
			}
			got := make([]byte, tc.size)
			if _, err := f.ReadAt(got, tc.off); err != nil || !bytes.Equal(got, p) {
				t.Fatalf("read back differs (err %v)", err)
			}
		})
	}
}

// TestWriteAtDSyncOwnDescription: a durable write goes through an open
// file description of the file's own, not the one its other calls use,
// and durable writes at once get one each, so that the kernel's write-back
// errors, reported once per description, reach every one of them (see
// WriteAtDSync). Descriptions are told apart by their file offsets, which
// they do not share; the file is told by its inode.
func TestWriteAtDSyncOwnDescription(t *testing.T) {
	f, err := OpenFile(sparseFile(t, 1<<20), false)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.WriteAtDSync([]byte("x"), 0); err != nil {
		t.Fatal(err)
	}
	a, err := f.takeDSync() // the one that write used, kept
	if err != nil {
		t.Fatal(err)
	}
	b, err := f.takeDSync() // a second, as for a write beside it
	if err != nil {
		t.Fatal(err)
	}
	if len(f.dsync) != 0 {
		t.Fatalf("%d descriptors free after taking two; the write kept one", len(f.dsync))
	}
	var main, st unix.Stat_t
	unix.Fstat(f.fd, &main)
	for i, fd := range []int{a, b} {
		if err := unix.Fstat(fd, &st); err != nil || st.Ino != main.Ino || st.Dev != main.Dev {
			t.Fatalf("descriptor %d is not the file (%v)", i, err)
		}
	}
	for i, fd := range []int{f.fd, a, b} {
		if _, err := unix.Seek(fd, int64(1000+i), io.SeekStart); err != nil {
			t.Fatal(err)
		}
	}
	for i, fd := range []int{f.fd, a, b} {
		if pos, _ := unix.Seek(fd, 0, io.SeekCurrent); pos != int64(1000+i) {
			t.Fatalf("descriptor %d is at %d, moved by another: they share a description", i, pos)
		}
	}
	f.putDSync(a)
	f.putDSync(b)
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
	if err := unix.Fstat(a, &st); err == nil {
		t.Fatal("a durable write's descriptor outlived Close")
	}
}

// A file opened for reading only stays so on the durable path: its
// descriptor of its own is read-only too, and the write fails, writing
// nothing.
func TestWriteAtDSyncReadOnly(t *testing.T) {
	path := sparseFile(t, 1<<20)
	f, err := OpenFile(path, true)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.WriteAtDSync([]byte("x"), 0); !errors.Is(err, unix.EBADF) {
		t.Fatalf("durable write on a read-only file: %v, want EBADF", err)
	}
	got := make([]byte, 1)
	if _, err := f.ReadAt(got, 0); err != nil || got[0] != 0 {
		t.Fatalf("read back %v (%v): the write landed", got, err)
	}
}
