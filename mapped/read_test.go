package mapped_test

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/nbdmapper/nbdmapper/backing"
	"github.com/nbdmapper/nbdmapper/internal/testing/golden"
	"github.com/nbdmapper/nbdmapper/internal/testing/nbdtest"
	"github.com/nbdmapper/nbdmapper/mapped"
	"github.com/nbdmapper/nbdmapper/table"
	"golang.org/x/sys/unix"
)

// sparseTable has a target of every kind a read crosses, over devices
// with holes (sectors; K is KiB of the virtual device):
//
//	0     256   linear a 0          0K-128K    a: data at 0K+4K, 64K+4K, 100K+1K
//	256   128   zero                128K-192K
//	384   2048  striped 2 8 s0 0 s1 0   192K-1216K  4K chunks: s0 all data, s1 holes
//	2432  128   linear /dev/mapper/low 0  1216K-1280K  low: b, data at 0K+8K
//	2560  8     error               1280K-1284K
const sparseTable = `0 256 linear a 0
256 128 zero
384 2048 striped 2 8 s0 0 s1 0
2432 128 linear /dev/mapper/low 0
2560 8 error
`

// TestReadSparseGolden reads ranges of sparseTable sparsely and prints the
// holes each read reports (testdata/read-sparse.golden); it checks that
// the data between them, and a plain Read, match what the devices hold.
func TestReadSparseGolden(t *testing.T) {
	const K = 1024
	raw := memOpener{}
	mem := func(name string, size int64, data ...int64) {
		m := backing.NewMem(name, size)
		for i := 0; i < len(data); i += 2 {
			m.WriteAt(bytes.Repeat([]byte{byte(len(name) + i + 1)}, int(data[i+1])), data[i])
		}
		raw[name] = m
	}
	mem("a", 128*K, 0, 4*K, 64*K, 4*K, 100*K, 1*K)
	mem("s0", 512*K, 0, 512*K)
	mem("s1", 512*K)
	mem("b", 64*K, 0, 8*K)
	devs := memOpener{}
	for name, m := range raw {
		devs[name] = backing.NewHoleMap(m)
	}
	x := parseSet(t, devs, "x="+sparseTable, "low=0 128 linear b 0\n")[0]
	// What the device holds, read through the same tables over the
	// devices without hole maps (a Mem reads its holes as zeros).
	want := make([]byte, x.Size())
	if _, err := parseSet(t, raw, "x="+sparseTable, "low=0 128 linear b 0\n")[0].Read(want[:1280*K], 0); err != nil {
		t.Fatal(err)
	}

	var out strings.Builder
	kb := func(v int64) string {
		if v%K == 0 {
			return fmt.Sprintf("%dK", v/K)
		}
		return fmt.Sprint(v)
	}
	for _, r := range []struct {
		what     string
		off, len int64
	}{
		{"all of line a", 0, 128 * K},
		{"a 4K read inside a hole", 8 * K, 4 * K},
		{"a 1K read inside a hole (the whole read)", 8 * K, K},
		{"a hole of 4K before data", 60 * K, 6 * K},
		{"a hole of 2K before data: read as data", 62 * K, 4 * K},
		{"data, then a hole running into the zero target", 100 * K, 96 * K},
		{"the zero target alone", 128 * K, 64 * K},
		{"striped, 4K data and 4K holes alternating", 192 * K, 64 * K},
		{"striped, more holes than MaxHoles", 192 * K, 1024 * K},
		{"a hole in the stacked device's file, seen through it", 1216 * K, 64 * K},
		{"across the zero target, striped and stacked", 128 * K, 1152 * K},
		{"into the error target", 1276 * K, 8 * K},
	} {
		p := bytes.Repeat([]byte{0xee}, int(r.len))
		holes, failed, err := x.ReadSparse(p, r.off, nil)
		fmt.Fprintf(&out, "read %s+%s (%s):", kb(r.off), kb(r.len), r.what)
		if err != nil {
			if !errors.Is(err, table.ErrTarget) {
				t.Fatalf("%s: %v", r.what, err)
			}
			fmt.Fprintf(&out, " error at %s\n", kb(failed))
			continue
		}
		pos := r.off
		for i, h := range holes {
			if h.Off > pos {
				fmt.Fprintf(&out, " data %s+%s", kb(pos), kb(h.Off-pos))
			}
			fmt.Fprintf(&out, " hole %s+%s", kb(h.Off), kb(h.Len))
			if h.Len < mapped.MinHole && h.Len != r.len || (i > 0 && h.Off <= holes[i-1].End()) {
				t.Errorf("%s: hole %v of %v: too short, or not after the last one", r.what, h, holes)
			}
			if !bytes.Equal(want[h.Off:h.End()], make([]byte, h.Len)) {
				t.Errorf("%s: hole %v over data", r.what, h)
			}
			clear(p[h.Off-r.off : h.End()-r.off])
			pos = h.End()
		}
		if pos < r.off+r.len {
			fmt.Fprintf(&out, " data %s+%s", kb(pos), kb(r.off+r.len-pos))
		}
		fmt.Fprintf(&out, " (%d holes)\n", len(holes))
		if len(holes) > mapped.MaxHoles {
			t.Errorf("%s: %d holes, more than MaxHoles", r.what, len(holes))
		}
		if !bytes.Equal(p, want[r.off:r.off+r.len]) {
			t.Errorf("%s: data between the holes differs from the device", r.what)
		}
		// A plain read into a dirty buffer clears the holes it does not read.
		q := bytes.Repeat([]byte{0xee}, int(r.len))
		if _, err := x.Read(q, r.off); err != nil || !bytes.Equal(q, want[r.off:r.off+r.len]) {
			t.Errorf("%s: plain read differs from the device (%v)", r.what, err)
		}
	}
	golden.Check(t, "testdata/read-sparse.golden", out.String())

	// A write to a hole is seen by the next read, through the map.
	if holes, _, _ := x.ReadSparse(make([]byte, 8*K), 4*K, nil); len(holes) != 1 || holes[0] != (backing.Range{Off: 4 * K, Len: 8 * K}) {
		t.Fatalf("before the write: holes %v, want 4K+8K", holes)
	}
	if err := x.Write(bytes.Repeat([]byte{9}, 512), 8*K+100, false); err != nil {
		t.Fatal(err)
	}
	p := make([]byte, 8*K)
	holes, _, _ := x.ReadSparse(p, 4*K, nil)
	if len(holes) != 1 || holes[0] != (backing.Range{Off: 4 * K, Len: 4 * K}) || p[4*K+100] != 9 {
		t.Fatalf("after a write at 8K+100: holes %v, want only 4K+4K", holes)
	}
}

