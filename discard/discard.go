package discard

import (
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nbdmapper/nbdmapper/backing"
)

// Defaults New gives an Engine.
const (
	DefaultMaxRanges = 4096
	DefaultMaxBytes  = 1 << 30
)

// Engine plans and issues discards and zeroing. One Engine is shared by
// every connection and export of a server, so that trims from all of them
// coalesce per device.
//
// The exported fields may be changed after New, but only before first use.
type Engine struct {
	// Window, when positive, is how long the first trim of a batch waits
	// for others to join it. 0, the default, batches by group commit, per
	// device: a trim's part for a device with no discard in flight is
	// issued at once, and the parts that arrive while the device has
	// discards in flight gather into the device's batch, issued as soon as
	// those have completed (see the package comment).
	Window time.Duration
	// PerRequest issues each trim's own plan at once: sorted and merged
	// within the request, never batched with others. Benchmark baseline.
	PerRequest bool
	// MaxRanges and MaxBytes bound what the engine holds gathering. With
	// group commit they bound each device's batch: the trim that brings a
	// device's batch to either issues that batch without waiting for its
	// turn, and no other device's, so a device's trims never push out the
	// batch gathering behind another device's slow or hung discard. What
	// gathers is then at most about MaxRanges ranges per device, and the
	// devices are the tables', not the clients'. With a Window, whose one
	// timer ends every device's batch, they count over all devices, and
	// the trim that reaches either issues every gathering batch. A batch
	// that holds more than MaxRanges ranges written since its trims
	// arrived, once merged, is issued early too (see Claim).
	MaxRanges int
	MaxBytes  int64
	// Baseline issues every mapped range at once, in arrival order, without
	// sorting, merging, aligning or batching. Benchmark baseline only.
	Baseline bool
	// Observe, if set, is called after each device call with the device
	// name, "discard" or "zero", and how long the call took.
	Observe func(device, op string, d time.Duration)
	// OnPanic, if set, is called with the value and stack of every panic
	// the engine recovers from a device call. Those calls run on the
	// caller's goroutine and on the goroutines it starts, one per further
	// device (and Limits on whichever goroutine seals a batch, the batch
	// timer's or a Claim's among them); a panic on any of them fails only
	// the requests waiting for that device call, with an error wrapping
	// backing.ErrPanic, and the engine goes on.
	OnPanic func(v any, stack []byte)

	mu      sync.Mutex
	devs    map[backing.Device]*device
	order   []*device
	window  *time.Timer // Window > 0: seals every gathering batch; nil if none gathers
	batches int         // gathering batches (at most one per device)
	ranges  int         // ranges in them: MaxRanges bounds this with a Window
	bytes   int64       // bytes in them: MaxBytes bounds this with a Window
	flying  int         // in-flight device plans
	pending atomic.Bool // batches > 0 || flying > 0: Claim's fast path
}

// minMergeAt is how many claimed ranges a gathering batch holds before
// Claim first merges them (see batch.claim).
const minMergeAt = 64

// device is the engine's state for one backing device.
type device struct {
	dev       backing.Device
	noDiscard atomic.Bool    // Discard returned ErrNotSupported once
	noZero    [2]atomic.Bool // Zero returned ErrNotSupported, by mayPunch
	stats     counters

	// Guarded by Engine.mu.
	gathering *batch      // this device's trims waiting to be issued; nil if none
	inflight  []*inflight // issued discard plans not yet complete
	plans     uint64      // discard plans ever issued on this device; numbers them
}

// inflight is one device's issued discard calls. Claim waits for those it
// overlaps, so a write never lands before a discard that was already issued
// and is then undone by it.
type inflight struct {
	calls []backing.Range // ascending
	seq   uint64          // the plan's number on its device (device.plans)
	// done is made by the first Claim that waits for these calls and
	// closed when they complete, both under Engine.mu: most discards are
	// never waited for, and then cost no channel.
	done chan struct{}
	one  [1]backing.Range // calls' array for a single call (Engine.one)
}

