package backing

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"testing"
)

// gated is a Mem whose Holes computes its answer and then runs
// afterHoles, and whose WriteAt runs beforeWrite before writing: the
// windows in which a hole query and a write race. Hooks are set before
// the calls they gate.
type gated struct {
	*Mem
	afterHoles   func()
	beforeWrite  func()
	afterDiscard func() error
	beforeZero   func()
	limits       *Limits
}

func (g *gated) Zero(off, n int64, mayPunch bool) error {
	if g.beforeZero != nil {
		g.beforeZero()
	}
	return g.Mem.Zero(off, n, mayPunch)
}

// Discard punches the Mem, then runs afterDiscard, whose error it returns.
func (g *gated) Discard(off, n int64) error {
	if err := g.Mem.Discard(off, n); err != nil {
		return err
	}
	if g.afterDiscard != nil {
		return g.afterDiscard()
	}
	return nil
}

func (g *gated) Limits() Limits {
	if g.limits != nil {
		return *g.limits
	}
	return g.Mem.Limits()
}

func (g *gated) Holes(off, n int64) ([]Range, error) {
	holes, err := g.Mem.Holes(off, n)
	if g.afterHoles != nil {
		g.afterHoles()
	}
	return holes, err
}

func (g *gated) WriteAt(p []byte, off int64) (int, error) {
	if g.beforeWrite != nil {
		g.beforeWrite()
	}
	return g.Mem.WriteAt(p, off)
}

// gate pauses a call until opened: wait blocks the caller of the hooked
// call; reached reports that it got there.
type gate struct{ reached, open chan struct{} }

func newGate() *gate  { return &gate{reached: make(chan struct{}), open: make(chan struct{})} }
func (g *gate) wait() { close(g.reached); <-g.open }

func fill(n int, v byte) []byte { return bytes.Repeat([]byte{v}, n) }

