package snapshot

import (
	"bytes"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/nbdmapper/nbdmapper/backing"
	"github.com/nbdmapper/nbdmapper/internal/testing/nbdtest"
)

// setRate sets the merge rate for one test.
func setRate(t *testing.T, rate int64) {
	old := *config.Load()
	c := old
	c.MergeRate = rate
	Configure(c)
	t.Cleanup(func() { Configure(old) })
}

// openMerge opens a snapshot-merge device on origin and cow, not yet
// activated (no merge running).
func openMerge(t *testing.T, origin, cow backing.Device, chunk uint32) *Snapshot {
	t.Helper()
	return open(t, origin, cow, Options{Type: Persistent, ChunkSectors: chunk, Merge: true})
}

// waitMerged waits for s's merge to end and fails unless it completed.
func waitMerged(t *testing.T, s *Snapshot) {
	t.Helper()
	nbdtest.Until(t, "the merge to end", func() bool { return !s.Merging() })
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.mergeDone || len(s.st.exc) != 0 {
		t.Fatalf("merge ended without completing: valid %v, failed %v, %d exceptions left", s.st.valid, s.mergeFailed, len(s.st.exc))
	}
}

// mergedStatus is a finished merge's status: allocated equals metadata.
func mergedStatus(chunk uint32, cowSize int64) string {
	return fmt.Sprintf("%d/%d %d", 2*chunk, cowSize/512, 2*chunk)
}

// TestMergeModel writes to an origin and its snapshot at random, then
// merges the snapshot back while a client keeps reading and writing the
// merging device, and restarts the merge from the COW at random points. A
// second snapshot of the origin, loaded before the merge, must keep its
// contents while the merge rewrites the origin. In the end the origin
// holds the snapshot's bytes.
func TestMergeModel(t *testing.T) {
	for i, chunk := range []uint32{1, 8} {
		t.Run(fmt.Sprintf("chunk %d", chunk), func(t *testing.T) {
			setRate(t, 2<<20)
			rng := rand.New(rand.NewPCG(uint64(i), 16))
			const originSize = 256 << 10
			originDev := backing.NewMem("origin", originSize)
			orig := make([]byte, originSize)
			fill(rng, orig)
			mustWrite(t, originDev, orig, 0)
			cow := backing.NewMem("cow", 3*originSize)
			s := open(t, originDev, cow, Options{Type: Persistent, ChunkSectors: chunk})
			o, err := NewOrigin("origin", originDev, 0)
			if err != nil {
				t.Fatal(err)
			}
			snap := bytes.Clone(orig)
			randRange := func() (int64, int64) {
				off := rng.Int64N(originSize/512) * 512
				return off, 512 * (1 + rng.Int64N(min((originSize-off)/512, 16)))
			}
			for op := 0; op < 300; op++ {
				off, n := randRange()
				p := make([]byte, n)
				fill(rng, p)
				if rng.IntN(2) == 0 {
					mustWrite(t, o, p, off)
					copy(orig[off:], p)
				} else {
					mustWrite(t, s, p, off)
					copy(snap[off:], p)
				}
			}
			s.Close()
			other := open(t, originDev, backing.NewMem("cow2", 3*originSize), Options{Type: Persistent, ChunkSectors: 4})
			otherView := bytes.Clone(orig)

			m := openMerge(t, originDev, cow, chunk)
			m.Activate()
			restarts := 0
			for op := 0; op < 400; op++ {
				off, n := randRange()
				switch k := rng.IntN(10); {
				case k < 4:
					p := make([]byte, n)
					fill(rng, p)
					mustWrite(t, m, p, off)
					copy(snap[off:], p)
				case k < 8:
					checkRead(t, op, m, snap, off, n)
				case k < 9:
					checkRead(t, op, other, otherView, off, n)
				default:
					m.Close()
					m = openMerge(t, originDev, cow, chunk)
					m.Activate()
					restarts++
				}
			}
			waitMerged(t, m)
			checkRead(t, -1, originDev, snap, 0, originSize)
			checkRead(t, -1, m, snap, 0, originSize)
			checkRead(t, -1, other, otherView, 0, originSize)
			if got, want := m.Status(), mergedStatus(chunk, 3*originSize); got != want {
				t.Fatalf("status after the merge %q, want %q", got, want)
			}
			// Served again, the merged store has nothing left to merge.
			m.Close()
			m = openMerge(t, originDev, cow, chunk)
			if got, want := m.Status(), mergedStatus(chunk, 3*originSize); got != want {
				t.Fatalf("status of the merged store reopened %q, want %q", got, want)
			}
			t.Logf("%d restarts during the merge", restarts)
		})
	}
}