// register records fl as in flight on st and numbers it. e.mu must be held.
func (e *Engine) register(st *device, fl *inflight) {
	fl.seq = st.plans
	st.plans++
	st.inflight = append(st.inflight, fl)
	e.flying++
	e.pending.Store(true)
}

// land removes fl from st's calls in flight, waking the Claims that wait
// for it, and, if it was the last plan st's gathering batch waited for,
// that batch. e.mu must be held.
func (e *Engine) land(st *device, fl *inflight) {
	st.inflight = removeInflight(st.inflight, fl)
	e.flying--
	if b := st.gathering; b != nil && e.Window <= 0 && fl.seq < b.after {
		if b.waiting--; b.waiting == 0 {
			b.open()
		}
	}
	if fl.done != nil {
		close(fl.done)
	}
	e.setPending()
}

// setPending updates Claim's fast-path flag. e.mu must be held.
func (e *Engine) setPending() {
	e.pending.Store(e.batches > 0 || e.flying > 0)
}

// batch is one device's part of the trims issued together: gathered while
// the device had discards in flight (or while a window was open), or, for a
// trim that finds the device idle, that trim's ranges alone, issued at once.
// The trim that made it (its lead) issues it, on its own goroutine or on
// one it starts, when its turn comes; every trim with ranges in it waits
// for done.
type batch struct {
	st     *device
	p      pending // the ranges gathered and claimed; emptied when sealed
	lo, hi int64   // bounds of p.in
	ranges int
	bytes  int64
	// mergeAt is the length at which Claim next merges p.claimed.
	mergeAt int
	// gathering: st.gathering is this batch, and it is counted in
	// Engine.batches, ranges and bytes.
	gathering bool

	// Group commit (Window 0): the batch's turn comes once the plans that
	// were in flight on st when it began (those numbered below after) have
	// completed; turn is closed then, or when the batch is sealed early.
	after   uint64
	waiting int // of those plans, how many are still in flight
	turn    chan struct{}
	turned  bool

	// Set by seal, under Engine.mu.
	sealed bool
	fl     inflight // the calls; in flight while they run, if any
	lim    backing.Limits

	err  error         // the device's error; set before done is closed
	done chan struct{} // closed when the batch's calls have completed
}

// open closes b.turn once. e.mu must be held.
func (b *batch) open() {
	if !b.turned {
		b.turned = true
		close(b.turn)
	}
}

// New returns an engine with default settings.
func New() *Engine {
	return &Engine{MaxRanges: DefaultMaxRanges, MaxBytes: DefaultMaxBytes}
}

func (e *Engine) device(d backing.Device) *device {
	if st := e.devs[d]; st != nil {
		return st
	}
	if e.devs == nil {
		e.devs = make(map[backing.Device]*device)
	}
	st := &device{dev: d}
	e.devs[d] = st
	e.order = append(e.order, st)
	return st
}

// Forget drops what the engine keeps of d (its counters, whether it can
// discard), once d is closed: a backing.Pool calls it for each device it
// closes. Nothing of d can be gathering or in flight then, since every trim
// waits for its calls; if something were, d is kept, so that the trims
// waiting for it are still sealed and woken.
func (e *Engine) Forget(d backing.Device) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if st := e.devs[d]; st != nil && st.gathering == nil && len(st.inflight) == 0 {
		delete(e.devs, d)
		e.order = slices.DeleteFunc(e.order, func(o *device) bool { return o == st })
	}
}

// Discard deallocates the extents (advisory: a device that cannot discard is
// skipped). It returns when every device call covering them has completed,
// with the errors of the devices they are on.
func (e *Engine) Discard(exts []Extent) error {
	if e.Baseline {
		return e.discardEach(exts)
	}
	if !slices.ContainsFunc(exts, func(x Extent) bool { return x.Len > 0 }) {
		return nil
	}
	if e.PerRequest {
		return e.DiscardNow(exts)
	}
	e.mu.Lock()
	return e.issue(exts, false)
}

