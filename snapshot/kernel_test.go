package snapshot

import (
	"bytes"
	"compress/gzip"
	"encoding/binary"
	"flag"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/nbdmapper/nbdmapper/backing"
)

var kernelInputs = flag.String("kernel-inputs", "", "TestKernelInputs writes the nbdmapper-made COW for testdata/kernel/make.sh into this directory")

const (
	kOriginSize = 2 << 20
	kCOWSize    = 3 << 20
)

// nbdSequence is what nbdmapper writes for the kernel to read: a P store
// with chunk 8, a partial and a whole-chunk snapshot write, and 300 chunks
// written through the origin (area 0 fills, area 1 starts).
func nbdSequence(t *testing.T, origin, cow backing.Device) *Snapshot {
	t.Helper()
	s, err := Open("n", origin, cow, Options{Type: Persistent, ChunkSectors: 8})
	if err != nil {
		t.Fatal(err)
	}
	o, err := NewOrigin("n-origin", origin, 0)
	if err != nil {
		t.Fatal(err)
	}
	mustWrite(t, s, []byte("nbdmapper snapshot write"), 7000)
	mustWrite(t, s, bytes.Repeat([]byte("N"), 4096), 12*4096)
	mustWrite(t, o, bytes.Repeat([]byte("o"), 300*4096), 50*4096)
	return s
}

// TestKernelInputs writes n-origin.img, n-cow.img and n-view.img (what the
// snapshot reads) into -kernel-inputs, starting from origin-initial.img
// there. Only testdata/kernel/make.sh runs it.
func TestKernelInputs(t *testing.T) {
	if *kernelInputs == "" {
		t.Skip("only for testdata/kernel/make.sh (-kernel-inputs DIR)")
	}
	dir := *kernelInputs
	initial, err := os.ReadFile(filepath.Join(dir, "origin-initial.img"))
	if err != nil {
		t.Fatal(err)
	}
	origin := backing.NewMem("origin", kOriginSize)
	mustWrite(t, origin, initial, 0)
	cow := backing.NewMem("cow", kCOWSize)
	s := nbdSequence(t, origin, cow)
	defer s.Close()
	for name, d := range map[string]backing.Device{"n-origin.img": origin, "n-cow.img": cow, "n-view.img": s} {
		b := make([]byte, d.Size())
		if _, err := d.ReadAt(b, 0); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, name), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

// TestKernelCOW checks nbdmapper against stores the Linux kernel's
// dm-snapshot wrote and read (fixtures from testdata/kernel/make.sh):
// nbdmapper reads a kernel-made COW exactly as the kernel did, with the
// same status line; the kernel read an nbdmapper-made COW as nbdmapper
// does; and nbdmapper reads that COW again after the kernel added to it.
func TestKernelCOW(t *testing.T) {
	dir := filepath.Join("testdata", "kernel")
	if _, err := os.Stat(filepath.Join(dir, "k-cow.img.gz")); err != nil {
		t.Skip("no kernel fixtures: run snapshot/testdata/kernel/make.sh (needs qemu)")
	}
	tmp := t.TempDir()

	t.Run("kernel-made store", func(t *testing.T) {
		// Real files, as nbdmapper serves them. Table chunk 0: from the header.
		origin := openFile(t, gunzipTo(t, dir, "k-origin.img", tmp))
		cow := openFile(t, gunzipTo(t, dir, "k-cow.img", tmp))
		s, err := Open("k", origin, cow, Options{Type: Persistent})
		if err != nil {
			t.Fatal(err)
		}
		defer s.Close()
		if s.ChunkSectors() != 8 {
			t.Fatalf("chunk %d from the kernel's header, want 8", s.ChunkSectors())
		}
		if want := statusField(t, dir, "k-status.txt"); s.Status() != want {
			t.Fatalf("status %q, kernel said %q", s.Status(), want)
		}
		want := gunzip(t, dir, "k-view.img")
		got := make([]byte, len(want))
		if _, err := s.ReadAt(got, 0); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, want) {
			t.Fatal("nbdmapper reads the kernel's snapshot differently from the kernel")
		}
	})

	t.Run("nbdmapper-made store", func(t *testing.T) {
		view := gunzip(t, dir, "n-view.img")
		if kview := gunzip(t, dir, "n-kview.img"); !bytes.Equal(view, kview) {
			t.Fatal("the kernel read nbdmapper's snapshot differently")
		}
		// After the kernel wrote chunk 20 'K', nbdmapper reads its store.
		originDev := backing.NewMem("n-origin", kOriginSize)
		mustWrite(t, originDev, gunzip(t, dir, "n-origin.img"), 0)
		cowAfter := backing.NewMem("n-cow", kCOWSize)
		mustWrite(t, cowAfter, gunzip(t, dir, "n-cow-after.img"), 0)
		s2, err := Open("n2", originDev, cowAfter, Options{Type: Persistent, ChunkSectors: 8})
		if err != nil {
			t.Fatal(err)
		}
		defer s2.Close()
		if want := statusField(t, dir, "n-kstatus-after.txt"); s2.Status() != want {
			t.Fatalf("status %q, kernel said %q", s2.Status(), want)
		}
		copy(view[20*4096:], bytes.Repeat([]byte("K"), 4096))
		checkRead(t, 0, s2, view, 0, kOriginSize)
	})
}

