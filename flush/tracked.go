package flush

import (
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nbdmapper/nbdmapper/backing"
)

// ErrSyncFailed is returned by every flush of a device after one of its syncs
// failed: writes acknowledged before that failure may be lost even if a later
// sync succeeds (Linux may mark the pages clean after a failed fdatasync).
// The error also wraps the original sync error (usually EIO).
var ErrSyncFailed = errors.New("an earlier sync of the device failed; acknowledged writes may be lost")

// tracked is a device wrapped by an Engine. It embeds the inner device and
// overrides only what changes the device's contents (WriteAt, Discard, Zero,
// which bump written after they complete) and Sync (which goes through the
// engine so that it is skipped when clean and shared with flushes).
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
}

var _ backing.Device = (*tracked)(nil)

type counters struct {
	requested, syncs, skippedClean, coalesced, syncErrors uint64
	syncTime                                              time.Duration
}

// call is one sync of a device and everyone waiting for it.
type call struct {
	start uint64 // written, read just before the sync was issued
	done  chan struct{}
	err   error
}

func newCall() *call { return &call{done: make(chan struct{})} }

func (c *call) wait() error {
	<-c.done
	return c.err
}

func (t *tracked) WriteAt(p []byte, off int64) (int, error) {
	n, err := t.Device.WriteAt(p, off)
	t.written.Add(1)
	return n, err
}

func (t *tracked) Discard(off, n int64) error {
	err := t.Device.Discard(off, n)
	t.written.Add(1)
	return err
}

func (t *tracked) Zero(off, n int64, mayPunch bool) error {
	err := t.Device.Zero(off, n, mayPunch)
	t.written.Add(1)
	return err
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
		c.start = t.written.Load()
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

// run issues the sync c (which is t.running), records the result, starts
// the queued sync if there is one, and wakes c's waiters.
func (t *tracked) run(c *call) {
	begin := time.Now()
	err := syncDevice(t.Device)
	took := time.Since(begin)

	t.mu.Lock()
	t.record(c.start, took, err)
	c.err = err
	t.running = nil
	n := t.next
	t.next = nil
	if n != nil {
		if t.failed != nil {
			n.err = t.stickyErr()
			close(n.done)
			n = nil
		} else {
			n.start = t.written.Load()
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

// record accounts for a finished sync that started at start. t.mu must be held.
func (t *tracked) record(start uint64, took time.Duration, err error) {
	t.st.syncs++
	t.st.syncTime += took
	if err != nil {
		t.st.syncErrors++
		if t.failed == nil {
			t.failed = err
		}
		return
	}
	t.synced = max(t.synced, start)
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
	t.mu.Unlock()
	start := t.written.Load()
	begin := time.Now()
	err := t.Device.Sync()
	took := time.Since(begin)
	t.mu.Lock()
	t.record(start, took, err)
	t.mu.Unlock()
	if obs := t.e.Observe; obs != nil {
		obs(t.Name(), took)
	}
	return err
}
