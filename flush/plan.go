package flush

import (
	"fmt"
	"strings"
	"text/tabwriter"
)

// Action is what a flush does with one device.
type Action uint8

const (
	// Sync: the device is dirty and no sync is running; the flush starts one.
	Sync Action = iota
	// SkipClean: nothing completed on the device since its last successful
	// sync started; no sync needed.
	SkipClean
	// JoinRunning: a sync is running that started after every write the
	// flush needs; the flush waits for it.
	JoinRunning
	// QueueNext: a sync is running but started too early; the flush queues
	// the next sync, which starts when the running one ends and serves every
	// flush that queued behind it.
	QueueNext
	// JoinNext: like QueueNext, but the next sync was already queued by an
	// earlier flush; this one shares it.
	JoinNext
	// Failed: an earlier sync of the device failed; the flush fails.
	Failed
	// SyncUntracked: the device is not tracked by this engine, so nothing
	// is known about it; it is synced unconditionally.
	SyncUntracked
)

var actionNames = [...]string{
	Sync:          "sync",
	SkipClean:     "skip-clean",
	JoinRunning:   "join-running",
	QueueNext:     "queue-next",
	JoinNext:      "join-next",
	Failed:        "failed",
	SyncUntracked: "sync-untracked",
}

func (a Action) String() string {
	if int(a) < len(actionNames) {
		return actionNames[a]
	}
	return fmt.Sprintf("action(%d)", uint8(a))
}

// Entry is what one flush does with one device, and why.
type Entry struct {
	Device string
	Action Action
	// Need is how many writes had completed on the device when the flush
	// arrived; Synced how many the last successful sync covers.
	Need, Synced uint64
	// Running says a sync was in flight; RunningStart is how many writes it
	// covers.
	Running      bool
	RunningStart uint64
}

// Plan is what one flush does with each distinct device it was given, in
// order of first appearance.
type Plan struct {
	Entries []Entry
}

// Count is how many entries have action a.
func (p Plan) Count(a Action) int {
	n := 0
	for _, e := range p.Entries {
		if e.Action == a {
			n++
		}
	}
	return n
}

// String prints one line per device:
//
//	a.img  sync          need=5  synced=3
//	b.img  join-running  need=7  synced=3  running=7
func (p Plan) String() string {
	var b strings.Builder
	w := tabwriter.NewWriter(&b, 0, 0, 2, ' ', 0)
	for _, e := range p.Entries {
		if e.Action == SyncUntracked {
			fmt.Fprintf(w, "%s\t%s\n", e.Device, e.Action)
			continue
		}
		fmt.Fprintf(w, "%s\t%s\tneed=%d\tsynced=%d", e.Device, e.Action, e.Need, e.Synced)
		if e.Running {
			fmt.Fprintf(w, "\trunning=%d", e.RunningStart)
		}
		fmt.Fprintln(w)
	}
	w.Flush()
	return b.String()
}
