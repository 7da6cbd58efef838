package discard_test

import (
	"fmt"
	"slices"
	"sync/atomic"
	"testing"

	"github.com/nbdmapper/nbdmapper/backing"
	"github.com/nbdmapper/nbdmapper/discard"
	"github.com/nbdmapper/nbdmapper/internal/testing/fault"
	"github.com/nbdmapper/nbdmapper/internal/testing/nbdtest"
)

// gated is a recorded in-memory device whose first discard is held by a
// gateDev until the test releases it.
func gated(name string) (*gateDev, *backing.Recorder) {
	g := &gateDev{Device: backing.NewMem(name, 1<<20), entered: make(chan struct{}), release: make(chan struct{})}
	return g, backing.NewRecorder(g)
}

// trimAsync runs eng.Discard(exts) on its own goroutine.
func trimAsync(eng *discard.Engine, exts ...discard.Extent) chan error {
	done := make(chan error, 1)
	go func() { done <- eng.Discard(exts) }()
	return done
}

// With nothing in flight a trim is issued at once, on its own; the trims
// that arrive while it runs gather, and go out as one merged batch as soon
// as it completes.
func TestGroupCommit(t *testing.T) {
	eng := discard.New()
	gate, rec := gated("a")
	first := trimAsync(eng, ext(rec, 0, 64<<10))
	nbdtest.Recv(t, gate.entered, "the first trim to reach the device")

	var rest []chan error
	for i := range 8 {
		rest = append(rest, trimAsync(eng, ext(rec, int64(i+1)*64<<10, 64<<10)))
	}
	waitRangesIn(t, eng, 9)
	if n := len(discards(rec)); n != 1 {
		t.Fatalf("%d discard calls while the first was running, want 1: the others must wait for it", n)
	}
	close(gate.release)
	for i, c := range append([]chan error{first}, rest...) {
		if err := nbdtest.Recv(t, c, "a trim"); err != nil {
			t.Fatalf("trim %d: %v", i, err)
		}
	}
	want := []backing.Range{{Off: 0, Len: 64 << 10}, {Off: 64 << 10, Len: 8 * 64 << 10}}
	if got := discards(rec); !slices.Equal(got, want) {
		t.Errorf("discard calls %v, want the first alone and the other eight merged: %v", got, want)
	}
}

// A gathering batch waits only for the discards that were in flight when
// it began, not for ones issued after it (a long trim's pieces, a batch
// that filled up): otherwise discards that keep overlapping would hold it
// back for ever.
func TestGroupCommitWaitsOnlyForEarlier(t *testing.T) {
	eng := discard.New()
	gateA, a := gated("a")
	gateB, b := gated("b")
	first := trimAsync(eng, ext(a, 0, 64<<10))
	nbdtest.Recv(t, gateA.entered, "the first trim to reach device a")
	gathering := trimAsync(eng, ext(a, 128<<10, 64<<10))
	waitRangesIn(t, eng, 2)
	later := make(chan error, 1)
	go func() { later <- eng.DiscardNow([]discard.Extent{ext(b, 0, 64<<10)}) }()
	nbdtest.Recv(t, gateB.entered, "the later discard to reach device b")

	close(gateA.release)
	if err := nbdtest.Recv(t, first, "the first trim"); err != nil {
		t.Fatal(err)
	}
	if err := nbdtest.Recv(t, gathering, "the gathered trim, while a later discard is still in flight"); err != nil {
		t.Fatal(err)
	}
	close(gateB.release)
	if err := nbdtest.Recv(t, later, "the later discard"); err != nil {
		t.Fatal(err)
	}
	if got, want := discards(a), []backing.Range{{Off: 0, Len: 64 << 10}, {Off: 128 << 10, Len: 64 << 10}}; !slices.Equal(got, want) {
		t.Errorf("device a discards %v, want %v", got, want)
	}
}

