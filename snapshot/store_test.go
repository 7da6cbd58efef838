package snapshot

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/nbdmapper/nbdmapper/backing"
)

func TestParseType(t *testing.T) {
	cases := []struct {
		in   string
		want Type
		err  bool
	}{
		{"P", Persistent, false},
		{"p", Persistent, false},
		{"PO", PersistentOverflow, false},
		{"po", PersistentOverflow, false},
		{"N", Transient, false},
		{"n", Transient, false},
		{"PX", 0, true},
		{"X", 0, true},
		{"", 0, true},
	}
	for _, tc := range cases {
		t.Run(fmt.Sprintf("%q", tc.in), func(t *testing.T) {
			got, err := ParseType(tc.in)
			if (err != nil) != tc.err || (err == nil && got != tc.want) {
				t.Fatalf("ParseType(%q) = %v, %v; want %v, error %v", tc.in, got, err, tc.want, tc.err)
			}
			if err != nil && !errors.Is(err, ErrStoreType) {
				t.Fatalf("error %v is not ErrStoreType", err)
			}
		})
	}
}

func TestCheckChunk(t *testing.T) {
	cases := []struct {
		sectors uint32
		ok      bool
	}{
		{1, true}, {8, true}, {1 << 21, true},
		{0, false}, {3, false}, {12, false}, {1 << 22, false},
	}
	for _, tc := range cases {
		t.Run(fmt.Sprint(tc.sectors), func(t *testing.T) {
			if err := CheckChunk(tc.sectors); (err == nil) != tc.ok {
				t.Fatalf("CheckChunk(%d) = %v, want ok %v", tc.sectors, err, tc.ok)
			}
		})
	}
}

// newPair returns an origin filled with a pattern (each 512-byte sector
// holds its index) and an empty COW device.
func newPair(t *testing.T, originSize, cowSize int64) (*backing.Mem, *backing.Mem) {
	t.Helper()
	origin := backing.NewMem("origin", originSize)
	for s := int64(0); s < originSize/512; s++ {
		mustWrite(t, origin, bytes.Repeat([]byte{byte(s + 1)}, 512), s*512)
	}
	return origin, backing.NewMem("cow", cowSize)
}

