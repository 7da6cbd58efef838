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
	// for others to join it. 0, the default, batches by group commit: a
	// trim that finds no discard in flight is issued at once, and the trims
	// that arrive while discards are in flight gather into one batch,
	// issued as soon as those have completed (see the package comment).
	Window time.Duration
	// PerRequest issues each trim's own plan at once: sorted and merged
	// within the request, never batched with others. Benchmark baseline.
	PerRequest bool
	// MaxRanges and MaxBytes bound a batch: the trim that reaches either
	// issues the batch without waiting any longer.
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
	// caller's goroutine, on the batch timer's and on one goroutine per
	// device; a panic on any of them fails only the requests waiting for
	// that device call, with an error wrapping backing.ErrPanic, and the
	// engine goes on.
	OnPanic func(v any, stack []byte)

	mu      sync.Mutex
	batch   *batch // gathering trims; nil if none
	devs    map[backing.Device]*device
	order   []*device
	pending atomic.Bool // batch != nil, or something is in flight: Claim's fast path
	flying  int         // in-flight device plans, guarded by mu
	plans   uint64      // device plans ever issued, guarded by mu; numbers them
}

// device is the engine's state for one backing device.
type device struct {
	dev       backing.Device
	noDiscard atomic.Bool    // Discard returned ErrNotSupported once
	noZero    [2]atomic.Bool // Zero returned ErrNotSupported, by mayPunch
	stats     counters

	// Guarded by Engine.mu.
	gathering *pending    // this device's part of the gathering batch
	lo, hi    int64       // bounds of gathering.in
	inflight  []*inflight // issued discard plans not yet complete
}

// inflight is one device's issued discard calls. Claim waits for those it
// overlaps, so a write never lands before a discard that was already issued
// and is then undone by it.
type inflight struct {
	calls []backing.Range // ascending
	seq   uint64          // the plan's number (Engine.plans)
	// done is made by the first Claim that waits for these calls and
	// closed when they complete, both under Engine.mu: most discards are
	// never waited for, and then cost no channel.
	done chan struct{}
	one  [1]backing.Range // calls' array for a single call (Engine.one)
}

// register records fl as in flight on st and numbers it. e.mu must be held.
func (e *Engine) register(st *device, fl *inflight) {
	fl.seq = e.plans
	e.plans++
	st.inflight = append(st.inflight, fl)
	e.flying++
}

// land removes fl from st's calls in flight, waking the Claims that wait
// for it and a batch whose turn it was. e.mu must be held.
func (e *Engine) land(st *device, fl *inflight) {
	st.inflight = removeInflight(st.inflight, fl)
	e.flying--
	e.landed(fl.seq)
	if fl.done != nil {
		close(fl.done)
	}
}

// batch is the trims gathering to be issued together.
type batch struct {
	devs   []*device
	ranges int
	bytes  int64
	timer  *time.Timer // Window > 0: seals the batch
	sealed bool
	done   chan struct{}
	errs   map[*device]error // set before done is closed

	// Group commit (Window 0): the batch is issued once the device plans
	// that were in flight when it began (those numbered below after) have
	// completed; turn is closed then, or when the batch is sealed early.
	after   uint64
	waiting int // of those plans, how many are still in flight
	turn    chan struct{}
	turned  bool
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
	if e.batch == nil && e.flying == 0 && e.Window <= 0 {
		// Nothing gathering, nothing in flight: a batch of this trim
		// alone would be issued at once. Issue it without one; the trims
		// that arrive meanwhile gather behind it.
		return e.now(exts)
	}
	b := e.batch
	lead := b == nil
	if lead {
		b = &batch{done: make(chan struct{}), turn: make(chan struct{})}
		e.batch = b
		e.pending.Store(true)
		if e.Window > 0 {
			b.timer = time.AfterFunc(e.Window, func() { e.seal(b) })
		} else {
			b.after, b.waiting = e.plans, e.flying
			if b.waiting == 0 {
				b.open() // nothing in flight to wait for: issue it now
			}
		}
	}
	var mine []*device
	for _, x := range exts {
		if x.Len <= 0 {
			continue
		}
		st := e.device(x.Dev)
		g := st.gathering
		if g == nil {
			g = &pending{dev: x.Dev}
			st.gathering = g
			st.lo, st.hi = x.Off, x.Off+x.Len
			b.devs = append(b.devs, st)
		}
		r := backing.Range{Off: x.Off, Len: x.Len}
		g.in = append(g.in, r)
		st.lo, st.hi = min(st.lo, r.Off), max(st.hi, r.End())
		st.stats.received([]backing.Range{r})
		b.ranges++
		b.bytes += x.Len
		mine = appendUnique(mine, st)
	}
	full := b.ranges >= e.MaxRanges || b.bytes >= e.MaxBytes
	e.mu.Unlock()

	switch {
	case full:
		e.seal(b)
	case lead && e.Window <= 0:
		// The batch's first trim issues it when its turn comes; the
		// others wait for it below.
		<-b.turn
		e.seal(b)
	}
	<-b.done
	return joinErrs(mine, func(st *device) error { return b.errs[st] })
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
	return e.now(exts)
}