// mergeFixture builds the store of TestGeneratedKernelFormat through the
// snapshot: chunk 1 (32 entries an area), area 0 full with origin chunks
// 100..131 in COW chunks 2..33, and area 1 with 7 -> 35, 3 -> 36 and
// 40, 41, 42 -> 37, 38, 39. Each origin chunk's sectors hold its number,
// the snapshot's hold 200 + it.
func mergeFixture(t *testing.T) (origin, cow *backing.Mem, want []byte) {
	t.Helper()
	origin = backing.NewMem("origin", 256*512)
	for c := 0; c < 256; c++ {
		mustWrite(t, origin, bytes.Repeat([]byte{byte(c)}, 512), int64(c)*512)
	}
	cow = backing.NewMem("cow", 64*512)
	s := open(t, origin, cow, Options{Type: Persistent, ChunkSectors: 1})
	want = patternOf(t, origin, 256*512)
	for _, c := range append(seq(100, 132), 7, 3, 40, 41, 42) {
		p := bytes.Repeat([]byte{byte(200 + c)}, 512)
		mustWrite(t, s, p, int64(c)*512)
		copy(want[c*512:], p)
	}
	if got := s.Status(); got != "40/64 3" {
		t.Fatalf("fixture status %q", got)
	}
	s.Close()
	return origin, cow, want
}

// TestMergeSteps follows the kernel's merge order and status, step by
// step: runs of consecutive entries from the end of the last area
// backwards, dm's sectors_allocated = (first free chunk after the last
// entry of the current area) and metadata = (current area + 2) chunks.
func TestMergeSteps(t *testing.T) {
	origin, cow, want := mergeFixture(t)
	m := openMerge(t, origin, cow, 0)
	m.mu.Lock()
	m.active = true
	m.mu.Unlock()
	steps := []struct {
		merged []int // origin chunks the step copies back
		status string
	}{
		{[]int{40, 41, 42}, "37/64 3"},
		{[]int{3}, "36/64 3"},
		{[]int{7}, "35/64 3"},
		{seq(100, 132), "2/64 2"}, // back to area 0: one run of 32
	}
	for i, st := range steps {
		n, more, err := m.mergeStep()
		if err != nil || !more || n != int64(len(st.merged))*512 {
			t.Fatalf("step %d: copied %d, more %v, %v; want %d bytes", i, n, more, err, len(st.merged)*512)
		}
		for _, c := range st.merged {
			checkRead(t, i, origin, want, int64(c)*512, 512)
		}
		if got := m.Status(); got != st.status {
			t.Fatalf("step %d: status %q, want %q", i, got, st.status)
		}
	}
	if _, more, err := m.mergeStep(); more || err != nil {
		t.Fatalf("after the last run: more %v, %v", more, err)
	}
	checkRead(t, -1, origin, want, 0, 256*512)
	// The metadata areas are empty on disk, the header still valid.
	raw := patternOf(t, cow, 64*512)
	if !bytes.Equal(raw[512:1024], make([]byte, 512)) || !bytes.Equal(raw[34*512:35*512], make([]byte, 512)) {
		t.Fatal("metadata areas not cleared after the merge")
	}
	if h := decodeHeader(raw); h.Magic != diskMagic || h.Valid != 1 {
		t.Fatalf("header after the merge: %+v", h)
	}
}

// TestMergeCrashPoints cuts the power at each sync of a merge (both
// devices lose what was not synced), then serves the store again: the
// view must be the snapshot's at every cut, and the resumed merge must
// leave the origin holding it.
func TestMergeCrashPoints(t *testing.T) {
	setRate(t, 0)
	for cut := 0; ; cut++ {
		originMem, cowMem, want := mergeFixture(t)
		origin, cow := backing.NewFaulty(originMem), backing.NewFaulty(cowMem)
		var syncs atomic.Int64
		power := errors.New("power cut")
		hook := func() {
			if syncs.Add(1) == int64(cut+1) {
				origin.FailSync(power)
				cow.FailSync(power)
			}
		}
		origin.BeforeSync(hook)
		cow.BeforeSync(hook)
		m := openMerge(t, origin, cow, 0)
		m.Activate()
		nbdtest.Until(t, "the merge to end", func() bool { return !m.Merging() })
		finished := m.Status() == mergedStatus(1, 64*512)
		m.Close()
		origin.Crash()
		cow.Crash()
		if finished {
			if cut < 12 {
				t.Fatalf("the merge finished after %d syncs; want 3 per step", cut)
			}
			t.Logf("%d crash points", cut)
			return
		}
		s := open(t, originMem, cowMem, Options{Type: Persistent})
		checkRead(t, cut, s, want, 0, 256*512)
		s.Close()
		m2 := openMerge(t, originMem, cowMem, 0)
		m2.Activate()
		waitMerged(t, m2)
		checkRead(t, cut, originMem, want, 0, 256*512)
		m2.Close()
	}
}