func open(t *testing.T, origin, cow backing.Device, opt Options) *Snapshot {
	t.Helper()
	s, err := Open("snap", origin, cow, opt)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

// TestStatus follows dm's usage numbers across a metadata area boundary:
// with chunk 1 (32 exceptions per area) the 33rd exception skips chunk 34.
func TestStatus(t *testing.T) {
	origin, cow := newPair(t, 64<<10, 64<<10)
	s := open(t, origin, cow, Options{Type: Persistent, ChunkSectors: 1})
	steps := []struct {
		chunks int // exceptions created so far
		want   string
	}{
		{0, "2/128 2"},   // header + area 0; next free chunk 2
		{1, "3/128 2"},   // chunk 2 used
		{31, "33/128 2"}, // chunks 2..32
		{32, "35/128 3"}, // chunk 33 was the last of area 0; 34 is area 1; area 1 current
		{33, "36/128 3"}, // chunk 35
	}
	done := 0
	for _, st := range steps {
		for ; done < st.chunks; done++ {
			mustWrite(t, s, []byte{0xAA}, int64(done)*512)
		}
		if got := s.Status(); got != st.want {
			t.Fatalf("after %d exceptions: status %q, want %q", st.chunks, got, st.want)
		}
	}
	// The 33rd exception landed in chunk 35, entry 0 of area 1 (chunk 34).
	var e [16]byte
	cow.ReadAt(e[:], 34*512)
	if old, nw := binary.LittleEndian.Uint64(e[:]), binary.LittleEndian.Uint64(e[8:]); old != 32 || nw != 35 {
		t.Fatalf("area 1 entry 0 = {%d, %d}, want {32, 35}", old, nw)
	}
}

func TestTransientStatus(t *testing.T) {
	origin, cow := newPair(t, 16<<10, 8<<10)
	s := open(t, origin, cow, Options{Type: Transient, ChunkSectors: 2})
	mustWrite(t, s, []byte{1}, 0)
	mustWrite(t, s, []byte{1}, 5000)
	if got, want := s.Status(), "4/16 0"; got != want {
		t.Fatalf("status %q, want %q", got, want)
	}
}

// A write of no bytes claims no chunk: the chunk holding its offset keeps
// reading the origin, and the COW is not touched.
func TestZeroLengthWrite(t *testing.T) {
	for _, typ := range []Type{Persistent, Transient} {
		t.Run(typ.String(), func(t *testing.T) {
			origin, cowMem := newPair(t, 16<<10, 64<<10)
			cow := backing.NewRecorder(cowMem)
			s := open(t, origin, cow, Options{Type: typ, ChunkSectors: 8})
			status := s.Status()
			cow.Reset()
			for _, off := range []int64{0, 4096 + 100} {
				if n, err := s.WriteAt(nil, off); n != 0 || err != nil {
					t.Fatalf("WriteAt(nil, %d) = %d, %v", off, n, err)
				}
			}
			if calls := cow.Calls(); len(calls) != 0 {
				t.Fatalf("a write of no bytes reached the COW: %v", calls)
			}
			if got := s.Status(); got != status {
				t.Fatalf("status %q after writes of no bytes, was %q", got, status)
			}
			if !bytes.Equal(readAll(t, s), readAll(t, origin)) {
				t.Fatal("the snapshot no longer reads the origin after writes of no bytes")
			}
		})
	}
}

// TestFull checks what happens when the COW fills up, per store type.
func TestFull(t *testing.T) {
	cases := []struct {
		name        string
		typ         Type
		snapErr     error  // a snapshot write that needs a new chunk
		status      string // after it
		readWorks   bool
		originKills bool // an origin write needing a copy-out then invalidates
	}{
		{"P invalidates", Persistent, ErrInvalid, "Invalid", false, false},
		{"PO overflows", PersistentOverflow, ErrOverflow, "Overflow", true, true},
		{"N invalidates", Transient, ErrInvalid, "Invalid", false, false},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			// chunk 1: COW of 6 chunks holds header, area 0 and 4 data chunks
			// (N: 6 data chunks).
			origin, cow := newPair(t, 16<<10, 6*512)
			s := open(t, origin, cow, Options{Type: tc.typ, ChunkSectors: 1})
			o, _ := NewOrigin("origin", origin, 0)
			var err error
			for c := int64(0); c < 16 && err == nil; c++ {
				_, err = s.WriteAt([]byte{0xEE}, c*512)
			}
			if !errors.Is(err, tc.snapErr) {
				t.Fatalf("write on full COW: %v, want %v", err, tc.snapErr)
			}
			if got := s.Status(); got != tc.status {
				t.Fatalf("status %q, want %q", got, tc.status)
			}
			buf := make([]byte, 512)
			_, err = s.ReadAt(buf, 0)
			if (err == nil) != tc.readWorks {
				t.Fatalf("read after full: %v, want works=%v", err, tc.readWorks)
			}
			if tc.readWorks && buf[0] != 0xEE {
				t.Fatalf("read after overflow: %#x, want the written 0xee", buf[0])
			}
			// An origin write always succeeds.
			mustWrite(t, o, []byte{0x55}, 15*512)
			if tc.originKills {
				if got := s.Status(); got != "Invalid" {
					t.Fatalf("after origin copy-out into full COW: status %q, want Invalid", got)
				}
			}
			if tc.typ == Transient {
				return
			}
			// Persistent: valid = 0 is on disk once invalid.
			var h [16]byte
			cow.ReadAt(h[:], 0)
			valid := binary.LittleEndian.Uint32(h[4:])
			if invalid := s.Status() == "Invalid"; invalid != (valid == 0) {
				t.Fatalf("status %s but header valid = %d", s.Status(), valid)
			}
			if valid == 0 {
				s.Close()
				s2 := open(t, origin, cow, Options{Type: tc.typ, ChunkSectors: 1})
				if got := s2.Status(); got != "Invalid" {
					t.Fatalf("reopened invalid store: status %q", got)
				}
				if _, err := s2.ReadAt(buf, 0); !errors.Is(err, ErrInvalid) {
					t.Fatalf("read on reopened invalid store: %v", err)
				}
			}
		})
	}
}

