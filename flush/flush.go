// Package flush turns an NBD flush into the fewest syncs that keep its
// guarantee: each distinct backing device that was written since its last
// sync is synced once; clean devices are skipped.
//
//	client -> nbdtarget -> table -> flush / discard -> backing
//
// PLACEHOLDER: a minimal correct engine; issue 3 replaces the internals
// (dirty generations, group commit, plans, stats) behind the same API.
package flush

import (
	"sync"

	"github.com/nbdmapper/nbdmapper/backing"
)

// Engine tracks which backing devices are dirty and syncs them on Flush.
// One Engine is shared by every connection and export of a server.
type Engine struct{}

// New returns an engine with no tracked devices.
func New() *Engine { return &Engine{} }

// Track wraps d so that writes, discards and zeroing through it mark it
// dirty. A backing.Pool calls Track once per distinct device.
func (e *Engine) Track(d backing.Device) backing.Device { return d }

// Flush makes every write to devs that completed before the call durable,
// syncing each distinct device at most once and concurrently.
func (e *Engine) Flush(devs []backing.Device) error {
	var wg sync.WaitGroup
	errs := make([]error, len(devs))
	for i, d := range devs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = d.Sync()
		}()
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			return err
		}
	}
	return nil
}

// SyncEach syncs every entry of devs unconditionally, one after another,
// duplicates included. It reproduces dm's pre-6.11 one-flush-per-target
// behaviour and exists only as a benchmark baseline.
func (e *Engine) SyncEach(devs []backing.Device) error {
	for _, d := range devs {
		if err := d.Sync(); err != nil {
			return err
		}
	}
	return nil
}