// TestMergeHoldsWrites: a write to a chunk of the run being merged waits
// for the run and then goes to the origin; one to a chunk still on the COW
// goes there in place and is merged later; one to a chunk without an
// exception goes to the origin.
func TestMergeHoldsWrites(t *testing.T) {
	setRate(t, 0)
	originMem, cow, want := mergeFixture(t)
	origin := backing.NewFaulty(originMem)
	gate := make(chan struct{})
	var once sync.Once
	origin.BeforeSync(func() {
		once.Do(func() { <-gate }) // the first step (40..42) holds in its origin sync
	})
	m := openMerge(t, origin, cow, 0)
	m.Activate()
	nbdtest.Until(t, "the first run to be merging", func() bool {
		m.mu.Lock()
		defer m.mu.Unlock()
		return m.mergeHi == 43
	})
	done := make(chan error, 1)
	go func() { _, err := m.WriteAt(bytes.Repeat([]byte{'M'}, 512), 41*512); done <- err }()
	nbdtest.Until(t, "the write to wait for the run", func() bool {
		m.mu.Lock()
		defer m.mu.Unlock()
		return m.mergeWaiters == 1
	})
	mustWrite(t, m, bytes.Repeat([]byte{'C'}, 512), 110*512) // on the COW, merged later
	mustWrite(t, m, bytes.Repeat([]byte{'O'}, 512), 200*512) // no exception: the origin
	close(gate)
	if err := nbdtest.Recv(t, done, "the held write"); err != nil {
		t.Fatal(err)
	}
	copy(want[41*512:], bytes.Repeat([]byte{'M'}, 512))
	copy(want[110*512:], bytes.Repeat([]byte{'C'}, 512))
	copy(want[200*512:], bytes.Repeat([]byte{'O'}, 512))
	waitMerged(t, m)
	checkRead(t, -1, origin, want, 0, 256*512) // the Faulty: the last write may still be volatile
}

// TestMergeFailed: a device error or a panic during the merge stops it
// with dm's status "Merge failed"; the device still serves the snapshot.
func TestMergeFailed(t *testing.T) {
	for _, tc := range []struct {
		name   string
		inject func() error
	}{
		{"write error", func() error { return errors.New("EIO") }},
		{"panic", func() error { panic("disk firmware bug") }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			setRate(t, 0)
			var panics atomic.Int64
			c := *config.Load()
			c.OnPanic = func(any, []byte) { panics.Add(1) }
			Configure(c)
			originMem, cow, want := mergeFixture(t)
			origin := backing.NewFaulty(originMem)
			origin.Inject(backing.OpWrite, tc.inject)
			m := openMerge(t, origin, cow, 0)
			m.Activate()
			nbdtest.Until(t, "the merge to stop", func() bool { return !m.Merging() })
			if got := m.Status(); got != "Merge failed" {
				t.Fatalf("status %q, want Merge failed", got)
			}
			if tc.name == "panic" && panics.Load() == 0 {
				t.Fatal("the panic was not reported")
			}
			checkRead(t, 0, m, want, 0, 256*512)
			if st := ReadStats(); st.MergeFail == 0 {
				t.Fatal("no merge failure counted")
			}
		})
	}
}