// one is now for a single extent, the trim of a linear table: the same
// plan (cut to the device's granularity, split at its maximum as issued)
// without the grouping, sorting and merging a single range does not need,
// issued on the caller's goroutine. e.mu must be held; one unlocks it.
func (e *Engine) one(x Extent) error {
	st := e.device(x.Dev)
	r := backing.Range{Off: x.Off, Len: x.Len}
	st.stats.received1(r)
	lim, err := e.limits(x.Dev)
	c, ok := cutOne(r, lim)
	if err != nil || !ok {
		e.mu.Unlock()
		return errors.Join(err)
	}
	fl := &inflight{}
	fl.one[0] = c
	fl.calls = fl.one[:]
	e.register(st, fl)
	e.pending.Store(true)
	e.mu.Unlock()

	err = e.discardCalls(st, fl.calls, lim)
	e.mu.Lock()
	e.land(st, fl)
	e.pending.Store(e.batch != nil || e.flying > 0)
	e.mu.Unlock()
	return errors.Join(err)
}

// limits asks d for its limits. The engine plans on the batch timer's
// goroutine too, so a panic in Limits becomes the error of the trims that
// wait for d.
func (e *Engine) limits(d backing.Device) (lim backing.Limits, err error) {
	err = backing.Guard(d.Name(), e.OnPanic, func() error {
		lim = d.Limits()
		return nil
	})
	return lim, err
}

// now issues exts, sorted and merged, at once. e.mu must be held; now
// unlocks it.
func (e *Engine) now(exts []Extent) error {
	if len(exts) == 1 && exts[0].Len > 0 {
		return e.one(exts[0])
	}
	devs := group(exts)
	sts := make([]*device, len(devs))
	for i, p := range devs {
		sts[i] = e.device(p.dev)
		sts[i].stats.received(p.in)
	}
	errs := e.launch(plan(OpDiscard, devs, e), sts)
	return joinErrs(sts, errs)
}

// seal closes batch b to new trims and issues it; the first caller does the
// work, later ones (the timer or the first trim, after a full batch) return
// at once.
func (e *Engine) seal(b *batch) {
	e.mu.Lock()
	if b.sealed {
		e.mu.Unlock()
		return
	}
	b.sealed = true
	if b.timer != nil {
		b.timer.Stop()
	}
	b.open() // a first trim still waiting for its turn goes on to done
	e.batch = nil
	devs := make([]*pending, len(b.devs))
	for i, st := range b.devs {
		devs[i] = st.gathering
		st.gathering = nil
	}
	wait := e.launch(plan(OpDiscard, devs, e), b.devs)
	errs := make(map[*device]error)
	for _, st := range b.devs {
		if err := wait(st); err != nil {
			errs[st] = err
		}
	}
	b.errs = errs
	close(b.done)
}

// launch registers plan p's device calls as in flight, unlocks e.mu, issues
// them (devices concurrently, each device's calls in ascending order) and
// returns a function that waits for one device. sts[i] is p.Devices[i]'s state.
// Registering under the same lock that took the ranges out of the gathering
// batch leaves no moment in which a Claim could miss them.
func (e *Engine) launch(p Plan, sts []*device) func(*device) error {
	type job struct {
		fl       inflight
		err      error
		finished chan struct{} // closed when a device run on its own goroutine is done
	}
	jobs := make([]job, len(sts))
	for i, st := range sts {
		dp := p.Devices[i]
		st.stats.mergedAway.Add(uint64(dp.MergedAway()))
		j := &jobs[i]
		j.fl.calls = dp.Calls
		if len(dp.Calls) > 0 {
			e.register(st, &j.fl)
		}
	}
	e.pending.Store(e.batch != nil || e.flying > 0)
	e.mu.Unlock()

	for i, st := range sts {
		j := &jobs[i]
		run := func() {
			j.err = p.Devices[i].err
			if j.err == nil {
				j.err = e.discardCalls(st, p.Devices[i].Calls, p.Devices[i].Limits)
			}
			e.mu.Lock()
			if len(p.Devices[i].Calls) > 0 {
				e.land(st, &j.fl)
			}
			e.pending.Store(e.batch != nil || e.flying > 0)
			e.mu.Unlock()
		}
		if i == len(sts)-1 {
			run() // the last device on this goroutine
		} else {
			j.finished = make(chan struct{})
			go func() { defer close(j.finished); run() }()
		}
	}
	return func(st *device) error {
		i := slices.Index(sts, st)
		if i < 0 {
			return nil
		}
		if c := jobs[i].finished; c != nil {
			<-c
		}
		return jobs[i].err
	}
}

// landed notes that device plan seq has completed: the gathering batch's
// turn comes when the last plan it waits for lands. e.mu must be held.
func (e *Engine) landed(seq uint64) {
	b := e.batch
	if b == nil || b.timer != nil || seq >= b.after {
		return
	}
	if b.waiting--; b.waiting == 0 {
		b.open()
	}
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
	if st.gathering != nil && off < st.hi && st.lo < end {
		st.gathering.claimed = append(st.gathering.claimed, backing.Range{Off: off, Len: n})
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

func joinErrs(sts []*device, errOf func(*device) error) error {
	var errs []error
	for _, st := range sts {
		if err := errOf(st); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

func appendUnique(sts []*device, st *device) []*device {
	for _, have := range sts {
		if have == st {
			return sts
		}
	}
	return append(sts, st)
}

func removeInflight(fls []*inflight, fl *inflight) []*inflight {
	for i, f := range fls {
		if f == fl {
			return append(fls[:i], fls[i+1:]...)
		}
	}
	return fls
}
