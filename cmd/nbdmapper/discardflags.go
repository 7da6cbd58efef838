package main

import (
	"flag"
	"log/slog"
	"time"

	"github.com/nbdmapper/nbdmapper/discard"
)

// discardFlags are serve's discard engine settings.
type discardFlags struct {
	window     time.Duration
	perRequest bool
	baseline   bool
}

func (f *discardFlags) register(fs *flag.FlagSet) {
	fs.DurationVar(&f.window, "discard-window", 0, "how long the first trim of a batch waits for others (0: group commit, trims wait only while earlier ones are issued)")
	fs.BoolVar(&f.perRequest, "discard-per-request", false, "benchmark only: never batch trims across requests")
	fs.BoolVar(&f.baseline, "discard-baseline", false, "benchmark only: issue every mapped trim range at once, in arrival order, unmerged")
}

func (f *discardFlags) apply(e *discard.Engine) {
	e.Window = f.window
	e.PerRequest = f.perRequest
	e.Baseline = f.baseline
}

// logDiscardStats logs the discard engine's counters at shutdown: one
// summary line (bench/discard.sh reads calls per device from it) and one per
// device.
func logDiscardStats(log *slog.Logger, d *discard.Engine) {
	var in, calls, merged, unsupported, errs uint64
	for _, s := range d.Stats().Devices {
		in += s.RangesIn
		calls += s.Calls
		merged += s.MergedAway
		unsupported += s.Unsupported
		errs += s.Errors
		log.Info("discard device", "device", s.Name, "ranges_in", s.RangesIn, "bytes_in", s.BytesIn,
			"calls", s.Calls, "bytes_out", s.BytesOut, "merged_away", s.MergedAway,
			"unsupported", s.Unsupported, "errors", s.Errors, "zero_ranges_in", s.ZeroRangesIn, "zero_calls", s.ZeroCalls)
	}
	log.Info("discard stats", "ranges_in", in, "calls", calls, "merged_away", merged,
		"unsupported", unsupported, "errors", errs)
}