// openSparse creates a file of size bytes with no blocks allocated and
// opens it; it is closed with the test.
func openSparse(t *testing.T, size int64) *File {
	t.Helper()
	path := filepath.Join(t.TempDir(), "sparse.img")
	if err := os.WriteFile(path, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(path, size); err != nil {
		t.Fatal(err)
	}
	f, err := OpenFile(path, false)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	return f
}

// mustData checks that [off, off+len(want)) of h reads back as want with
// no hole reported, and that Holes reports none there either.
func mustData(t *testing.T, h *HoleMap, off int64, want []byte) {
	t.Helper()
	buf := fill(len(want), 0xee)
	holes, err := h.ReadAtSparse(buf, off, 1, 8, nil)
	if err != nil || len(holes) != 0 || !bytes.Equal(buf, want) {
		t.Fatalf("ReadAtSparse: holes %v, err %v, data %x... (want %x...)", holes, err, buf[:8], want[:8])
	}
	if holes, err := h.Holes(off, int64(len(want))); err != nil || len(holes) != 0 {
		t.Fatalf("Holes: %v, %v; want none", holes, err)
	}
}

func mustHole(t *testing.T, h *HoleMap, off, n int64) {
	t.Helper()
	if holes, err := h.Holes(off, n); err != nil || !slices.Equal(holes, []Range{{off, n}}) {
		t.Fatalf("Holes(%d, %d) = %v, %v; want all of it", off, n, holes, err)
	}
}

// TestHoleMapRaces drives each race between a hole query and a change of
// the same chunk through its interleaving, and checks that what is known
// afterwards is the device's truth: a query that raced a write is used for
// its own read but never kept.
func TestHoleMapRaces(t *testing.T) {
	data := fill(4096, 0xab)
	for _, tc := range []struct {
		name    string
		run     func(t *testing.T, g *gated, h *HoleMap)
		refused uint64
	}{
		{"a write completes while a query runs", func(t *testing.T, g *gated, h *HoleMap) {
			q := newGate()
			g.afterHoles = q.wait
			done := make(chan []Range)
			go func() { holes, _ := h.Holes(0, 4096); done <- holes }()
			<-q.reached // the device answered "hole"
			g.afterHoles = nil
			if _, err := h.WriteAt(data, 0); err != nil {
				t.Fatal(err)
			}
			close(q.open)
			<-done // hole or data: the two were concurrent
			mustData(t, h, 0, data)
		}, 1},
		{"a query answers while a write is in flight", func(t *testing.T, g *gated, h *HoleMap) {
			w := newGate()
			g.beforeWrite = w.wait
			wrote := make(chan error)
			go func() { _, err := h.WriteAt(data, 0); wrote <- err }()
			<-w.reached
			h.Holes(0, 4096) // the device still says "hole"
			close(w.open)
			if err := <-wrote; err != nil {
				t.Fatal(err)
			}
			mustData(t, h, 0, data)
		}, 1},
		{"a query starts during a write that completes before it answers", func(t *testing.T, g *gated, h *HoleMap) {
			w, q := newGate(), newGate()
			g.beforeWrite, g.afterHoles = w.wait, q.wait
			wrote, asked := make(chan error), make(chan struct{})
			go func() { _, err := h.WriteAt(data, 0); wrote <- err }()
			<-w.reached
			go func() { h.Holes(0, 4096); close(asked) }()
			<-q.reached
			g.afterHoles = nil
			close(w.open)
			if err := <-wrote; err != nil {
				t.Fatal(err)
			}
			close(q.open)
			<-asked
			mustData(t, h, 0, data)
		}, 1},
		{"a write over a known hole needs no query to be seen", func(t *testing.T, g *gated, h *HoleMap) {
			mustHole(t, h, 0, holeChunk)
			queries := h.Stats().Queries
			if _, err := h.WriteAt(data[:100], 5000); err != nil {
				t.Fatal(err)
			}
			if holes, _ := h.Holes(0, holeChunk); !slices.Equal(holes, []Range{{0, 4096}, {8192, holeChunk - 8192}}) {
				t.Fatalf("holes %v after a write at 5000+100", holes)
			}
			if q := h.Stats().Queries; q != queries {
				t.Fatalf("%d queries after the write, want none", q-queries)
			}
		}, 0},
		{"a discard makes holes of the granules it covers, and the next read needs no query", func(t *testing.T, g *gated, h *HoleMap) {
			h.WriteAt(fill(3*4096, 1), 0)
			mustData(t, h, 0, fill(3*4096, 1))
			if err := h.Discard(100, 2*4096); err != nil { // granule 1 whole, 0 and 2 in part
				t.Fatal(err)
			}
			if holes, _ := h.Holes(0, holeChunk); !slices.Equal(holes, []Range{{4096, 4096}, {3 * 4096, holeChunk - 3*4096}}) {
				t.Fatalf("holes %v after discarding 100+8192", holes)
			}
			if st := h.Stats(); st.Learned != 1 || st.Forgot != 0 || st.Queries != 1 {
				t.Fatalf("stats %+v: want 1 chunk learned, nothing forgotten, 1 query", st)
			}
		}, 0},
		{"a discard covering an unknown chunk whole makes it known", func(t *testing.T, g *gated, h *HoleMap) {
			h.WriteAt(data, holeChunk)
			if err := h.Discard(holeChunk/2, 2*holeChunk); err != nil {
				t.Fatal(err)
			}
			mustHole(t, h, holeChunk, holeChunk)
			if st := h.Stats(); st.Learned != 1 || st.Queries != 0 || st.Known != 1 {
				t.Fatalf("stats %+v: want chunk 1 alone learned, no query", st)
			}
			mustHole(t, h, holeChunk/2, holeChunk/2) // chunk 0: asked, as chunk 2 would be
			if st := h.Stats(); st.Queries != 1 {
				t.Fatalf("stats %+v: want 1 query for the chunk covered in part", st)
			}
		}, 0},
		{"discards and zeroings of known holes do not reach the device", func(t *testing.T, g *gated, h *HoleMap) {
			mustHole(t, h, 0, holeChunk)
			calls := 0
			g.afterDiscard = func() error { calls++; return nil }
			if err := h.Discard(4096, 3*4096+10); err != nil {
				t.Fatal(err)
			}
			if err := h.Zero(0, holeChunk, true); err != nil {
				t.Fatal(err)
			}
			if st := h.Stats(); calls != 0 || st.Skipped != 2 {
				t.Fatalf("stats %+v, %d discards reached the device: want both skipped", st, calls)
			}
			if err := h.Zero(0, 4096, false); err != nil { // must allocate: reaches the device
				t.Fatal(err)
			}
			h.WriteAt(data[:1], holeChunk-1)
			if err := h.Discard(holeChunk-4096, 4096); err != nil {
				t.Fatal(err)
			}
			if st := h.Stats(); calls != 1 || st.Skipped != 2 {
				t.Fatalf("stats %+v, %d discards reached the device: want the one over data", st, calls)
			}
		}, 0},
		{"a write that lands after a punch, before its discard returns, stays data", func(t *testing.T, g *gated, h *HoleMap) {
			h.WriteAt(data, 0)
			mustData(t, h, 0, data)
			d := newGate()
			g.afterDiscard = func() error { d.wait(); return nil } // the device punched
			done := make(chan error)
			go func() { done <- h.Discard(0, 4096) }()
			<-d.reached
			if _, err := h.WriteAt(data, 0); err != nil {
				t.Fatal(err)
			}
			close(d.open)
			if err := <-done; err != nil {
				t.Fatal(err)
			}
			mustData(t, h, 0, data)
			if st := h.Stats(); st.Learned != 0 || st.Forgot != 1 {
				t.Fatalf("stats %+v: want the chunk forgotten, not learned", st)
			}
		}, 0},
		{"a write or zeroing elsewhere in flight while a discard runs: the discard forgets", func(t *testing.T, g *gated, h *HoleMap) {
			for k, change := range []struct {
				hook *func()
				run  func() error
			}{
				{&g.beforeWrite, func() error { _, err := h.WriteAt(data, 3*holeChunk); return err }},
				{&g.beforeZero, func() error { return h.Zero(3*holeChunk, 4096, false) }},
			} {
				h.WriteAt(data, 0)
				mustData(t, h, 0, data)
				c := newGate()
				*change.hook = c.wait
				changed := make(chan error)
				go func() { changed <- change.run() }()
				<-c.reached
				*change.hook = nil
				if err := h.Discard(0, 4096); err != nil {
					t.Fatal(err)
				}
				close(c.open)
				if err := <-changed; err != nil {
					t.Fatal(err)
				}
				if st := h.Stats(); st.Learned != 0 || st.Forgot != uint64(k+1) {
					t.Fatalf("change %d: stats %+v: want the chunk forgotten, not learned", k, st)
				}
				mustHole(t, h, 0, 4096)
			}
		}, 0},
		{"a failed or panicking discard forgets", func(t *testing.T, g *gated, h *HoleMap) {
			h.WriteAt(data, 0)
			mustData(t, h, 0, data)
			g.afterDiscard = func() error { return ErrNotSupported }
			if err := h.Discard(0, 4096); err != ErrNotSupported {
				t.Fatalf("Discard: %v, want the device's error", err)
			}
			mustHole(t, h, 0, 4096) // the Mem did punch: asked again
			h.WriteAt(data, 0)
			mustData(t, h, 0, data)
			g.afterDiscard = func() error { panic("device bug") }
			func() {
				defer func() { recover() }()
				h.Discard(0, 4096)
			}()
			if st := h.Stats(); st.Learned != 0 || st.Forgot != 2 {
				t.Fatalf("stats %+v: want two chunks forgotten, none learned", st)
			}
		}, 0},
		{"a device whose discards may leave data: the discard forgets", func(t *testing.T, g *gated, h *HoleMap) {
			g.limits = &Limits{Granularity: 4096}
			h = NewHoleMap(g)
			h.WriteAt(data, 0)
			mustData(t, h, 0, data)
			if err := h.Discard(0, 4096); err != nil {
				t.Fatal(err)
			}
			if st := h.Stats(); st.Learned != 0 || st.Forgot != 1 {
				t.Fatalf("stats %+v: want the chunk forgotten", st)
			}
		}, 0},
		{"a discard completes while a query runs", func(t *testing.T, g *gated, h *HoleMap) {
			h.WriteAt(data, 0)
			q := newGate()
			g.afterHoles = q.wait
			asked := make(chan struct{})
			go func() { h.Holes(0, 4096); close(asked) }() // the device says "data"
			<-q.reached
			g.afterHoles = nil
			h.Discard(0, 4096)
			close(q.open)
			<-asked
			mustHole(t, h, 0, 4096)
		}, 1},
		{"a zeroing that keeps the blocks reads as zeros", func(t *testing.T, g *gated, h *HoleMap) {
			h.WriteAt(data, 0)
			mustData(t, h, 0, data)
			h.Zero(0, 4096, false)
			mustData(t, h, 0, make([]byte, 4096))
		}, 0},
		{"a durable write marks like a write", func(t *testing.T, g *gated, h *HoleMap) {
			d := NewHoleMap(dsyncMem{g.Mem})
			mustHole(t, d, 0, 4096)
			if _, err := d.WriteAtDSync(data, 0); err != nil {
				t.Fatal(err)
			}
			mustData(t, d, 0, data)
			if _, err := h.WriteAtDSync(data, 0); err != ErrNotSupported {
				t.Fatalf("WriteAtDSync without one below: %v, want ErrNotSupported", err)
			}
		}, 0},
		{"a panicking write still ends", func(t *testing.T, g *gated, h *HoleMap) {
			g.beforeWrite = func() { panic("device bug") }
			func() {
				defer func() { recover() }()
				h.WriteAt(data, 0)
			}()
			g.beforeWrite = nil
			for i := range h.slots {
				if h.slots[i].writing != 0 {
					t.Fatalf("slot %d: %d writes in flight after the panic", i, h.slots[i].writing)
				}
			}
			mustHole(t, h, 4096, 4096) // a query of the chunk is kept again
			if st := h.Stats(); st.Refused != 0 {
				t.Fatalf("stats %+v: answer refused after the write ended", st)
			}
		}, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g := &gated{Mem: NewMem("m", 4<<20)}
			h := NewHoleMap(g)
			tc.run(t, g, h)
			if st := h.Stats(); st.Refused != tc.refused {
				t.Errorf("stats %+v: want %d refused", st, tc.refused)
			}
		})
	}
}