func TestOpenErrors(t *testing.T) {
	hdr := func(magic, valid, version, chunk uint32) []byte {
		b := make([]byte, 16)
		header{magic, valid, version, chunk}.encode(b)
		return b
	}
	cases := []struct {
		name    string
		cowHead []byte
		opt     Options
		cowSize int64
		want    error
	}{
		{"bad magic", []byte("not a snapshot!!"), Options{Type: Persistent, ChunkSectors: 8}, 64 << 10, ErrCorrupt},
		{"version 2", hdr(diskMagic, 1, 2, 8), Options{Type: Persistent, ChunkSectors: 8}, 64 << 10, ErrVersion},
		{"on-disk chunk 3", hdr(diskMagic, 1, 1, 3), Options{Type: Persistent, ChunkSectors: 8}, 64 << 10, ErrChunkSize},
		{"table chunk 12", nil, Options{Type: Persistent, ChunkSectors: 12}, 64 << 10, ErrChunkSize},
		{"N without chunk", nil, Options{Type: Transient}, 64 << 10, ErrChunkSize},
		{"COW smaller than header+area", nil, Options{Type: Persistent, ChunkSectors: 8}, 6 << 10, ErrCOWSize},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			origin, cow := newPair(t, 16<<10, tc.cowSize)
			if tc.cowHead != nil {
				mustWrite(t, cow, tc.cowHead, 0)
			}
			s, err := Open("snap", origin, cow, tc.opt)
			if !errors.Is(err, tc.want) {
				t.Fatalf("Open: %v, want %v", err, tc.want)
			}
			if s != nil {
				s.Close()
			}
		})
	}
	t.Run("same device", func(t *testing.T) {
		origin, _ := newPair(t, 16<<10, 0)
		if _, err := Open("snap", origin, origin, Options{Type: Transient, ChunkSectors: 8}); !errors.Is(err, ErrSameDevice) {
			t.Fatalf("Open: %v, want ErrSameDevice", err)
		}
	})
	t.Run("COW in use", func(t *testing.T) {
		// The second snapshot on a COW is a handover destination; a third
		// is refused, as dm refuses it.
		origin, cow := newPair(t, 16<<10, 64<<10)
		open(t, origin, cow, Options{Type: Persistent, ChunkSectors: 8})
		open(t, origin, cow, Options{Type: Persistent, ChunkSectors: 8})
		if _, err := Open("snap3", origin, cow, Options{Type: Persistent, ChunkSectors: 8}); !errors.Is(err, ErrCOWInUse) {
			t.Fatalf("Open: %v, want ErrCOWInUse", err)
		}
	})
	t.Run("merge of N", func(t *testing.T) {
		origin, cow := newPair(t, 16<<10, 64<<10)
		if _, err := Open("m", origin, cow, Options{Type: Transient, ChunkSectors: 8, Merge: true}); !errors.Is(err, ErrMergeStore) {
			t.Fatalf("Open: %v, want ErrMergeStore", err)
		}
	})
}