// DiscardNow is Discard without waiting for other trims to batch with:
// the extents are sorted, merged and issued at once. It is for the pieces
// of a long trim that has more to come (nbdtarget walks a long range in
// pieces and waits for each), where a batching window would only add its
// length to every piece.
func (e *Engine) DiscardNow(exts []Extent) error {
	if e.Baseline {
		return e.discardEach(exts)
	}
	e.mu.Lock()
	return e.issue(exts, true)
}

// idle reports whether a trim's part for st is issued at once: with group
// commit, when nothing of st is gathering or in flight. e.mu must be held.
func (e *Engine) idle(st *device) bool {
	return e.Window <= 0 && st.gathering == nil && len(st.inflight) == 0
}

// issue is Discard (now false) and DiscardNow (now true) once the lock is
// held. Per device, the trim's ranges are issued at once (now, or the
// device is idle) or join the device's gathering batch, starting one if
// there is none; the trim then issues the batches it started and waits for
// every batch it joined. Devices never wait for each other: each device's
// batch has its own turn and its own completion, and a trim over several
// devices issues its batches concurrently. e.mu must be held; issue unlocks
// it.
func (e *Engine) issue(exts []Extent, now bool) error {
	if len(exts) == 1 && exts[0].Len > 0 {
		if st := e.device(exts[0].Dev); now || e.idle(st) {
			// Nothing gathering, nothing in flight: a batch of this
			// trim alone would be issued at once. Issue it without one;
			// the trims that arrive meanwhile gather behind it.
			return e.one(st, exts[0])
		}
	}
	parts := group(exts)
	joined := make([]*batch, len(parts)) // in device order, for the errors
	var lead []*batch                    // the batches this trim issues
	for i, p := range parts {
		st := e.device(p.dev)
		b := st.gathering
		switch {
		case now || e.idle(st):
			b = &batch{st: st, p: *p, turn: closed, turned: true, done: make(chan struct{})}
			e.seal(b)
			lead = append(lead, b)
		case b == nil:
			b = e.gather(st)
			lead = append(lead, b)
			fallthrough
		default:
			b.add(e, p.in)
		}
		// Counted once a Claim can find them (pending is set): a test
		// that waits for a trim to be received may race a write with it.
		st.stats.received(p.in)
		joined[i] = b
	}
	if e.Window > 0 {
		if e.ranges >= e.MaxRanges || e.bytes >= e.MaxBytes {
			e.sealAll() // full: what gathers is issued without waiting any longer
		}
	} else {
		for _, b := range joined {
			if b.gathering && (b.ranges >= e.MaxRanges || b.bytes >= e.MaxBytes) {
				e.seal(b) // full: issued without waiting for its turn
			}
		}
	}
	e.mu.Unlock()

	for i, b := range lead {
		if i == len(lead)-1 {
			e.run(b) // the last on this goroutine
		} else {
			go e.run(b)
		}
	}
	for _, b := range joined {
		<-b.done
	}
	return joinErrs(joined)
}

// closed is the turn of a batch issued at once.
var closed = func() chan struct{} { c := make(chan struct{}); close(c); return c }()

// gather starts st's gathering batch. With group commit it waits for the
// plans now in flight on st (there is at least one: an idle device's trims
// are issued at once); with a window, for the window's timer, started by
// the first batch to gather. e.mu must be held.
func (e *Engine) gather(st *device) *batch {
	b := &batch{
		st:        st,
		p:         pending{dev: st.dev},
		gathering: true,
		mergeAt:   minMergeAt,
		after:     st.plans,
		waiting:   len(st.inflight),
		turn:      make(chan struct{}),
		done:      make(chan struct{}),
	}
	st.gathering = b
	e.batches++
	if e.Window > 0 && e.window == nil {
		var t *time.Timer
		t = time.AfterFunc(e.Window, func() {
			e.mu.Lock()
			if e.window == t {
				e.sealAll()
			}
			e.mu.Unlock()
		})
		e.window = t
	}
	e.setPending()
	return b
}