type dsyncMem struct{ *Mem }

func (d dsyncMem) WriteAtDSync(p []byte, off int64) (int, error) { return d.WriteAt(p, off) }

// TestHoleMapEviction: a chunk whose slot another chunk takes becomes
// unknown, never a hole, and the table never grows.
func TestHoleMapEviction(t *testing.T) {
	m := NewMem("big", 2*holeSlotsMax*holeChunk) // twice as many chunks as slots
	h := NewHoleMap(m)
	far := int64(holeSlotsMax * holeChunk) // same slot as chunk 0
	mustHole(t, h, 0, 4096)
	m.WriteAt(fill(4096, 1), 0) // behind the map's back: only a test does this
	mustHole(t, h, far, 4096)   // evicts chunk 0
	mustData(t, h, 0, fill(4096, 1))
	st := h.Stats()
	if st.Evicted != 2 || st.Slots != holeSlotsMax || st.Known > st.Slots || st.Bytes != holeSlotsMax*24 {
		t.Fatalf("stats %+v", st)
	}
	// A discard covering more chunks than there are slots passes every slot
	// once: chunk 0, known, learns its holes; no other chunk becomes known.
	h.Discard(0, m.Size())
	if st := h.Stats(); st.Known != 1 || st.Learned != 1 {
		t.Fatalf("stats %+v after discarding everything: want chunk 0 alone known", st)
	}
	mustHole(t, h, 0, m.Size())
}

