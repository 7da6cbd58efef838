package discard

import (
	"slices"
	"sync/atomic"
	"testing"

	"github.com/nbdmapper/nbdmapper/backing"
	"github.com/nbdmapper/nbdmapper/internal/testing/nbdtest"
)

// holdFirst holds its first Discard until release is closed.
type holdFirst struct {
	backing.Device
	entered, release chan struct{}
	held             atomic.Bool
}

func (h *holdFirst) Discard(off, n int64) error {
	if h.held.CompareAndSwap(false, true) {
		close(h.entered)
		<-h.release
	}
	return h.Device.Discard(off, n)
}

// claims is how many claimed ranges d's gathering batch holds, and their
// capacity; ok is false if nothing of d gathers.
func claims(e *Engine, d backing.Device) (n, c int, ok bool) {
	e.mu.Lock()
	defer e.mu.Unlock()
	st := e.devs[d]
	if st == nil || st.gathering == nil {
		return 0, 0, false
	}
	return len(st.gathering.p.claimed), cap(st.gathering.p.claimed), true
}

// gatheringBehindHeld starts a trim of d's first 64K, held by the device,
// and a trim of [1M, 1M+span) that gathers behind it, and returns the
// second trim's result and the release of the first.
func gatheringBehindHeld(t *testing.T, e *Engine, name string, span int64) (rec *backing.Recorder, release func(), first, second chan error) {
	t.Helper()
	h := &holdFirst{Device: backing.NewMem(name, 1<<20+span), entered: make(chan struct{}), release: make(chan struct{})}
	rec = backing.NewRecorder(h)
	first, second = make(chan error, 1), make(chan error, 1)
	go func() { first <- e.Discard([]Extent{{Dev: rec, Off: 0, Len: 64 << 10}}) }()
	nbdtest.Recv(t, h.entered, "the first trim to reach the device")
	go func() { second <- e.Discard([]Extent{{Dev: rec, Off: 1 << 20, Len: span}}) }()
	nbdtest.Until(t, "the second trim to gather", func() bool { _, _, ok := claims(e, rec); return ok })
	return rec, func() { close(h.release) }, first, second
}

// Writes into the span of a gathering trim are claimed, and the claims are
// merged as they come: however many writes arrive, over few distinct
// ranges, the batch holds a bounded number of claimed ranges, and the
// written bytes are still never discarded.
func TestClaimsStayBounded(t *testing.T) {
	e := New()
	const span = 256 << 20 // under MaxBytes: it gathers
	rec, release, first, second := gatheringBehindHeld(t, e, "m", span)

	const writes = 1 << 18
	maxN, maxC := 0, 0
	for i := range int64(writes) {
		// Nothing of the written ranges is in flight: Claim returns at once.
		e.Claim(rec, 1<<20+(i%4)*8192, 4096)
		if i%1024 == 0 {
			n, c, ok := claims(e, rec)
			if !ok {
				t.Fatalf("after %d writes nothing gathers: the batch was issued while the device was busy", i)
			}
			maxN, maxC = max(maxN, n), max(maxC, c)
		}
	}
	n, c, _ := claims(e, rec)
	maxN, maxC = max(maxN, n), max(maxC, c)
	t.Logf("%d writes over 4 ranges: at most %d claimed ranges held (capacity %d)", writes, maxN, maxC)
	if maxN > minMergeAt || maxC > 2*minMergeAt {
		t.Errorf("%d writes over 4 distinct ranges: up to %d claimed ranges held (capacity %d), want at most %d (capacity %d)",
			writes, maxN, maxC, minMergeAt, 2*minMergeAt)
	}

	release()
	for _, c := range []chan error{first, second} {
		if err := nbdtest.Recv(t, c, "a trim"); err != nil {
			t.Fatal(err)
		}
	}
	want := []backing.Range{{Off: 0, Len: 64 << 10}}
	for i := range int64(3) { // the gaps between the written ranges
		want = append(want, backing.Range{Off: 1<<20 + i*8192 + 4096, Len: 4096})
	}
	want = append(want, backing.Range{Off: 1<<20 + 3*8192 + 4096, Len: span - 3*8192 - 4096})
	var got []backing.Range
	for _, c := range rec.Calls(backing.OpDiscard) {
		got = append(got, backing.Range{Off: c.Off, Len: c.Len})
	}
	if !slices.Equal(got, want) {
		t.Errorf("discard calls %v, want the first, then the second around the four written ranges: %v", got, want)
	}
}

// Writes of more distinct ranges than MaxRanges into a gathering trim's
// span seal its batch early, as a full batch is: the claimed ranges stay
// bounded (2*MaxRanges, or minMergeAt if more), and the trim is issued
// while the discard it waited for is still held, around every write.
func TestClaimsSealEarly(t *testing.T) {
	e := New()
	e.MaxRanges = 16
	const span = 16 << 20
	rec, release, first, second := gatheringBehindHeld(t, e, "m", span)

	bound := max(2*e.MaxRanges, minMergeAt)
	var written []backing.Range
	sealed := -1
	for i := range int64(4 * bound) {
		r := backing.Range{Off: 1<<20 + i*8192, Len: 4096} // none adjacent: none merge
		e.Claim(rec, r.Off, r.Len)
		written = append(written, r)
		n, _, ok := claims(e, rec)
		if !ok {
			sealed = int(i) + 1
			break
		}
		if n > bound {
			t.Fatalf("%d distinct writes: %d claimed ranges held, want at most %d", i+1, n, bound)
		}
	}
	if sealed < 0 {
		t.Fatalf("%d distinct claims and the batch still gathers (MaxRanges %d)", 4*bound, e.MaxRanges)
	}
	t.Logf("sealed early after %d distinct claims (MaxRanges %d)", sealed, e.MaxRanges)
	if err := nbdtest.Recv(t, second, "the trim sealed early, while the one it waited for is held"); err != nil {
		t.Fatal(err)
	}
	calls := rec.Calls(backing.OpDiscard)[1:]
	if len(calls) == 0 {
		t.Fatal("the trim sealed early made no discard calls")
	}
	for _, c := range calls {
		for _, w := range written {
			if c.Off < w.End() && w.Off < c.Off+c.Len {
				t.Errorf("discard %d+%d covers written %d+%d", c.Off, c.Len, w.Off, w.Len)
			}
		}
	}
	release()
	if err := nbdtest.Recv(t, first, "the first trim"); err != nil {
		t.Fatal(err)
	}
}