// add puts rs into gathering batch b. e.mu must be held.
func (b *batch) add(e *Engine, rs []backing.Range) {
	for _, r := range rs {
		if len(b.p.in) == 0 {
			b.lo, b.hi = r.Off, r.End()
		}
		b.lo, b.hi = min(b.lo, r.Off), max(b.hi, r.End())
		b.p.in = append(b.p.in, r)
		b.ranges++
		b.bytes += r.Len
		e.ranges++
		e.bytes += r.Len
	}
}

// claim records that r, which overlaps b's ranges, was written: it will not
// be discarded. Claims are merged whenever they have doubled since the last
// merge (and reached minMergeAt), so a batch holds at most
// max(2*MaxRanges, minMergeAt) of them however many writes arrive; a batch
// whose claims still number more than MaxRanges once merged is sealed
// early, as a full one is (a trim is advisory: issuing it now only means
// it batches less). e.mu must be held.
func (b *batch) claim(e *Engine, r backing.Range) {
	b.p.claimed = append(b.p.claimed, r)
	if len(b.p.claimed) < b.mergeAt {
		return
	}
	b.p.claimed = mergeInPlace(b.p.claimed)
	b.mergeAt = max(2*len(b.p.claimed), minMergeAt)
	if len(b.p.claimed) > e.MaxRanges {
		e.seal(b)
	}
}

// sealAll seals every gathering batch. e.mu must be held.
func (e *Engine) sealAll() {
	for _, st := range e.order {
		if b := st.gathering; b != nil {
			e.seal(b)
		}
	}
}

// seal closes batch b to new trims and claims, plans it and registers its
// calls as in flight; b's lead, woken by its turn, then issues them (run).
// Registering under the same lock that took the ranges out of the gathering
// batch leaves no moment in which a Claim could miss them. Later calls do
// nothing. e.mu must be held.
func (e *Engine) seal(b *batch) {
	if b.sealed {
		return
	}
	b.sealed = true
	b.open()
	st := b.st
	if b.gathering {
		b.gathering = false
		st.gathering = nil
		e.batches--
		e.ranges -= b.ranges
		e.bytes -= b.bytes
		if e.batches == 0 && e.window != nil {
			e.window.Stop()
			e.window = nil
		}
	}
	dp := planDevice(OpDiscard, &b.p, e)
	b.p = pending{}
	st.stats.mergedAway.Add(uint64(dp.MergedAway()))
	b.fl.calls, b.lim, b.err = dp.Calls, dp.Limits, dp.err
	if len(b.fl.calls) > 0 {
		e.register(st, &b.fl)
	}
	e.setPending()
}

// run issues batch b when its turn comes (sealing it if nobody has yet)
// and answers its trims. Only b's lead runs it.
func (e *Engine) run(b *batch) {
	<-b.turn
	e.mu.Lock()
	e.seal(b)
	e.mu.Unlock()
	err := b.err
	if err == nil {
		err = e.discardCalls(b.st, b.fl.calls, b.lim)
	}
	e.mu.Lock()
	if len(b.fl.calls) > 0 {
		e.land(b.st, &b.fl)
	}
	e.mu.Unlock()
	b.err = err
	close(b.done)
}

// one is issue for a single extent, the trim of a linear table: the same
// plan (cut to the device's granularity, split at its maximum as issued)
// without the grouping, sorting and merging a single range does not need,
// issued on the caller's goroutine. e.mu must be held; one unlocks it.
func (e *Engine) one(st *device, x Extent) error {
	r := backing.Range{Off: x.Off, Len: x.Len}
	lim, err := e.limits(x.Dev)
	c, ok := cutOne(r, lim)
	if err != nil || !ok {
		st.stats.received1(r)
		e.mu.Unlock()
		return errors.Join(err)
	}
	fl := &inflight{}
	fl.one[0] = c
	fl.calls = fl.one[:]
	e.register(st, fl)
	st.stats.received1(r) // once a Claim can find it, as in issue
	e.mu.Unlock()

	err = e.discardCalls(st, fl.calls, lim)
	e.mu.Lock()
	e.land(st, fl)
	e.mu.Unlock()
	return errors.Join(err)
}