// TestHoleMapFollowsDevice applies random writes, discards and zeroings
// through a HoleMap over a Mem (whose holes are exact, in 4 KiB pages, the
// map's granule) and checks every answer against the Mem's.
func TestHoleMapFollowsDevice(t *testing.T) {
	for _, size := range []int64{3 * holeChunk / 2, 40 << 20, 2*holeSlotsMax*holeChunk + 5*holeGranule} {
		t.Run(fmt.Sprint(size), func(t *testing.T) {
			rng := rand.New(rand.NewPCG(uint64(size), 7))
			m := NewMem("m", size)
			h := NewHoleMap(m)
			span := func(maxLen int64) (int64, int64) {
				off := rng.Int64N(size)
				if size > 64<<20 && rng.IntN(2) == 0 { // far apart: slots collide
					off = rng.Int64N(4)*holeSlotsMax*holeChunk + rng.Int64N(8*holeChunk)
				}
				off = min(off, size-1)
				return off, 1 + rng.Int64N(min(maxLen, size-off))
			}
			for i := range 1500 {
				off, n := span(128 << 10)
				switch k := rng.IntN(6); k {
				case 0, 1, 2, 3:
					change(h, rng, k, byte(i)|1, off, n)
				case 4:
					want, _ := m.Holes(off, n)
					got, err := h.Holes(off, n)
					if err != nil || !slices.Equal(got, want) {
						t.Fatalf("op %d: Holes(%d, %d) = %v, %v; device says %v", i, off, n, got, err, want)
					}
				case 5:
					off, n = span([]int64{1 << 20, 1 << 20, 1 << 20, 1 << 20, 1 << 20, 1 << 20, 1 << 20, 6 << 20}[rng.IntN(8)]) // some longer than a window of queries (4 MiB)
					minHole, maxHoles := []int64{1, 4096, 65536}[rng.IntN(3)], 1+rng.IntN(8)
					want := make([]byte, n)
					m.ReadAt(want, off)
					got := fill(int(n), 0xee)
					holes, err := h.ReadAtSparse(got, off, minHole, maxHoles, nil)
					if err != nil || len(holes) > maxHoles {
						t.Fatalf("op %d: ReadAtSparse(%d+%d): %d holes (max %d), %v", i, off, n, len(holes), maxHoles, err)
					}
					truth, _ := m.Holes(off, n)
					for k, r := range holes {
						if r.Len < minHole && r.Len != n || (k > 0 && r.Off < holes[k-1].End()) || !covered(truth, r) {
							t.Fatalf("op %d: ReadAtSparse(%d+%d, min %d) reported hole %v of %v; device holes %v", i, off, n, minHole, r, holes, truth)
						}
						clear(got[r.Off-off : r.End()-off])
					}
					if !bytes.Equal(got, want) {
						t.Fatalf("op %d: ReadAtSparse(%d+%d) data differs", i, off, n)
					}
				}
			}
			if st := h.Stats(); st.Hits == 0 || st.Misses == 0 || st.Known > st.Slots {
				t.Fatalf("stats %+v", st)
			}
		})
	}
}