// TestGeneratedKernelFormat reads a store built byte by byte from the
// documented format (REFERENCE.md, dm-snap-persistent.c), independent of
// this package's encoder: chunk 1, area 0 full (32 entries) and area 1
// with two, an on-disk chunk size that overrides the table's, and data
// chunks that say which origin chunk they hold.
func TestGeneratedKernelFormat(t *testing.T) {
	const sector = 512
	cowBytes := make([]byte, 40*sector)
	le32 := binary.LittleEndian.PutUint32
	le64 := binary.LittleEndian.PutUint64
	le32(cowBytes[0:], 0x70416e53)
	le32(cowBytes[4:], 1)
	le32(cowBytes[8:], 1)
	le32(cowBytes[12:], 1)
	// Area 0 at chunk 1: origin chunk 100+i -> COW chunk 2+i.
	for i := 0; i < 32; i++ {
		le64(cowBytes[1*sector+16*i:], uint64(100+i))
		le64(cowBytes[1*sector+16*i+8:], uint64(2+i))
	}
	// Area 1 at chunk 34: origin 7 -> 35, origin 3 -> 36.
	le64(cowBytes[34*sector:], 7)
	le64(cowBytes[34*sector+8:], 35)
	le64(cowBytes[34*sector+16:], 3)
	le64(cowBytes[34*sector+24:], 36)
	mark := func(chunk int, old byte) {
		copy(cowBytes[chunk*sector:(chunk+1)*sector], bytes.Repeat([]byte{old}, sector))
	}
	for i := 0; i < 32; i++ {
		mark(2+i, byte(100+i))
	}
	mark(35, 7)
	mark(36, 3)

	dir := t.TempDir()
	path := filepath.Join(dir, "cow.img")
	if err := os.WriteFile(path, cowBytes, 0o644); err != nil {
		t.Fatal(err)
	}
	origin := backing.NewMem("origin", 256*sector) // zeros
	cow := openFile(t, path)
	s, err := Open("gen", origin, cow, Options{Type: Persistent, ChunkSectors: 8})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if s.ChunkSectors() != 1 {
		t.Fatalf("chunk %d, want the on-disk 1", s.ChunkSectors())
	}
	// next free = 37; area 1 current: metadata (1+1+1)*1.
	if got, want := s.Status(), "37/40 3"; got != want {
		t.Fatalf("status %q, want %q", got, want)
	}
	want := make([]byte, 256*sector)
	for _, c := range append([]int{7, 3}, seq(100, 132)...) {
		copy(want[c*sector:(c+1)*sector], bytes.Repeat([]byte{byte(c)}, sector))
	}
	checkRead(t, 0, s, want, 0, int64(len(want)))
	// The next exception goes to chunk 37, entry 2 of area 1.
	mustWrite(t, s, []byte{0xAB}, 9*sector)
	raw, _ := os.ReadFile(path)
	if o, n := binary.LittleEndian.Uint64(raw[34*sector+32:]), binary.LittleEndian.Uint64(raw[34*sector+40:]); o != 9 || n != 37 {
		t.Fatalf("new entry {%d, %d}, want {9, 37}", o, n)
	}
	if raw[37*sector] != 0xAB {
		t.Fatalf("data chunk 37 starts %#x", raw[37*sector])
	}
}

func seq(from, to int) []int {
	var s []int
	for i := from; i < to; i++ {
		s = append(s, i)
	}
	return s
}

func openFile(t *testing.T, path string) *backing.File {
	t.Helper()
	f, err := backing.OpenFile(path, false)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	return f
}

func gunzip(t *testing.T, dir, name string) []byte {
	t.Helper()
	f, err := os.Open(filepath.Join(dir, name+".gz"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	z, err := gzip.NewReader(f)
	if err != nil {
		t.Fatal(err)
	}
	b, err := io.ReadAll(z)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func gunzipTo(t *testing.T, dir, name, tmp string) string {
	t.Helper()
	p := filepath.Join(tmp, name)
	if err := os.WriteFile(p, gunzip(t, dir, name), 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

// statusField returns the target status from a `dmsetup status` line
// "<start> <length> snapshot <status...>".
func statusField(t *testing.T, dir, name string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(dir, name))
	if err != nil {
		t.Fatal(err)
	}
	f := strings.Fields(string(b))
	if len(f) < 4 {
		t.Fatalf("%s: %q is not a status line", name, b)
	}
	return strings.Join(f[3:], " ")
}