// A batch that fills up while it waits for its turn is issued at once by
// the trim that filled it; the batch's first trim, still waiting for its
// turn, is answered with the batch.
func TestGroupCommitFullBatch(t *testing.T) {
	eng := discard.New()
	eng.MaxRanges = 4
	gate, rec := gated("a")
	first := trimAsync(eng, ext(rec, 0, 64<<10))
	nbdtest.Recv(t, gate.entered, "the first trim to reach the device")
	var batch []chan error
	for i := range 4 {
		batch = append(batch, trimAsync(eng, ext(rec, int64(i+2)*64<<10, 64<<10)))
	}
	for i, c := range batch {
		if err := nbdtest.Recv(t, c, "a trim of the full batch, while the first is held"); err != nil {
			t.Fatalf("trim %d: %v", i, err)
		}
	}
	close(gate.release)
	if err := nbdtest.Recv(t, first, "the first trim"); err != nil {
		t.Fatal(err)
	}
	want := []backing.Range{{Off: 0, Len: 64 << 10}, {Off: 128 << 10, Len: 4 * 64 << 10}}
	if got := discards(rec); !slices.Equal(got, want) {
		t.Errorf("discard calls %v, want %v", got, want)
	}
}

// A trim that finds nothing gathering and nothing in flight is issued as
// it is, without building a batch to wait in. A trim of one extent (every
// trim of a linear table) then allocates nothing but the record that
// Claim finds it by while it runs.
func TestLoneTrimBuildsNoBatch(t *testing.T) {
	m := backing.NewMem("m", 64<<20)
	x := []discard.Extent{{Dev: m, Off: 0, Len: 1 << 20}}
	for _, perRequest := range []bool{false, true} {
		eng := discard.New()
		eng.PerRequest = perRequest
		allocs := testing.AllocsPerRun(100, func() {
			if err := eng.Discard(x); err != nil {
				t.Fatal(err)
			}
		})
		if allocs > 1 {
			t.Errorf("PerRequest %v: a lone trim allocated %v times, want 1 (its in-flight record)", perRequest, allocs)
		}
	}
}

// limitedMem is an in-memory device with chosen discard limits.
type limitedMem struct {
	*backing.Mem
	lim backing.Limits
}

func (d limitedMem) Limits() backing.Limits { return d.lim }

// A lone trim of one extent skips grouping, sorting and merging, but
// reaches the device as the plan says: cut inward to the granularity, split
// at the maximum.
func TestLoneTrimIssuesItsPlan(t *testing.T) {
	lim := backing.Limits{Granularity: 4096, MaxBytes: 8192}
	for _, x := range []struct{ off, n int64 }{{0, 64 << 10}, {1000, 20000}, {100, 3000}, {4096, 40 << 10}} {
		rec := backing.NewRecorder(limitedMem{backing.NewMem("m", 1<<20), lim})
		e := ext(rec, x.off, x.n)
		eng := discard.New()
		if err := eng.Discard([]discard.Extent{e}); err != nil {
			t.Fatal(err)
		}
		want := discard.PlanDiscard([]discard.Extent{e}).Devices[0].Calls
		if got := discards(rec); !slices.Equal(got, want) {
			t.Errorf("trim %d+%d: calls %v, want the plan's %v", x.off, x.n, got, want)
		}
		st := eng.Stats().Devices[0]
		if st.RangesIn != 1 || st.BytesIn != uint64(x.n) || st.BytesOut != uint64(discard.Bytes(want)) {
			t.Errorf("trim %d+%d: stats %+v", x.off, x.n, st)
		}
	}
}

// A device whose Limits panics fails a lone trim with the panic, touches
// nothing, and leaves the engine with nothing in flight.
func TestLoneTrimLimitsPanic(t *testing.T) {
	eng := discard.New()
	panics := &fault.PanicLog{}
	eng.OnPanic = panics.OnPanic
	rec := backing.NewRecorder(backing.NewMem("m", 1<<20))
	if err := eng.Discard([]discard.Extent{ext(panicLimits{rec}, 0, 64<<10)}); !fault.Panic.Is(err) {
		t.Fatalf("trim: %v, want the panic", err)
	}
	if n := len(discards(rec)); n != 0 {
		t.Fatalf("%d discard calls after Limits panicked", n)
	}
	// Nothing is left in flight: a write's Claim returns, and the next
	// trim goes out alone.
	eng.Claim(rec, 0, 64<<10)
	if err := eng.Discard([]discard.Extent{ext(rec, 0, 64<<10)}); err != nil {
		t.Fatal(err)
	}
	if got := discards(rec); !slices.Equal(got, []backing.Range{{Off: 0, Len: 64 << 10}}) {
		t.Errorf("discard calls %v", got)
	}
}

