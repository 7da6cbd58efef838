package backing

import (
	"fmt"
	"strings"
	"sync"
)

// Op names a device call a Recorder logs.
type Op string

// Ops a Recorder logs. Reads are not logged: tests ask what reached the
// disks, and reads change nothing there.
const (
	OpWrite   Op = "write"
	OpSync    Op = "sync"
	OpDiscard Op = "discard"
	OpZero    Op = "zero"
)

// Call is one logged device call. Punch is Zero's mayPunch; Err is what the
// inner device returned.
type Call struct {
	Op       Op
	Off, Len int64
	Punch    bool
	Err      error
}

func (c Call) String() string {
	var b strings.Builder
	b.WriteString(string(c.Op))
	if c.Op != OpSync {
		fmt.Fprintf(&b, " %d+%d", c.Off, c.Len)
	}
	if c.Punch {
		b.WriteString(" punch")
	}
	if c.Err != nil {
		fmt.Fprintf(&b, " err=%v", c.Err)
	}
	return b.String()
}

// Recorder wraps a Device and logs every write, sync, discard and zero call
// that reaches it, in the order the calls were made, so that a test can see
// exactly which calls the engines above let through: how many syncs, which
// discard ranges, ascending or not. Calls are logged when they start; a call
// that the inner device fails is logged with its error.
type Recorder struct {
	Device

	mu    sync.Mutex
	calls []Call
}

var _ Device = (*Recorder)(nil)

// NewRecorder wraps d. It can serve as a Pool's Wrap function.
func NewRecorder(d Device) *Recorder { return &Recorder{Device: d} }

// record appends c and returns its index, so the result can be filled in.
func (r *Recorder) record(c Call) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.calls = append(r.calls, c)
	return len(r.calls) - 1
}

func (r *Recorder) result(i int, err error) {
	if err == nil {
		return
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	r.calls[i].Err = err
}

func (r *Recorder) WriteAt(p []byte, off int64) (int, error) {
	i := r.record(Call{Op: OpWrite, Off: off, Len: int64(len(p))})
	n, err := r.Device.WriteAt(p, off)
	r.result(i, err)
	return n, err
}

func (r *Recorder) Sync() error {
	i := r.record(Call{Op: OpSync})
	err := r.Device.Sync()
	r.result(i, err)
	return err
}

func (r *Recorder) Discard(off, n int64) error {
	i := r.record(Call{Op: OpDiscard, Off: off, Len: n})
	err := r.Device.Discard(off, n)
	r.result(i, err)
	return err
}

func (r *Recorder) Zero(off, n int64, mayPunch bool) error {
	i := r.record(Call{Op: OpZero, Off: off, Len: n, Punch: mayPunch})
	err := r.Device.Zero(off, n, mayPunch)
	r.result(i, err)
	return err
}

// Calls returns a copy of the log, or only the calls of the given ops.
func (r *Recorder) Calls(ops ...Op) []Call {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []Call
	for _, c := range r.calls {
		if len(ops) == 0 || hasOp(ops, c.Op) {
			out = append(out, c)
		}
	}
	return out
}

// Count is the number of logged calls of op.
func (r *Recorder) Count(op Op) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	n := 0
	for _, c := range r.calls {
		if c.Op == op {
			n++
		}
	}
	return n
}

// Reset empties the log.
func (r *Recorder) Reset() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.calls = nil
}

func hasOp(ops []Op, op Op) bool {
	for _, o := range ops {
		if o == op {
			return true
		}
	}
	return false
}