// change makes change k (0-3) of [off, off+n) through h: a write of v
// (0 and 1), a discard (2), a zeroing that may or may not punch (3).
func change(h *HoleMap, rng *rand.Rand, k int, v byte, off, n int64) {
	switch k {
	case 0, 1:
		h.WriteAt(fill(int(n), v), off)
	case 2:
		h.Discard(off, n)
	case 3:
		h.Zero(off, n, rng.IntN(2) == 0)
	}
}

// covered reports whether r lies inside one of holes (ascending, merged).
func covered(holes []Range, r Range) bool {
	for _, h := range holes {
		if h.Off <= r.Off && r.End() <= h.End() {
			return true
		}
	}
	return false
}

// TestHoleMapFile checks the map over a real sparse file against the file
// system's own answer, rounded to whole granules, including a last
// granule cut short by the end of the file.
func TestHoleMapFile(t *testing.T) {
	const size = 3*holeChunk + 10000
	f := openSparse(t, size)
	h := NewHoleMap(f)
	if holes, err := f.Holes(0, size); err != nil || len(holes) != 1 {
		t.Skipf("file system reports no holes in a fresh sparse file: %v %v", holes, err)
	}
	mustHole(t, h, 0, size)
	h.WriteAt(fill(100, 1), 0)
	h.WriteAt(fill(5000, 2), holeChunk+4096)
	h.WriteAt(fill(10, 3), size-5000)
	const g193, g194 = 193 * holeGranule, 194 * holeGranule // the granules written last, and the short last one
	want := []Range{{4096, holeChunk}, {holeChunk + 3*4096, g193 - (holeChunk + 3*4096)}, {g194, size - g194}}
	if holes, err := h.Holes(0, size); err != nil || !slices.Equal(holes, want) {
		t.Fatalf("holes %v, %v; want %v (file says %v)", holes, err, want, must(f.Holes(0, size)))
	}
	if err := h.Discard(0, 2*holeChunk); err != nil {
		t.Fatal(err)
	}
	h.WriteAt(fill(10, 4), size-1000) // the short last granule is data now
	want = []Range{{0, g193}}
	if holes, err := h.Holes(0, size); err != nil || !slices.Equal(holes, want) {
		t.Fatalf("after discard: holes %v, %v; want %v (file says %v)", holes, err, want, must(f.Holes(0, size)))
	}
	buf := fill(8192, 0xee)
	holes, err := h.ReadAtSparse(buf, size-8192, 4096, 4, nil) // the 2288-byte hole in front is read
	if err != nil || len(holes) != 0 || buf[8192-1000] != 4 || buf[8192-5000+10] != 0 {
		t.Fatalf("tail read: holes %v, %v", holes, err)
	}
}

