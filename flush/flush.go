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

// Engine tracks which backing devices are dirty and syncs them on Flush.
// One Engine is shared by every connection and export of a server.
type Engine struct {
	// Observe, if set, is called after every real sync of a device with the
	// device's name and how long the sync took (the metrics package fills a
	// histogram from it). Set it before the engine is used.
	Observe func(device string, d time.Duration)
	// OnPanic, if set, is called with the value and stack of every panic
	// the engine recovers from a device call (a device's Sync, WriteAt,
	// Discard, Zero or WriteAtDSync), on whichever goroutine it happened.
	// The call then fails with an error wrapping backing.ErrPanic; a
	// panicking sync or durable write fails the device like a failed sync.
	// Set it before the engine is used.
	OnPanic func(v any, stack []byte)

	flushes atomic.Uint64

	mu      sync.Mutex
	tracked map[backing.Device]backing.Device // the wrapper, by inner device and by wrapper
	order   []*tracked
}

// New returns an engine with no tracked devices.
func New() *Engine { return &Engine{tracked: make(map[backing.Device]backing.Device)} }

// Track wraps d so that writes, discards and zeroing through it mark it
// dirty, and so that Flush can skip it when it is clean. A backing.Pool
// calls Track once per distinct device (install it as Pool.Wrap). Tracking
// the same device, or its wrapper, again returns the same wrapper.
//
// A device that can refuse slow zeroing (backing.FastZeroer) gets a wrapper
// that offers ZeroFast too, tracked like Zero.
func (e *Engine) Track(d backing.Device) backing.Device {
	e.mu.Lock()
	defer e.mu.Unlock()
	if w, ok := e.tracked[d]; ok {
		return w
	}
	t := &tracked{Device: d, e: e}
	t.left.L = &t.mu
	var w backing.Device = t
	if fz, ok := d.(backing.FastZeroer); ok {
		w = &fastZeroTracked{tracked: t, fz: fz}
	}
	e.tracked[d] = w
	e.tracked[w] = w
	e.order = append(e.order, t)
	return w
}

// untrack ends the tracking of t, which its Close does: the engine keeps
// nothing of a device that is gone. A holder of its wrapper still gets the
// device's sticky error, if it failed, from a flush of it.
func (e *Engine) untrack(t *tracked) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if w, ok := e.tracked[t.Device]; ok && e.lookup(w) == t {
		delete(e.tracked, t.Device)
		delete(e.tracked, w)
	}
	e.order = slices.DeleteFunc(e.order, func(o *tracked) bool { return o == t })
}

// lookup returns the engine's state for d, or nil if d is not a device this
// engine tracks.
func (e *Engine) lookup(d backing.Device) *tracked {
	var t *tracked
	switch w := d.(type) {
	case *tracked:
		t = w
	case *fastZeroTracked:
		t = w.tracked
	}
	if t != nil && t.e == e {
		return t
	}
	return nil
}

// Flush makes every write to devs that completed before the call durable.
// Each distinct device is synced at most once, concurrently with the others;
// clean devices are skipped and a running sync is shared (see the package
// comment). Devices the engine does not track are synced unconditionally.
func (e *Engine) Flush(devs []backing.Device) error {
	_, err := e.FlushPlan(devs)
	return err
}

// FlushPlan is Flush that also returns what it did, for tests and debug logs.
func (e *Engine) FlushPlan(devs []backing.Device) (Plan, error) {
	e.flushes.Add(1)
	devs = unique(devs)
	// Read every device's need before deciding anything, so that the flush's
	// arrival is one instant for all of its devices.
	needs := make([]uint64, len(devs))
	for i, d := range devs {
		if t := e.lookup(d); t != nil {
			needs[i] = t.written.Load()
		}
	}
	plan := Plan{Entries: make([]Entry, len(devs))}
	errs := make([]error, len(devs))
	waits := make([]func() error, len(devs))
	for i, d := range devs {
		t := e.lookup(d)
		if t == nil {
			plan.Entries[i] = Entry{Device: d.Name(), Action: SyncUntracked}
			waits[i] = func() error { return e.syncUntracked(d) }
			continue
		}
		plan.Entries[i], waits[i] = t.request(needs[i])
	}
	// Run the waits: the first inline, the rest in goroutines, so a flush of
	// one device costs no goroutine.
	var wg sync.WaitGroup
	first := -1
	for i, w := range waits {
		if w == nil {
			continue
		}
		if first < 0 {
			first = i
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = w()
		}()
	}
	if first >= 0 {
		errs[first] = waits[first]()
	}
	wg.Wait()
	var all []error
	for i, err := range errs {
		if err != nil {
			all = append(all, fmt.Errorf("flush %s: %w", devs[i].Name(), err))
		}
	}
	return plan, errors.Join(all...)
}

// Plan says what a Flush of devs arriving now would do, without syncing
// anything or counting anything.
func (e *Engine) Plan(devs []backing.Device) Plan {
	devs = unique(devs)
	plan := Plan{Entries: make([]Entry, len(devs))}
	for i, d := range devs {
		t := e.lookup(d)
		if t == nil {
			plan.Entries[i] = Entry{Device: d.Name(), Action: SyncUntracked}
			continue
		}
		t.mu.Lock()
		plan.Entries[i] = t.decide(t.written.Load())
		t.mu.Unlock()
	}
	return plan
}

// SyncEach syncs every entry of devs unconditionally, one after another,
// duplicates included, bypassing dirty tracking and group commit. It
// reproduces dm's pre-6.11 one-flush-per-target behaviour and exists only as
// a benchmark baseline (nbdtarget.Export.PerSegmentFlush). Its syncs are
// counted in Stats like any other.
func (e *Engine) SyncEach(devs []backing.Device) error {
	e.flushes.Add(1)
	for _, d := range devs {
		var err error
		if t := e.lookup(d); t != nil {
			err = t.syncNow()
		} else {
			err = e.syncUntracked(d)
		}
		if err != nil {
			return fmt.Errorf("flush %s: %w", d.Name(), err)
		}
	}
	return nil
}

// syncUntracked syncs a device the engine knows nothing about: there is no
// state to fail, but a panic in it must still not end the process.
func (e *Engine) syncUntracked(d backing.Device) error {
	return backing.Guard(d.Name(), e.OnPanic, d.Sync)
}

func unique(devs []backing.Device) []backing.Device {
	if len(devs) <= 1 {
		return devs
	}
	out := make([]backing.Device, 0, len(devs))
	seen := make(map[backing.Device]bool, len(devs))
	for _, d := range devs {
		if !seen[d] {
			seen[d] = true
			out = append(out, d)
		}
	}
	return out
}
