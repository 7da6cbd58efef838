package snapshot

import (
	"fmt"
	"log/slog"
	"sync/atomic"
)

// Config holds the settings every snapshot of the process shares, as
// dm-snapshot's module parameters do for the kernel's.
type Config struct {
	// MergeRate is the most bytes per second each snapshot-merge device
	// copies back to its origin; 0 means no limit.
	MergeRate int64
	// OnPanic, if set, is called with the value and stack of every panic
	// recovered from a device call the snapshot code makes on its own
	// behalf (copies, commits, the merge); the call fails as a device
	// error would.
	OnPanic func(v any, stack []byte)
	// Logger, if set, gets merges starting, finishing and failing.
	Logger *slog.Logger
}

// DefaultMergeRate is the merge rate until Configure sets one.
const DefaultMergeRate = 64 << 20

var config atomic.Pointer[Config]

func init() { config.Store(&Config{MergeRate: DefaultMergeRate}) }

// Configure sets the process's snapshot settings. Merges running already
// take the new rate from their next step.
func Configure(c Config) { config.Store(&c) }

func onPanic() func(v any, stack []byte) { return config.Load().OnPanic }

func logf(format string, args ...any) {
	if l := config.Load().Logger; l != nil {
		l.Info(fmt.Sprintf(format, args...))
	}
}

// Stats are the snapshot code's counters, for the whole process.
type Stats struct {
	// Commits counts metadata commits of persistent stores (each a sync,
	// one metadata write, a sync); Exceptions the exceptions they carried.
	// Exceptions/Commits is the batching.
	Commits, Exceptions uint64
	// MaxBatch is the most exceptions one commit carried.
	MaxBatch uint64
	// Merges running now, finished, and failed.
	MergesRunning         int64
	MergesDone, MergeFail uint64
	// MergedChunks and MergedBytes count what merges copied back.
	MergedChunks, MergedBytes uint64
	// Handovers counts stores handed from one loaded snapshot to another.
	Handovers uint64
}

// counters backs Stats.
type counters struct {
	commits, exceptions, batchMax atomic.Uint64
	mergesRunning                 atomic.Int64
	mergesDone, mergeFailures     atomic.Uint64
	mergedChunks, mergedBytes     atomic.Uint64
	handovers                     atomic.Uint64
}

var stats counters

// maxBatch raises batchMax to n.
func (c *counters) maxBatch(n uint64) {
	for {
		old := c.batchMax.Load()
		if n <= old || c.batchMax.CompareAndSwap(old, n) {
			return
		}
	}
}

// ReadStats returns the counters now.
func ReadStats() Stats {
	return Stats{
		Commits:       stats.commits.Load(),
		Exceptions:    stats.exceptions.Load(),
		MaxBatch:      stats.batchMax.Load(),
		MergesRunning: stats.mergesRunning.Load(),
		MergesDone:    stats.mergesDone.Load(),
		MergeFail:     stats.mergeFailures.Load(),
		MergedChunks:  stats.mergedChunks.Load(),
		MergedBytes:   stats.mergedBytes.Load(),
		Handovers:     stats.handovers.Load(),
	}
}