// Group commit is per device: a trim of a healthy device is issued at once
// while another device's discard is held, instead of waiting behind it. A
// device whose discards hang must not hold every other device's trims.
func TestGroupCommitPerDevice(t *testing.T) {
	eng := discard.New()
	gateA, a := gated("a")
	b := backing.NewRecorder(backing.NewMem("b", 1<<20))
	held := trimAsync(eng, ext(a, 0, 64<<10))
	nbdtest.Recv(t, gateA.entered, "the trim of a to reach the device")

	healthy := trimAsync(eng, ext(b, 0, 64<<10))
	if err := nbdtest.Recv(t, healthy, "the trim of b, while a's discard is held"); err != nil {
		t.Fatal(err)
	}
	if got, want := discards(b), []backing.Range{{Off: 0, Len: 64 << 10}}; !slices.Equal(got, want) {
		t.Errorf("device b discards %v, want %v", got, want)
	}
	releaseHeld(t, gateA, held, "the trim of a")
}

// Trims of a healthy device still batch behind that device's own discards
// in flight, and only those: not another device's held discard, and not
// one issued on the same device after the batch began.
func TestGroupCommitPerDeviceBatches(t *testing.T) {
	eng := discard.New()
	gateA, a := gated("a")
	// b holds its first discard, and the one at 512K.
	gateLater := &offsetGate{Device: backing.NewMem("b", 1<<20), off: 512 << 10, entered: make(chan struct{}), release: make(chan struct{})}
	gateB := &gateDev{Device: gateLater, entered: make(chan struct{}), release: make(chan struct{})}
	b := backing.NewRecorder(gateB)
	heldA := trimAsync(eng, ext(a, 0, 64<<10))
	nbdtest.Recv(t, gateA.entered, "the trim of a to reach the device")

	first := trimAsync(eng, ext(b, 0, 64<<10))
	nbdtest.Recv(t, gateB.entered, "the first trim of b to reach the device, while a's is held")
	var rest []chan error
	for i := range 3 {
		rest = append(rest, trimAsync(eng, ext(b, int64(i+2)*64<<10, 64<<10)))
	}
	waitRangesIn(t, eng, 5)
	if n := len(discards(b)); n != 1 {
		t.Fatalf("%d discard calls on b while its first was running, want 1: the others must wait for it", n)
	}
	// Issued after the batch began, and held: it does not hold the batch
	// back.
	later := make(chan error, 1)
	go func() { later <- eng.DiscardNow([]discard.Extent{ext(b, 512<<10, 64<<10)}) }()
	nbdtest.Recv(t, gateLater.entered, "the later discard to reach device b")

	close(gateB.release)
	for i, c := range append([]chan error{first}, rest...) {
		if err := nbdtest.Recv(t, c, "a trim of b, while a's discard and b's later one are held"); err != nil {
			t.Fatalf("trim %d of b: %v", i, err)
		}
	}
	close(gateLater.release)
	if err := nbdtest.Recv(t, later, "the later discard of b"); err != nil {
		t.Fatal(err)
	}
	want := []backing.Range{{Off: 0, Len: 64 << 10}, {Off: 512 << 10, Len: 64 << 10}, {Off: 128 << 10, Len: 3 * 64 << 10}}
	if got := discards(b); !slices.Equal(got, want) {
		t.Errorf("device b discards %v, want the first, the later one, then the other three merged: %v", got, want)
	}
	releaseHeld(t, gateA, heldA, "the trim of a")
}