// BenchmarkRead4K reads 4 KiB through a one-line table over a Mem, with
// and without a hole map, of a hole and of data; allocs/op shows what the
// read path allocates per request.
func BenchmarkRead4K(b *testing.B) {
	for _, bc := range []struct {
		name         string
		holeMap      bool
		written      bool
		sparse       bool
		wantHolesPer int
	}{
		{"no map, data", false, true, false, 0},
		{"map, data", true, true, true, 0},
		{"map, hole, sparse", true, false, true, 1},
		{"map, hole, plain", true, false, false, 0},
	} {
		b.Run(bc.name, func(b *testing.B) {
			m := backing.NewMem("m", 64<<20)
			if bc.written {
				m.WriteAt(make([]byte, 64<<20), 0)
			}
			var d backing.Device = m
			if bc.holeMap {
				d = backing.NewHoleMap(m)
			}
			x := parseSet(&testing.T{}, memOpener{"m": d}, "x=0 131072 linear m 0\n")[0]
			p := make([]byte, 4096)
			var holes []backing.Range
			b.ReportAllocs()
			b.ResetTimer()
			for i := range b.N {
				off := int64(i%(16<<10)) * 4096
				var err error
				if bc.sparse {
					holes, _, err = x.ReadSparse(p, off, holes[:0])
				} else {
					_, err = x.Read(p, off)
				}
				if err != nil || len(holes) != bc.wantHolesPer {
					b.Fatalf("read: %v, holes %v", err, holes)
				}
			}
		})
	}
}