// TestHeaderChunkWins: an existing store's chunk size overrides the table's,
// as dm does, and the table line then prints the on-disk size.
func TestHeaderChunkWins(t *testing.T) {
	origin, cow := newPair(t, 16<<10, 64<<10)
	s := open(t, origin, cow, Options{Type: Persistent, ChunkSectors: 4})
	mustWrite(t, s, []byte("x"), 3000)
	s.Close()
	s2 := open(t, origin, cow, Options{Type: Persistent, ChunkSectors: 16})
	if s2.ChunkSectors() != 4 {
		t.Fatalf("chunk %d, want the on-disk 4", s2.ChunkSectors())
	}
	checkRead(t, 0, s2, append(patternOf(t, origin, 3000), 'x'), 0, 3001)
	// Chunk 0 with a table size of 0: a new store gets dm's default, 32.
	origin2, cow2 := newPair(t, 16<<10, 64<<10)
	if s3 := open(t, origin2, cow2, Options{Type: Persistent}); s3.ChunkSectors() != defaultChunkSectors {
		t.Fatalf("default chunk %d", s3.ChunkSectors())
	}
}

func patternOf(t *testing.T, d backing.Device, n int64) []byte {
	b := make([]byte, n)
	if _, err := d.ReadAt(b, 0); err != nil {
		t.Fatal(err)
	}
	return b
}

// TestCommitOrder checks what reaches the COW device for a partial write to
// a chunk without an exception: the data chunk, a sync, the metadata, a sync.
func TestCommitOrder(t *testing.T) {
	origin, cowMem := newPair(t, 16<<10, 64<<10)
	cow := backing.NewRecorder(cowMem)
	s := open(t, origin, cow, Options{Type: Persistent, ChunkSectors: 8})
	cow.Reset()
	mustWrite(t, s, []byte("hello"), 4096+100)
	var got []string
	for _, c := range cow.Calls() {
		got = append(got, c.String())
	}
	want := []string{
		"write 8192+4096", // COW chunk 2 <- origin chunk 1 with the write
		"sync",
		"write 4096+512", // area 0, first sector
		"sync",
	}
	if strings.Join(got, "; ") != strings.Join(want, "; ") {
		t.Fatalf("COW calls:\n got %q\nwant %q", got, want)
	}
	// A second write to the same chunk goes in place, with no sync.
	cow.Reset()
	mustWrite(t, s, []byte("again"), 4096+200)
	if got := cow.Calls(); len(got) != 1 || got[0].String() != "write 8392+5" {
		t.Fatalf("in-place write: %v", got)
	}
}

// A new store zeroes area 0 and syncs it before it writes the header, so
// that no crash leaves a valid header over an older store's exceptions.
func TestCreateOrder(t *testing.T) {
	origin, cowMem := newPair(t, 16<<10, 64<<10)
	mustWrite(t, cowMem, bytes.Repeat([]byte{0xbb}, 4096), 4096) // an old area 0, no header
	cow := backing.NewRecorder(cowMem)
	open(t, origin, cow, Options{Type: Persistent, ChunkSectors: 8})
	var got []string
	for _, c := range cow.Calls() {
		got = append(got, c.String())
	}
	want := []string{"write 4096+4096", "sync", "write 0+4096", "sync"}
	if strings.Join(got, "; ") != strings.Join(want, "; ") {
		t.Fatalf("COW calls creating a store:\n got %q\nwant %q", got, want)
	}
}

// TestCrashPoints crashes the COW device (dropping everything not synced)
// after each sync of a commit, reopens, and checks the snapshot shows
// either the old chunk or the new write, never anything else.
func TestCrashPoints(t *testing.T) {
	for crashAfter := 0; crashAfter <= 2; crashAfter++ {
		t.Run(fmt.Sprintf("after %d syncs", crashAfter), func(t *testing.T) {
			origin, cowMem := newPair(t, 16<<10, 64<<10)
			cow := backing.NewFaulty(cowMem)
			s := open(t, origin, cow, Options{Type: Persistent, ChunkSectors: 8})
			old := patternOf(t, s, 16<<10)
			syncs := 0
			cow.BeforeSync(func() {
				if syncs == crashAfter {
					cow.FailSync(errors.New("power cut"))
				}
				syncs++
			})
			_, werr := s.WriteAt([]byte("new data"), 4096+10)
			cow.Crash()
			s.Close()
			cow.FailSync(nil)
			cow.BeforeSync(nil)
			s2 := open(t, origin, cowMem, Options{Type: Persistent, ChunkSectors: 8})
			got := patternOf(t, s2, 16<<10)
			withWrite := bytes.Clone(old)
			copy(withWrite[4096+10:], "new data")
			switch {
			case bytes.Equal(got, old):
				if werr == nil {
					t.Fatal("write acknowledged but lost")
				}
			case bytes.Equal(got, withWrite):
			default:
				t.Fatal("snapshot shows neither the old nor the new data")
			}
		})
	}
}