// A trim over two devices, one of them held: its part for the healthy
// device is issued at once, and the trim returns when both are done.
func TestGroupCommitSpanningDevices(t *testing.T) {
	eng := discard.New()
	gateA, a := gated("a")
	b := backing.NewRecorder(backing.NewMem("b", 1<<20))
	heldA := trimAsync(eng, ext(a, 0, 64<<10))
	nbdtest.Recv(t, gateA.entered, "the trim of a to reach the device")

	both := trimAsync(eng, ext(a, 128<<10, 64<<10), ext(b, 0, 64<<10))
	nbdtest.Until(t, "the spanning trim's call to reach device b while a's discard is held", func() bool {
		return len(discards(b)) == 1
	})
	releaseHeld(t, gateA, both, "the spanning trim")
	if err := nbdtest.Recv(t, heldA, "the trim of a, released"); err != nil {
		t.Fatal(err)
	}
	if got, want := discards(a), []backing.Range{{Off: 0, Len: 64 << 10}, {Off: 128 << 10, Len: 64 << 10}}; !slices.Equal(got, want) {
		t.Errorf("device a discards %v, want %v", got, want)
	}
	if got, want := discards(b), []backing.Range{{Off: 0, Len: 64 << 10}}; !slices.Equal(got, want) {
		t.Errorf("device b discards %v, want %v", got, want)
	}
}

// A trim over two busy devices starts a batch on each. Each is issued
// when its own device's earlier discards complete: the batch on b, joined
// by a trim of b alone, does not wait for the one on a, whose discard is
// still held.
func TestGroupCommitSpanningBusyDevices(t *testing.T) {
	for _, aFirst := range []bool{true, false} {
		t.Run(fmt.Sprintf("a first %v", aFirst), func(t *testing.T) { spanningBusyDevices(t, aFirst) })
	}
}

func spanningBusyDevices(t *testing.T, aFirst bool) {
	eng := discard.New()
	gateA, a := gated("a")
	gateB, b := gated("b")
	heldA := trimAsync(eng, ext(a, 0, 64<<10))
	nbdtest.Recv(t, gateA.entered, "the trim of a to reach the device")
	firstB := trimAsync(eng, ext(b, 0, 64<<10))
	nbdtest.Recv(t, gateB.entered, "the trim of b to reach the device")

	exts := []discard.Extent{ext(a, 128<<10, 64<<10), ext(b, 128<<10, 64<<10)}
	if !aFirst {
		slices.Reverse(exts)
	}
	both := trimAsync(eng, exts...)
	waitRangesIn(t, eng, 4)
	onlyB := trimAsync(eng, ext(b, 192<<10, 64<<10))
	waitRangesIn(t, eng, 5)

	close(gateB.release)
	for i, c := range []chan error{firstB, onlyB} {
		if err := nbdtest.Recv(t, c, "a trim of b alone, while a's discard is held"); err != nil {
			t.Fatalf("trim %d of b: %v", i, err)
		}
	}
	if got, want := discards(b), []backing.Range{{Off: 0, Len: 64 << 10}, {Off: 128 << 10, Len: 2 * 64 << 10}}; !slices.Equal(got, want) {
		t.Errorf("device b discards %v, want %v", got, want)
	}
	releaseHeld(t, gateA, both, "the spanning trim")
	if err := nbdtest.Recv(t, heldA, "the trim of a, released"); err != nil {
		t.Fatal(err)
	}
	if got, want := discards(a), []backing.Range{{Off: 0, Len: 64 << 10}, {Off: 128 << 10, Len: 64 << 10}}; !slices.Equal(got, want) {
		t.Errorf("device a discards %v, want %v", got, want)
	}
}

// offsetGate holds the discard that starts at off until release is closed.
type offsetGate struct {
	backing.Device
	off              int64
	entered, release chan struct{}
}

func (g *offsetGate) Discard(off, n int64) error {
	if off == g.off {
		close(g.entered)
		<-g.release
	}
	return g.Device.Discard(off, n)
}

// releaseHeld checks that held, the result of a trim (what) that waits
// for gate's held discard, has not come yet, then releases the discard and
// waits for the trim.
func releaseHeld(t *testing.T, gate *gateDev, held <-chan error, what string) {
	t.Helper()
	select {
	case err := <-held:
		t.Fatalf("%s returned (%v) while a discard it waits for is held", what, err)
	default:
	}
	close(gate.release)
	if err := nbdtest.Recv(t, held, what+", once the held discard is released"); err != nil {
		t.Fatal(err)
	}
}