func must(r []Range, _ error) []Range { return r }

// TestHoleMapDataAhead: a question about a file that finds no hole in its
// range also finds how far the data runs (SEEK_HOLE), and the map keeps
// the chunks up to there as data, so that reads of them ask nothing more;
// never as holes, and never over a chunk it knows.
func TestHoleMapDataAhead(t *testing.T) {
	const size = 40*holeChunk + 1000 // a short last chunk
	f := openSparse(t, size)
	if _, err := f.WriteAt(fill(20*holeChunk, 1), 0); err != nil {
		t.Fatal(err)
	}
	if _, err := f.WriteAt(fill(16*holeChunk+1000, 2), 24*holeChunk); err != nil {
		t.Fatal(err)
	}
	if holes, err := f.Holes(0, size); err != nil || !slices.Equal(holes, []Range{{20 * holeChunk, 4 * holeChunk}}) {
		t.Skipf("file system does not report the hole written around: %v %v", holes, err)
	}
	h := NewHoleMap(f)
	queries := func(want uint64, ahead uint64) {
		t.Helper()
		if st := h.Stats(); st.Queries != want || st.Ahead != ahead {
			t.Fatalf("%d questions to the file, %d chunks kept ahead; want %d and %d (%+v)", st.Queries, st.Ahead, want, ahead, st)
		}
	}
	mustData(t, h, 2*holeChunk, fill(4096, 1))
	queries(1, 17) // chunks 3-19
	for c := int64(3); c < 20; c++ {
		mustData(t, h, c*holeChunk+8192, fill(4096, 1))
	}
	queries(1, 17)
	mustData(t, h, 0, fill(4096, 1)) // chunk 1 too; 2 and up are known
	queries(2, 18)
	mustData(t, h, holeChunk, fill(4096, 1))
	queries(2, 18)

	mustHole(t, h, 20*holeChunk, 4*holeChunk) // no data after the range: nothing ahead
	queries(3, 18)
	mustData(t, h, 30*holeChunk, fill(4096, 2)) // up to the end of the file
	queries(4, 28)
	mustData(t, h, size-1000, fill(1000, 2))
	mustData(t, h, 25*holeChunk, fill(4096, 2)) // before that question: asked, and 26-29 kept
	queries(5, 32)

	// A chunk known as holes stays so: what the map knows is never
	// overwritten by data ahead of a question.
	h2 := NewHoleMap(f)
	mustHole(t, h2, 20*holeChunk, holeChunk)
	mustData(t, h2, 0, fill(4096, 1))
	mustHole(t, h2, 20*holeChunk, 4*holeChunk)
	if st := h2.Stats(); st.Ahead != 19 || st.Queries != 3 {
		t.Fatalf("second map: %+v", st)
	}
}