// TestDiscard: dropped without discard_zeroes_cow; with it, chunks that
// have an exception read back zeros, others keep the origin's data.
func TestDiscard(t *testing.T) {
	origin, cow := newPair(t, 16<<10, 64<<10)
	s := open(t, origin, cow, Options{Type: Persistent, ChunkSectors: 8})
	if err := s.Discard(0, 8192); !errors.Is(err, backing.ErrNotSupported) {
		t.Fatalf("discard without feature: %v", err)
	}
	origin2, cow2 := newPair(t, 16<<10, 64<<10)
	s2 := open(t, origin2, cow2, Options{Type: Persistent, ChunkSectors: 8, DiscardZeroesCOW: true})
	want := patternOf(t, origin2, 16<<10)
	mustWrite(t, s2, []byte{9}, 4096) // exception for chunk 1
	if err := s2.Discard(0, 12288); err != nil {
		t.Fatal(err)
	}
	clear(want[4096:8192])
	checkRead(t, 0, s2, want, 0, 16<<10)
	if got := s2.Status(); got != "24/128 16" { // chunks 0..2, 8 sectors each
		t.Fatalf("discard allocated chunks: status %q", got)
	}
	if s2.Features()[1] != "discard_zeroes_cow" {
		t.Fatalf("features %v", s2.Features())
	}
}

// An exception a COW device cannot hold refuses the store at Open: served,
// a COW chunk past 2^64 bytes wraps onto the header, a metadata chunk is
// read as data and written over by the next exception, a chunk past the
// end grows a COW file, and an origin chunk past 2^63 bytes wraps onto the
// origin's start.
func TestOpenHostileExceptions(t *testing.T) {
	const chunk = 4096 // 8 sectors; area 0 is chunk 1, 256 exceptions per area
	cases := []struct {
		name string
		e    exception
	}{
		{"COW chunk wraps to 0", exception{Old: 0, New: 1 << 52}},
		{"metadata area 0", exception{Old: 0, New: 1}},
		{"metadata area 1", exception{Old: 0, New: 1 + 257}},
		{"past the COW's end", exception{Old: 0, New: 16}},
		{"origin chunk wraps", exception{Old: 1 << 52, New: 2}},
	}
	open := func(t *testing.T, es ...exception) (*Snapshot, error) {
		origin, cow := newPair(t, 16<<10, 16*chunk)
		hdr := make([]byte, chunk)
		header{diskMagic, 1, diskVersion, chunk / 512}.encode(hdr)
		mustWrite(t, cow, hdr, 0)
		area := make([]byte, chunk)
		for i, e := range es {
			putException(area, i, e)
		}
		mustWrite(t, cow, area, chunk)
		return Open("snap", origin, cow, Options{Type: Persistent})
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			s, err := open(t, exception{Old: 1, New: 2}, tc.e)
			if err == nil {
				s.Close()
			}
			if !errors.Is(err, ErrCorrupt) {
				t.Fatalf("Open with exception %+v: %v, want %v", tc.e, err, ErrCorrupt)
			}
		})
	}
	t.Run("the last chunk", func(t *testing.T) {
		s, err := open(t, exception{Old: 1, New: 2}, exception{Old: 3, New: 15})
		if err != nil {
			t.Fatal(err)
		}
		s.Close()
	})
}