// discardGate holds discards of a backing.Faulty until release is closed:
// every one (a failing disk whose discards hang) or only the first (a
// healthy device that is busy). Each discard that reaches it is announced
// on entered. The test's end releases what is still held.
//
// A discard is counted before it is announced: whatever a test starts once
// it has received the first announcement comes second. Announced first, the
// first discard could be preempted between the two while the test's next
// discard reached the gate, counted first and was held in its place.
type discardGate struct {
	entered chan struct{}
	release chan struct{}
	n       atomic.Int32 // discards that reached it
}

func gateDiscards(t *testing.T, f *backing.Faulty, all bool) *discardGate {
	g := &discardGate{entered: make(chan struct{}, 64), release: make(chan struct{})}
	f.Inject(backing.OpDiscard, func() error {
		hold := g.n.Add(1) == 1 || all
		g.entered <- struct{}{}
		if hold {
			<-g.release
		}
		return nil
	})
	t.Cleanup(func() {
		select {
		case <-g.release:
		default:
			close(g.release)
		}
	})
	return g
}

// What gathers is bounded per device: a healthy device's trims that fill
// its own batch issue that batch, and not the batch gathering behind
// another device's hung discard. Counted over every device, the limits
// had b's trims issue a's batch onto a, whose discard hangs: each time b
// filled the engine, one more call stuck on a, and a write to a range a
// trim of a still gathered waited for a hung call instead of going around
// the trim.
func TestGroupCommitLimitsPerDevice(t *testing.T) {
	eng := discard.New()
	eng.MaxRanges = 4
	devs := faultyFiles(t) // real files
	a, b := devs[0], devs[1]
	hungA := gateDiscards(t, a, true)
	busyB := gateDiscards(t, b, false)

	heldA := trimAsync(eng, ext(a, 0, 64<<10))
	nbdtest.Recv(t, hungA.entered, "the first trim of a to reach the device")
	gatheredA := trimAsync(eng, ext(a, 128<<10, 64<<10))
	waitRangesIn(t, eng, 2)

	firstB := trimAsync(eng, ext(b, 0, 64<<10))
	nbdtest.Recv(t, busyB.entered, "the first trim of b to reach the device")
	var restB []chan error
	for i := range eng.MaxRanges { // fill b's batch
		restB = append(restB, trimAsync(eng, ext(b, int64(i+2)*64<<10, 64<<10)))
	}
	waitRangesIn(t, eng, uint64(3+eng.MaxRanges))

	// a's trim still gathers: a write to its range takes it out and goes
	// on, and nothing more reached a.
	claimed := make(chan struct{})
	go func() { eng.Claim(a, 128<<10, 4<<10); close(claimed) }()
	select {
	case <-claimed:
	case <-hungA.entered:
		t.Fatal("b's trims issued the trim gathering on a onto a while a's discard hangs")
	}

	// b's full batch went out on its own, while b's first discard and a's
	// are held.
	for i, c := range restB {
		if err := nbdtest.Recv(t, c, "a trim of b's full batch, while a's discard hangs"); err != nil {
			t.Fatalf("trim %d of b: %v", i, err)
		}
	}
	close(busyB.release)
	if err := nbdtest.Recv(t, firstB, "b's first trim, released"); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-gatheredA:
		t.Fatalf("a's gathered trim returned (%v) while a's discard hangs", err)
	default:
	}
	close(hungA.release)
	for i, c := range []chan error{heldA, gatheredA} {
		if err := nbdtest.Recv(t, c, "a trim of a, released"); err != nil {
			t.Fatalf("trim %d of a: %v", i, err)
		}
	}
	if st := statsOf(t, eng, a.Name()); st.Calls != 2 {
		t.Errorf("a's stats %+v, want 2 calls: the held one, then the trim that gathered behind it", st)
	}
	if st := statsOf(t, eng, b.Name()); st.Calls != 2 {
		t.Errorf("b's stats %+v, want 2 calls: the held one and the full batch", st)
	}
}
