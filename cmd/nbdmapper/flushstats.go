package main

import (
	"log/slog"

	"github.com/nbdmapper/nbdmapper/flush"
)

// logFlushStats logs the flush engine's counters at shutdown: one summary
// line (bench/flush.sh reads syncs per flush from it) and one per device.
func logFlushStats(log *slog.Logger, f *flush.Engine) {
	s := f.Stats()
	var syncs, skipped, coalesced, errs uint64
	for _, d := range s.Devices {
		syncs += d.Syncs
		skipped += d.SkippedClean
		coalesced += d.Coalesced
		errs += d.SyncErrors
		log.Info("flush device", "device", d.Name, "requested", d.Requested, "syncs", d.Syncs,
			"skipped_clean", d.SkippedClean, "coalesced", d.Coalesced, "sync_errors", d.SyncErrors,
			"dirty", d.Dirty, "sync_seconds", d.SyncSeconds)
	}
	log.Info("flush stats", "flushes", s.Flushes, "syncs", syncs, "skipped_clean", skipped,
		"coalesced", coalesced, "sync_errors", errs)
}
