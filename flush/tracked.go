package flush

import (
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nbdmapper/nbdmapper/backing"
)

// ErrSyncFailed is returned by every flush of a device after one of its syncs
// failed: writes acknowledged before that failure may be lost even if a later
// sync succeeds (Linux may mark the pages clean after a failed fdatasync).
// The error also wraps the original sync error (usually EIO). A sync here is
// any call that writes back and reports write-back errors: Sync from a
// flush, from SyncEach or from a direct call on the tracked device, and the
// durable write of WriteFUA (see failsDevice). A panic in one counts as a
// failed sync.
var ErrSyncFailed = errors.New("an earlier sync of the device failed; acknowledged writes may be lost")

// tracked is a device wrapped by an Engine. It embeds the inner device and
// overrides only what changes the device's contents (WriteAt, Discard, Zero,
// which bump written after they complete, even when they fail or panic) and
// Sync (which goes through the engine so that it is skipped when clean and
// shared with flushes). A panic in the inner device becomes an error
// wrapping backing.ErrPanic.
type tracked struct {
	backing.Device
	e *Engine

	// written counts completed writes, discards and zeroings. It only grows.
	written atomic.Uint64

	mu      sync.Mutex
	synced  uint64 // written as read before the last successful sync
	running *call  // the sync in flight, if any
	next    *call  // the sync queued behind running, shared by its waiters
	failed  error  // first sync error; sticky
	st      counters

	// Calls that report write-back errors (syncs and durable writes) in
	// the device, by ticket: see settle.
	tickets  uint64      // the last ticket handed out
	inflight [2][]uint64 // by kind, the tickets of the calls in the device, ascending
	left     sync.Cond   // a call left the device; L is &mu

	noDSync atomic.Bool // WriteAtDSync returned ErrNotSupported once
}

var _ backing.Device = (*tracked)(nil)

type counters struct {
	requested, syncs, skippedClean, coalesced, syncErrors uint64
	syncTime                                              time.Duration
}

// call is one sync of a device and everyone waiting for it.
type call struct {
	start  uint64 // written, read just before the sync was issued
	ticket ticket // its place in the device (tracked.enter)
	done   chan struct{}
	err    error
}

func newCall() *call { return &call{done: make(chan struct{})} }

func (c *call) wait() error {
	<-c.done
	return c.err
}

// WriteAt, Discard and Zero bump written whether the inner call returned
// or panicked, since part of it may have reached the device. The deferred
// Recover runs before the deferred bump (defers run last first).
func (t *tracked) WriteAt(p []byte, off int64) (n int, err error) {
	defer t.written.Add(1)
	defer backing.Recover(&err, t.Name(), t.e.OnPanic)
	return t.Device.WriteAt(p, off)
}

func (t *tracked) Discard(off, n int64) (err error) {
	defer t.written.Add(1)
	defer backing.Recover(&err, t.Name(), t.e.OnPanic)
	return t.Device.Discard(off, n)
}

func (t *tracked) Zero(off, n int64, mayPunch bool) (err error) {
	defer t.written.Add(1)
	defer backing.Recover(&err, t.Name(), t.e.OnPanic)
	return t.Device.Zero(off, n, mayPunch)
}

// fastZeroTracked is a tracked device whose inner device can refuse slow
// zeroing: ZeroFast dirties the device as Zero does.
type fastZeroTracked struct {
	*tracked
	fz backing.FastZeroer
}

var _ backing.FastZeroer = (*fastZeroTracked)(nil)

func (f *fastZeroTracked) ZeroFast(off, n int64, mayPunch bool) (err error) {
	defer f.written.Add(1)
	defer backing.Recover(&err, f.Name(), f.e.OnPanic)
	return f.fz.ZeroFast(off, n, mayPunch)
}

// Sync makes every write that completed before the call durable, through
// the engine: it is free when the device is clean and shares a running or
// queued sync with concurrent flushes.
func (t *tracked) Sync() error {
	_, wait := t.request(t.written.Load())
	if wait == nil {
		return nil
	}
	return wait()
}

// Close ends the engine's tracking of the device and closes it: a
// backing.Pool closes a device once no table holds it.
func (t *tracked) Close() error {
	t.e.untrack(t)
	return t.Device.Close()
}

// decide says what a flush needing need would do now. t.mu must be held.
func (t *tracked) decide(need uint64) Entry {
	e := Entry{Device: t.Name(), Need: need, Synced: t.synced}
	if t.running != nil {
		e.Running, e.RunningStart = true, t.running.start
	}
	switch {
	case t.failed != nil:
		e.Action = Failed
	case need <= t.synced:
		e.Action = SkipClean
	case t.running == nil:
		e.Action = Sync
	case t.running.start >= need:
		// written only grows, so running.start >= need means nothing
		// completed between that sync's start and this flush's arrival.
		e.Action = JoinRunning
	case t.next == nil:
		e.Action = QueueNext
	default:
		e.Action = JoinNext
	}
	return e
}