// TestHoleMapConcurrent: writers, each owning some 4 KiB blocks, write,
// discard and zero them and read each back after its change is
// acknowledged, while readers keep asking about every chunk (so that
// queries race every change, on shared chunks). A read that starts after a
// write was acknowledged must see its data: never a hole, never zeros.
func TestHoleMapConcurrent(t *testing.T) {
	devs := map[string]func(t *testing.T) Device{
		"mem": func(t *testing.T) Device { return NewMem("m", 2<<20) },
		"file": func(t *testing.T) Device {
			path := filepath.Join(t.TempDir(), "f")
			os.WriteFile(path, nil, 0o644)
			os.Truncate(path, 2<<20)
			f, err := OpenFile(path, false)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { f.Close() })
			return f
		},
	}
	for name, open := range devs {
		t.Run(name, func(t *testing.T) {
			h := NewHoleMap(open(t))
			const writers, blocks, rounds = 6, 512, 300
			var wg sync.WaitGroup
			stop := make(chan struct{})
			for r := range 2 {
				wg.Add(1)
				go func() {
					defer wg.Done()
					rng := rand.New(rand.NewPCG(uint64(r), 1))
					buf := make([]byte, 64<<10)
					for {
						select {
						case <-stop:
							return
						default:
						}
						off := rng.Int64N(h.Size() - int64(len(buf)))
						if rng.IntN(2) == 0 {
							h.Holes(off, int64(len(buf)))
						} else {
							h.ReadAtSparse(buf, off, 4096, 8, nil)
						}
					}
				}()
			}
			errs := make(chan error, writers)
			var ww sync.WaitGroup
			for w := range writers {
				ww.Add(1)
				go func() {
					defer ww.Done()
					rng := rand.New(rand.NewPCG(uint64(w), 2))
					buf := make([]byte, 4096)
					for i := range rounds {
						b := int64(w + writers*rng.IntN(blocks/writers)) // blocks interleave across writers
						off := b * 4096
						v := byte(i%250) + 1
						want := fill(4096, v)
						switch rng.IntN(4) {
						case 0:
							h.Discard(off, 4096)
							want = make([]byte, 4096)
						case 1:
							h.Zero(off, 4096, rng.IntN(2) == 0)
							want = make([]byte, 4096)
						default:
							h.WriteAt(want, off)
						}
						holes, err := h.ReadAtSparse(buf, off, 1, 2, nil)
						for _, r := range holes {
							clear(buf[r.Off-off : r.End()-off])
						}
						if err != nil || !bytes.Equal(buf, want) || (want[0] != 0 && len(holes) > 0) {
							errs <- fmt.Errorf("writer %d round %d: block %d read back %x... with holes %v (%v), want %x...", w, i, b, buf[:4], holes, err, want[:4])
							return
						}
					}
				}()
			}
			ww.Wait()
			close(stop)
			wg.Wait()
			close(errs)
			for err := range errs {
				t.Error(err)
			}
			st := h.Stats()
			t.Logf("stats %+v", st)
			if st.Refused == 0 {
				t.Logf("no query raced a change (the race detector's scheduling may serialize them)")
			}
		})
	}
}

// TestHoleMapDiscardsRaceWrites: goroutines write, discard, zero and read
// the same few granules at once, so that punches race writes to the very
// bytes they cover; whenever all of them have stopped, every hole the map
// reports must be one on the device, and a sparse read must return the
// device's bytes. A punch learned while a write to its granule landed
// after it would show here as a hole over the write.
func TestHoleMapDiscardsRaceWrites(t *testing.T) {
	const size = 4 * holeChunk
	for name, open := range map[string]func(t *testing.T) Device{
		"mem":  func(t *testing.T) Device { return NewMem("m", size) },
		"file": func(t *testing.T) Device { return openSparse(t, size) },
	} {
		t.Run(name, func(t *testing.T) {
			dev := open(t)
			h := NewHoleMap(dev)
			for round := range 40 {
				var wg sync.WaitGroup
				for w := range 4 {
					wg.Add(1)
					go func() {
						defer wg.Done()
						rng := rand.New(rand.NewPCG(uint64(round), uint64(w)))
						buf := make([]byte, 3*4096)
						for i := range 50 {
							// granules 0-3 of chunks 0 and 2: everyone's
							off := rng.Int64N(2)*2*holeChunk + rng.Int64N(4)*4096 + rng.Int64N(2)*100
							n := 1 + rng.Int64N(int64(len(buf))-100)
							if k := rng.IntN(5); k < 4 {
								change(h, rng, k, byte(i)|1, off, n)
							} else {
								h.ReadAtSparse(buf[:n], off, 1, 4, nil)
							}
						}
					}()
				}
				wg.Wait()
				truth, err := dev.Holes(0, size)
				if err != nil {
					t.Fatal(err)
				}
				holes, err := h.Holes(0, size)
				if err != nil {
					t.Fatal(err)
				}
				for _, r := range holes {
					if !covered(truth, r) {
						t.Fatalf("round %d: the map reports hole %v; the device's holes are %v", round, r, truth)
					}
				}
				want := make([]byte, size)
				dev.ReadAt(want, 0)
				got := fill(size, 0xee)
				sparse, err := h.ReadAtSparse(got, 0, 1, 64, nil)
				if err != nil {
					t.Fatal(err)
				}
				for _, r := range sparse {
					clear(got[r.Off:r.End()])
				}
				if !bytes.Equal(got, want) {
					t.Fatalf("round %d: a sparse read of the device differs from its bytes", round)
				}
			}
			st := h.Stats()
			t.Logf("stats %+v", st)
			if st.Learned == 0 || st.Skipped == 0 {
				t.Errorf("stats %+v: no discard was learned or skipped, so nothing raced them", st)
			}
		})
	}
}