// limits asks d for its limits. The engine plans on the batch timer's
// goroutine and the write path's (a Claim that seals a batch) too, so a
// panic in Limits becomes the error of the trims that wait for d.
func (e *Engine) limits(d backing.Device) (lim backing.Limits, err error) {
	err = backing.Guard(d.Name(), e.OnPanic, func() error {
		lim = d.Limits()
		return nil
	})
	return lim, err
}

// discardCalls issues calls on one device in order, each split into pieces
// of at most the device's MaxBytes as it goes. A device that reports
// ErrNotSupported is remembered and skipped from then on; the first other
// error stops the device's remaining calls.
func (e *Engine) discardCalls(st *device, calls []backing.Range, lim backing.Limits) error {
	for i, r := range calls {
		for c := range pieces(r, lim) {
			if st.noDiscard.Load() {
				left := pieceCount(backing.Range{Off: c.Off, Len: r.End() - c.Off}, lim)
				for _, rest := range calls[i+1:] {
					left += pieceCount(rest, lim)
				}
				st.stats.unsupported.Add(uint64(left))
				return nil
			}
			err := e.call(st, "discard", func() error { return st.dev.Discard(c.Off, c.Len) })
			switch {
			case errors.Is(err, backing.ErrNotSupported):
				st.noDiscard.Store(true)
				st.stats.unsupported.Add(1)
			case err != nil:
				st.stats.errors.Add(1)
				return fmt.Errorf("discard %s %d+%d: %w", st.dev.Name(), c.Off, c.Len, err)
			default:
				st.stats.bytesOut.Add(uint64(c.Len))
			}
		}
	}
	return nil
}

// discardEach is the baseline: every range at once, in arrival order.
func (e *Engine) discardEach(exts []Extent) error {
	for _, x := range exts {
		e.mu.Lock()
		st := e.device(x.Dev)
		e.mu.Unlock()
		st.stats.received([]backing.Range{{Off: x.Off, Len: x.Len}})
		if err := e.discardCalls(st, []backing.Range{{Off: x.Off, Len: x.Len}}, backing.Limits{}); err != nil {
			return err
		}
	}
	return nil
}

// call runs one device call, counting and timing it. A panic in it becomes
// an error, so the bookkeeping around every device call (in-flight lists,
// batch waiters) always completes.
func (e *Engine) call(st *device, op string, fn func() error) error {
	if op == "zero" {
		st.stats.zeroCalls.Add(1)
	} else {
		st.stats.calls.Add(1)
	}
	if e.Observe == nil {
		return backing.Guard(st.dev.Name(), e.OnPanic, fn)
	}
	t0 := time.Now()
	err := backing.Guard(st.dev.Name(), e.OnPanic, fn)
	e.Observe(st.dev.Name(), op, time.Since(t0))
	return err
}

// Claim removes [off, off+n) on dev from the trims still gathering, and waits
// for issued discards that overlap it. The write and write-zeroes paths call
// it before they touch a device, so that a write is never undone by a trim
// the engine holds: the trim either never covers the written range or has
// finished before the write starts. (A trim that arrives after the Claim is
// concurrent with the write, and NBD leaves their order to the server.)
//
// The claimed ranges a gathering batch holds are bounded whatever the
// number of writes: they are merged as they double, and a batch with more
// than MaxRanges of them once merged is sealed and issued at once, without
// waiting for its turn (see batch.claim). Claim never waits for that
// batch's calls: they do not touch the range it claimed.
func (e *Engine) Claim(dev backing.Device, off, n int64) {
	if n <= 0 || !e.pending.Load() {
		return
	}
	end := off + n
	var wait []chan struct{}
	e.mu.Lock()
	st := e.devs[dev]
	if st == nil {
		e.mu.Unlock()
		return
	}
	if b := st.gathering; b != nil && off < b.hi && b.lo < end {
		b.claim(e, backing.Range{Off: off, Len: n})
	}
	for _, fl := range st.inflight {
		if overlaps(fl.calls, off, end) {
			if fl.done == nil {
				fl.done = make(chan struct{})
			}
			wait = append(wait, fl.done)
		}
	}
	e.mu.Unlock()
	for _, c := range wait {
		<-c
	}
}