// TestHandover: a snapshot-merge loaded on the COW of a snapshot in use
// takes its store when activated, as lvconvert --merge relies on; the old
// snapshot is invalid from then on. Closing the old one first cancels the
// handover; a plain snapshot can take over too.
func TestHandover(t *testing.T) {
	setRate(t, 0)
	t.Run("merge", func(t *testing.T) {
		origin, cow := newPair(t, 64<<10, 256<<10)
		a := open(t, origin, cow, Options{Type: Persistent, ChunkSectors: 8})
		mustWrite(t, a, bytes.Repeat([]byte{'A'}, 5000), 3000)
		want := patternOf(t, a, 64<<10)
		b := openMerge(t, origin, cow, 16) // the table's chunk; the store's is 8
		if _, err := b.ReadAt(make([]byte, 512), 0); !errors.Is(err, ErrInvalid) {
			t.Fatalf("read before the handover: %v", err)
		}
		checkRead(t, 0, a, want, 0, 64<<10) // a still works
		b.Activate()
		if got := a.Status(); got != "Invalid" {
			t.Fatalf("source status after the handover %q", got)
		}
		if _, err := a.ReadAt(make([]byte, 512), 0); !errors.Is(err, ErrInvalid) {
			t.Fatalf("read on the source after the handover: %v", err)
		}
		waitMerged(t, b)
		if b.ChunkSectors() != 8 {
			t.Fatalf("chunk %d after the handover, want the store's 8", b.ChunkSectors())
		}
		checkRead(t, 0, origin, want, 0, 64<<10)
		a.Close() // must not free the COW b now owns
		if _, err := Open("c", origin, cow, Options{Type: Persistent}); err != nil {
			t.Fatalf("a handover destination of b: %v", err)
		}
	})
	t.Run("cancelled", func(t *testing.T) {
		origin, cow := newPair(t, 64<<10, 256<<10)
		a := open(t, origin, cow, Options{Type: Persistent, ChunkSectors: 8})
		b := openMerge(t, origin, cow, 8)
		a.Close()
		b.Activate()
		if got := b.Status(); got != "Invalid" {
			t.Fatalf("status %q after the source went first", got)
		}
	})
	t.Run("snapshot", func(t *testing.T) {
		origin, cow := newPair(t, 64<<10, 256<<10)
		a := open(t, origin, cow, Options{Type: Persistent, ChunkSectors: 8})
		mustWrite(t, a, []byte("before"), 100)
		b := open(t, origin, cow, Options{Type: Persistent, ChunkSectors: 8})
		b.Activate()
		mustWrite(t, b, []byte("after"), 9000)
		want := patternOf(t, origin, 64<<10)
		copy(want[100:], "before")
		copy(want[9000:], "after")
		checkRead(t, 0, b, want, 0, 64<<10)
		if st := ReadStats(); st.Handovers == 0 {
			t.Fatal("no handover counted")
		}
	})
}

// TestHoles: block status on a snapshot shows holes where the origin has
// one and the COW no exception.
func TestHoles(t *testing.T) {
	origin := backing.NewMem("origin", 256<<10) // all holes
	mustWrite(t, origin, []byte("data"), 100<<10)
	cow := backing.NewMem("cow", 1<<20)
	s := open(t, origin, cow, Options{Type: Persistent, ChunkSectors: 16}) // 8 KiB chunks
	mustWrite(t, s, []byte("x"), 20<<10)                                   // chunk 2
	mustWrite(t, s, []byte("y"), 255<<10)                                  // chunk 31
	got, err := s.Holes(0, 256<<10)
	if err != nil {
		t.Fatal(err)
	}
	want := []backing.Range{
		{Off: 0, Len: 16 << 10},          // chunks 0, 1
		{Off: 24 << 10, Len: 76 << 10},   // chunk 3 up to the origin's data page
		{Off: 104 << 10, Len: 144 << 10}, // after it, up to chunk 31
	}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("Holes = %v, want %v", got, want)
	}
	// With chunks smaller than 4 KiB a hole piece is whole 4 KiB blocks.
	origin2 := backing.NewMem("origin2", 64<<10)
	s2 := open(t, origin2, backing.NewMem("cow2", 1<<20), Options{Type: Persistent, ChunkSectors: 1})
	mustWrite(t, s2, []byte("z"), 5000) // chunk 9, in block 1
	got, _ = s2.Holes(0, 64<<10)
	if want := []backing.Range{{Off: 0, Len: 4096}, {Off: 8192, Len: 56 << 10}}; fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("Holes with 512-byte chunks = %v, want %v", got, want)
	}
}

// TestMergeWaitsForWrites: a write in flight to a chunk on the COW when
// the merge reaches that chunk's run is waited for (dm's
// __check_for_conflicting_io), so the run copies what it wrote.
func TestMergeWaitsForWrites(t *testing.T) {
	setRate(t, 0)
	originMem, cowMem, want := mergeFixture(t)
	origin, cow := backing.NewFaulty(originMem), backing.NewFaulty(cowMem)
	m := openMerge(t, origin, cow, 0)
	entered, gate := make(chan struct{}), make(chan struct{})
	var once sync.Once
	cow.Inject(backing.OpWrite, func() error {
		once.Do(func() { close(entered); <-gate })
		return nil
	})
	done := make(chan error, 1)
	go func() { _, err := m.WriteAt(bytes.Repeat([]byte{'W'}, 512), 41*512); done <- err }()
	nbdtest.Recv(t, entered, "the write to reach the COW")
	m.Activate()
	nbdtest.Until(t, "the merge to wait for the write, or to go on without it", func() bool {
		m.writes.mu.Lock()
		waiting := m.writes.waiters > 0
		m.writes.mu.Unlock()
		return waiting || origin.Pending() > 0 || origin.Syncs() > 0
	})
	close(gate)
	if err := nbdtest.Recv(t, done, "the write"); err != nil {
		t.Fatal(err)
	}
	copy(want[41*512:], bytes.Repeat([]byte{'W'}, 512))
	waitMerged(t, m)
	checkRead(t, -1, origin, want, 0, 256*512)
}