// request registers a flush needing need and returns what it does and a
// function that waits for it (nil when there is nothing to wait for).
func (t *tracked) request(need uint64) (Entry, func() error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	e := t.decide(need)
	t.st.requested++
	switch e.Action {
	case Failed:
		err := t.stickyErr()
		return e, func() error { return err }
	case SkipClean:
		t.st.skippedClean++
		return e, nil
	case Sync:
		c := newCall()
		c.start, c.ticket = t.written.Load(), t.enter(syncCall)
		t.running = c
		return e, func() error { t.run(c); return c.err }
	case JoinRunning:
		t.st.coalesced++
		return e, t.running.wait
	case QueueNext:
		t.next = newCall()
		return e, t.next.wait
	case JoinNext:
		t.st.coalesced++
		return e, t.next.wait
	}
	panic(fmt.Sprintf("flush: unexpected action %v", e.Action))
}

func (t *tracked) stickyErr() error {
	return fmt.Errorf("%w: %w", ErrSyncFailed, t.failed)
}

// syncInner syncs the inner device, timing it; a panic becomes an error.
func (t *tracked) syncInner() (time.Duration, error) {
	begin := time.Now()
	err := backing.Guard(t.Name(), t.e.OnPanic, func() error { return syncDevice(t.Device) })
	return time.Since(begin), err
}

// run issues the sync c (which is t.running), records the result, starts
// the queued sync if there is one, and wakes c's waiters. It runs on the
// flush that started c or, for a queued sync, on a goroutine of its own;
// syncInner keeps a panicking device from skipping the bookkeeping below,
// so waiters are always woken and the queue always advances.
func (t *tracked) run(c *call) {
	took, err := t.syncInner()

	t.mu.Lock()
	c.err = t.record(c.ticket, c.start, took, err)
	t.running = nil
	n := t.next
	t.next = nil
	if n != nil {
		if t.failed != nil {
			n.err = t.stickyErr()
			close(n.done)
			n = nil
		} else {
			n.start, n.ticket = t.written.Load(), t.enter(syncCall)
			t.running = n
		}
	}
	t.mu.Unlock()

	if n != nil {
		go t.run(n)
	}
	if obs := t.e.Observe; obs != nil {
		obs(t.Name(), took)
	}
	close(c.done)
}

// record accounts for a finished sync that started at start, once every
// call it overlapped in the device has left it (settle), and returns what
// its waiters get. t.mu must be held.
func (t *tracked) record(ticket ticket, start uint64, took time.Duration, err error) error {
	t.st.syncs++
	t.st.syncTime += took
	if err != nil {
		t.failLocked(err)
	}
	if err = t.settle(ticket, err); err != nil {
		return err
	}
	t.synced = max(t.synced, start)
	return nil
}

// Calls that report write-back errors, as settle tells them apart.
const (
	syncCall    = iota // a sync
	durableCall        // a durable write (WriteFUA's RWF_DSYNC)
)

// ticket is a call's place in the device: its kind and the order it went in.
type ticket struct {
	kind int
	n    uint64
}

// enter hands a call of kind a ticket as it goes into the device. t.mu must
// be held.
func (t *tracked) enter(kind int) ticket {
	t.tickets++
	t.inflight[kind] = append(t.inflight[kind], t.tickets)
	return ticket{kind, t.tickets}
}

// settle is called, with t.mu held, when the call with tk has left the
// device with err (and has failed the device if err does). The kernel
// reports a write-back error once per open file, to whichever call checks
// first, so a sync that got 0 may have had its error taken by a durable
// write that was in the device at the same time, and the other way round.
// A call that got 0 therefore waits until every call of the other kind
// that went in before it came out has come out too, and gets the sticky
// error if the device failed by then. It waits only for calls still in the
// device, so two that overlap never wait for each other; a failed call
// waits for nothing. Durable writes do not wait for each other: under
// steady load each would wait for the one that went in last, which cost
// them half their throughput or more (docs/flush.md).
func (t *tracked) settle(tk ticket, err error) error {
	mine := &t.inflight[tk.kind]
	if i := slices.Index(*mine, tk.n); i >= 0 {
		*mine = slices.Delete(*mine, i, i+1)
	}
	t.left.Broadcast()
	if err != nil {
		return err // it vouches for nothing: no need to wait
	}
	last, other := t.tickets, &t.inflight[1-tk.kind]
	for len(*other) > 0 && (*other)[0] <= last {
		t.left.Wait()
	}
	if t.failed != nil {
		return t.stickyErr()
	}
	return nil
}

// failLocked records a failed sync, or a durable write's failure: from now
// on every flush of the device fails. t.mu must be held.
func (t *tracked) failLocked(err error) {
	t.st.syncErrors++
	if t.failed == nil {
		t.failed = err
	}
}

// syncNow syncs unconditionally, outside group commit (SyncEach baseline).
func (t *tracked) syncNow() error {
	t.mu.Lock()
	t.st.requested++
	if t.failed != nil {
		err := t.stickyErr()
		t.mu.Unlock()
		return err
	}
	start, ticket := t.written.Load(), t.enter(syncCall)
	t.mu.Unlock()
	took, err := t.syncInner()
	t.mu.Lock()
	err = t.record(ticket, start, took, err)
	t.mu.Unlock()
	if obs := t.e.Observe; obs != nil {
		obs(t.Name(), took)
	}
	return err
}

// Unwrap returns the inner device, for operations that do not change it
// (backing.Cache).
func (t *tracked) Unwrap() backing.Device { return t.Device }