// TestReadSparseSnapshots: a snapshot-origin reads its origin's holes
// sparsely (its reads pass through); a snapshot cannot tell its holes
// (Holes nil), so its reads are data, zeros included.
func TestReadSparseSnapshots(t *testing.T) {
	disk := backing.NewMem("disk", 1<<20)
	disk.WriteAt(bytes.Repeat([]byte{7}, 4096), 64<<10)
	devs := memOpener{"disk": backing.NewHoleMap(disk), "cow": backing.NewMem("cow", 1<<20)}
	mds := parseSet(t, devs, "orig=0 2048 snapshot-origin disk", "snap=0 2048 snapshot disk cow P 8")
	orig, snap := mds[0], mds[1]
	defer snap.Close()
	for _, tc := range []struct {
		name  string
		d     *mapped.Device
		holes []backing.Range
	}{
		{"snapshot-origin", orig, []backing.Range{{Off: 0, Len: 64 << 10}, {Off: 68 << 10, Len: 60 << 10}}},
		{"snapshot", snap, nil},
	} {
		p := make([]byte, 128<<10)
		holes, _, err := tc.d.ReadSparse(p, 0, nil)
		if err != nil || !slices.Equal(holes, tc.holes) || p[64<<10] != 7 {
			t.Errorf("%s: holes %v, %v; want %v", tc.name, holes, err, tc.holes)
		}
	}
}

// A write through the table allocates nothing of its own (the table walk
// and the per-extent state are pooled), as a read does.
func TestWriteAllocs(t *testing.T) {
	m := backing.NewMem("m", 64<<20)
	x := parseSet(t, memOpener{"m": m}, "x=0 131072 linear m 0\n")[0]
	p := make([]byte, 4096)
	allocs := nbdtest.AllocsPerRun(100, func() {
		// One offset: Mem allocates a page the first time it is written.
		if err := x.Write(p, 4096, false); err != nil {
			t.Fatal(err)
		}
	})
	if allocs != 0 {
		t.Errorf("a 4 KiB write allocated %v times, want 0", allocs)
	}
}

// A spliced read allocates nothing of its own: finding the one extent it
// lies on is pooled, as a read's table walk is.
func TestSpliceAllocs(t *testing.T) {
	path := filepath.Join(t.TempDir(), "f")
	if err := os.WriteFile(path, bytes.Repeat([]byte{7}, 1<<20), 0o600); err != nil {
		t.Fatal(err)
	}
	f, err := backing.OpenFile(path, false)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	x := parseSet(t, memOpener{"f": f}, "x=0 2048 linear f 0\n")[0]
	var pipe [2]int
	if err := unix.Pipe2(pipe[:], unix.O_CLOEXEC); err != nil {
		t.Fatal(err)
	}
	defer unix.Close(pipe[0])
	defer unix.Close(pipe[1])
	got := make([]byte, 4096)
	allocs := nbdtest.AllocsPerRun(100, func() {
		ok, _, err := x.Splice(pipe[1], 8192, 4096, nil)
		if !ok || err != nil {
			t.Fatalf("Splice: %v, %v", ok, err)
		}
		if n, err := unix.Read(pipe[0], got); n != 4096 || err != nil || got[4095] != 7 {
			t.Fatalf("pipe read %d bytes, %v", n, err)
		}
	})
	if allocs != 0 {
		t.Errorf("a 4 KiB spliced read allocated %v times, want 0", allocs)
	}
}
