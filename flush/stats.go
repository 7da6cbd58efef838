package flush

// Stats are the engine's counters, read by the metrics package.
type Stats struct {
	// Flushes is how many flushes (Flush, FlushPlan, SyncEach calls) the
	// engine served.
	Flushes uint64
	// Devices has one entry per tracked device, in order of tracking.
	Devices []DeviceStats
}

// DeviceStats are one tracked device's counters.
type DeviceStats struct {
	Name string
	// Requested is how many flushes were fanned out to the device (plus
	// direct Sync calls on it). Each ended as one of: a sync it started or
	// queued, SkippedClean, Coalesced, or a failure after SyncErrors.
	Requested uint64
	// Syncs is how many real syncs reached the device.
	Syncs uint64
	// SkippedClean is how many requests needed no sync: nothing had
	// completed on the device since its last sync started.
	SkippedClean uint64
	// Coalesced is how many requests were served by a sync another flush
	// started or queued.
	Coalesced uint64
	// SyncErrors is how many syncs failed, counting durable writes that
	// failed the device (see Failed).
	SyncErrors uint64
	// Dirty says writes have completed that no successful sync covers.
	Dirty bool
	// Failed says a sync of the device (or a durable write, or a panic in
	// either) failed: every flush of it fails from now on with
	// ErrSyncFailed, until the device is closed (no table names it any
	// more) or the server restarts. FailedError is the first failure's
	// error text.
	Failed      bool
	FailedError string
	// SyncSeconds is the total time spent in syncs.
	SyncSeconds float64
}

// Stats returns a snapshot of the counters.
func (e *Engine) Stats() Stats {
	e.mu.Lock()
	order := append([]*tracked(nil), e.order...)
	e.mu.Unlock()
	s := Stats{Flushes: e.flushes.Load(), Devices: make([]DeviceStats, 0, len(order))}
	for _, t := range order {
		t.mu.Lock()
		var failed string
		if t.failed != nil {
			failed = t.failed.Error()
		}
		s.Devices = append(s.Devices, DeviceStats{
			Name:         t.Name(),
			Requested:    t.st.requested,
			Syncs:        t.st.syncs,
			SkippedClean: t.st.skippedClean,
			Coalesced:    t.st.coalesced,
			SyncErrors:   t.st.syncErrors,
			Dirty:        t.written.Load() > t.synced,
			SyncSeconds:  t.st.syncTime.Seconds(),
			Failed:       t.failed != nil,
			FailedError:  failed,
		})
		t.mu.Unlock()
	}
	return s
}