// overlaps reports whether ascending, disjoint rs touch [off, end).
func overlaps(rs []backing.Range, off, end int64) bool {
	lo, hi := 0, len(rs)
	for lo < hi { // first range ending after off
		m := (lo + hi) / 2
		if rs[m].End() <= off {
			lo = m + 1
		} else {
			hi = m
		}
	}
	return lo < len(rs) && rs[lo].Off < end
}

// Zero makes the extents read back as zeros. mayPunch allows deallocation
// (NBD_CMD_WRITE_ZEROES without NO_HOLE). With fast, a device without a fast
// native zeroing method fails with backing.ErrNotSupported instead of having
// zeros written; a device already known to lack one fails the request before
// any device is touched.
func (e *Engine) Zero(exts []Extent, mayPunch, fast bool) error {
	p := PlanZero(exts)
	punch := 0
	if mayPunch {
		punch = 1
	}
	e.mu.Lock()
	sts := make([]*device, len(p.Devices))
	for i, dp := range p.Devices {
		sts[i] = e.device(dp.Dev)
	}
	e.mu.Unlock()
	for i, st := range sts {
		st.stats.zeroRangesIn.Add(uint64(len(p.Devices[i].In)))
		if fast && st.noZero[punch].Load() {
			return fmt.Errorf("zero %s: %w", st.dev.Name(), backing.ErrNotSupported)
		}
	}

	errs := make([]error, len(sts))
	var wg sync.WaitGroup
	for i, st := range sts {
		run := func() {
			for _, r := range p.Devices[i].Calls {
				if errs[i] = e.zero(st, r, punch, fast); errs[i] != nil {
					return
				}
			}
		}
		if i == len(sts)-1 {
			run()
			continue
		}
		wg.Add(1)
		go func() { defer wg.Done(); run() }()
	}
	wg.Wait()
	return errors.Join(errs...)
}

func (e *Engine) zero(st *device, r backing.Range, punch int, fast bool) error {
	err := backing.ErrNotSupported
	fz, refuses := st.dev.(backing.FastZeroer)
	switch {
	case st.noZero[punch].Load():
	case fast && refuses:
		// The device says per call whether zeroing is fast (an NBD
		// export passing FAST_ZERO on): a refusal fails this request
		// only, and says nothing of zeroing without FAST_ZERO.
		err = e.call(st, "zero", func() error { return fz.ZeroFast(r.Off, r.Len, punch == 1) })
	default:
		err = e.call(st, "zero", func() error { return st.dev.Zero(r.Off, r.Len, punch == 1) })
		if errors.Is(err, backing.ErrNotSupported) {
			st.noZero[punch].Store(true)
		}
	}
	if errors.Is(err, backing.ErrNotSupported) && !fast {
		err = backing.Guard(st.dev.Name(), e.OnPanic, func() error {
			return backing.WriteZeros(st.dev, r.Off, r.Len)
		})
	}
	if err != nil {
		if !errors.Is(err, backing.ErrNotSupported) {
			st.stats.errors.Add(1)
		}
		return fmt.Errorf("zero %s %d+%d: %w", st.dev.Name(), r.Off, r.Len, err)
	}
	return nil
}

// joinErrs is the errors of the devices of bs, in order.
func joinErrs(bs []*batch) error {
	var errs []error
	for _, b := range bs {
		if b.err != nil {
			errs = append(errs, b.err)
		}
	}
	return errors.Join(errs...)
}

func removeInflight(fls []*inflight, fl *inflight) []*inflight {
	for i, f := range fls {
		if f == fl {
			return append(fls[:i], fls[i+1:]...)
		}
	}
	return fls
}
