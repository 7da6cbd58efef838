package backing

import (
	"sync"
)

// Faulty is a fault-injecting device for tests. It behaves like a disk with
// a volatile write cache in front of the inner device: writes, discards and
// zeroings are kept in memory (and read back from there) until Sync, which
// applies them to the inner device in order and syncs it. Crash drops every
// write no Sync has covered, as a power cut would. Errors, panics and gates
// can be injected into each kind of call (FailWrites, FailSync, Inject) to
// exercise the failure paths of everything above.
//
//	WriteAt(A) WriteAt(B)  Sync  WriteAt(C)  Crash
//	cache:  A    A,B        -     C           -
//	inner:  -    -          A,B   A,B         A,B   (C is lost)
type Faulty struct {
	Device

	syncMu sync.Mutex // one Sync or Crash at a time

	mu         sync.Mutex
	pending    []faultyOp // volatile, oldest first
	failWrites error
	failSync   error
	hooks      map[Op]func() error
	syncs      int
	dropped    int
}

var _ Device = (*Faulty)(nil)

type faultyOp struct {
	off, n   int64
	data     []byte // nil for discard and zero
	mayPunch bool
	discard  bool
}

// NewFaulty wraps inner. Nothing written through the wrapper reaches inner
// before a Sync.
func NewFaulty(inner Device) *Faulty { return &Faulty{Device: inner} }

// FailWrites makes every later WriteAt, Discard and Zero fail with err
// without doing anything (nil stops it).
func (f *Faulty) FailWrites(err error) {
	f.mu.Lock()
	f.failWrites = err
	f.mu.Unlock()
}

// FailSync makes every later Sync fail with err, keeping the writes volatile
// (nil stops it).
func (f *Faulty) FailSync(err error) {
	f.mu.Lock()
	f.failSync = err
	f.mu.Unlock()
}

// OpDSync names WriteAtDSync for Inject.
const OpDSync Op = "dsync"

// Inject makes every later call of op (OpWrite, OpDiscard, OpZero, OpSync or
// OpDSync) run fn first, outside all locks, replacing what was injected for
// op before; nil removes it. fn may block (a gate holding the call in
// flight), panic (a device with a bug), or return an error, which fails the
// call without it doing anything: a write or discard that never happened, a
// sync that left the cache volatile, or, for OpDSync, a durable write whose
// write-back failed, so that its data is lost. WriteAtDSync then goes on to
// WriteAt and Sync, which run their own hooks.
func (f *Faulty) Inject(op Op, fn func() error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.hooks == nil {
		f.hooks = make(map[Op]func() error)
	}
	f.hooks[op] = fn
}

// BeforeSync sets a function every Sync calls first, outside all locks (tests
// use it to hold a sync in flight). It is Inject(OpSync) for a function that
// only waits; nil removes it.
func (f *Faulty) BeforeSync(fn func()) {
	if fn == nil {
		f.Inject(OpSync, nil)
		return
	}
	f.Inject(OpSync, func() error { fn(); return nil })
}

// hook runs what was injected for op.
func (f *Faulty) hook(op Op) error {
	f.mu.Lock()
	fn := f.hooks[op]
	f.mu.Unlock()
	if fn == nil {
		return nil
	}
	return fn()
}

// Syncs is how many times Sync was called, failed ones included.
func (f *Faulty) Syncs() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.syncs
}

// Pending is how many writes are volatile.
func (f *Faulty) Pending() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.pending)
}

// Crash drops every volatile write and returns how many it dropped. A Sync
// in progress completes first.
func (f *Faulty) Crash() int {
	f.syncMu.Lock()
	defer f.syncMu.Unlock()
	f.mu.Lock()
	defer f.mu.Unlock()
	n := len(f.pending)
	f.pending = nil
	f.dropped += n
	return n
}

func (f *Faulty) add(op faultyOp) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.failWrites != nil {
		return f.failWrites
	}
	if err := checkRange(f.Size(), op.off, op.n); err != nil {
		return err
	}
	f.pending = append(f.pending, op)
	return nil
}

func (f *Faulty) WriteAt(p []byte, off int64) (int, error) {
	if err := f.hook(OpWrite); err != nil {
		return 0, err
	}
	if err := f.add(faultyOp{off: off, n: int64(len(p)), data: append([]byte(nil), p...)}); err != nil {
		return 0, err
	}
	return len(p), nil
}

// Discard is cached like a write. Until a Sync the range reads as zeros.
func (f *Faulty) Discard(off, n int64) error {
	if err := f.hook(OpDiscard); err != nil {
		return err
	}
	return f.add(faultyOp{off: off, n: n, discard: true})
}

func (f *Faulty) Zero(off, n int64, mayPunch bool) error {
	if err := f.hook(OpZero); err != nil {
		return err
	}
	return f.add(faultyOp{off: off, n: n, mayPunch: mayPunch})
}

// ReadAt reads the inner device and lays the volatile writes over it, oldest
// first, as a page cache would.
func (f *Faulty) ReadAt(p []byte, off int64) (int, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	n, err := f.Device.ReadAt(p, off)
	if err != nil {
		return n, err
	}
	end := off + int64(len(p))
	for _, op := range f.pending {
		lo, hi := max(off, op.off), min(end, op.off+op.n)
		if lo >= hi {
			continue
		}
		dst := p[lo-off : hi-off]
		if op.data != nil {
			copy(dst, op.data[lo-op.off:hi-op.off])
		} else {
			clear(dst)
		}
	}
	return n, nil
}

// Holes reports the inner device's holes less the ranges of volatile
// writes, discards and zeroings, which read from the cache: as data (a
// cached discard reads as zeros, but calling it data is always safe).
func (f *Faulty) Holes(off, n int64) ([]Range, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	holes, err := f.Device.Holes(off, n)
	if err != nil || len(f.pending) == 0 {
		return holes, err
	}
	var out []Range
	for _, h := range holes {
		pieces := []Range{h}
		for _, op := range f.pending {
			var next []Range
			for _, p := range pieces {
				lo, hi := max(p.Off, op.off), min(p.End(), op.off+op.n)
				if lo >= hi {
					next = append(next, p)
					continue
				}
				if p.Off < lo {
					next = append(next, Range{Off: p.Off, Len: lo - p.Off})
				}
				if hi < p.End() {
					next = append(next, Range{Off: hi, Len: p.End() - hi})
				}
			}
			pieces = next
		}
		out = append(out, pieces...)
	}
	return out, nil
}

// Sync applies the writes that were volatile when it was called to the inner
// device, in order, then syncs it. On an injected or real error the writes
// stay volatile.
func (f *Faulty) Sync() error {
	f.mu.Lock()
	f.syncs++
	f.mu.Unlock()
	if err := f.hook(OpSync); err != nil {
		return err
	}
	f.syncMu.Lock()
	defer f.syncMu.Unlock()

	f.mu.Lock()
	if err := f.failSync; err != nil {
		f.mu.Unlock()
		return err
	}
	// Writes completing from here on stay volatile; ReadAt keeps showing
	// these ones from the cache until they are dropped from it below.
	ops := f.pending[:len(f.pending):len(f.pending)]
	f.mu.Unlock()

	for _, op := range ops {
		if err := f.apply(op); err != nil {
			return err
		}
	}
	if err := f.Device.Sync(); err != nil {
		return err
	}
	f.mu.Lock()
	f.pending = f.pending[len(ops):]
	f.mu.Unlock()
	return nil
}

// apply writes one cached op to the inner device. Holding f.mu keeps ReadAt
// from seeing the inner device half-written.
func (f *Faulty) apply(op faultyOp) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	switch {
	case op.data != nil:
		_, err := f.Device.WriteAt(op.data, op.off)
		return err
	case op.discard:
		// A discarded range may read back as anything; the cache showed
		// zeros, so make the device agree.
		err := f.Device.Discard(op.off, op.n)
		if err == nil {
			err = f.Device.Zero(op.off, op.n, true)
		}
		if err == ErrNotSupported {
			err = WriteZeros(f.Device, op.off, op.n)
		}
		return err
	default:
		err := f.Device.Zero(op.off, op.n, op.mayPunch)
		if err == ErrNotSupported {
			err = WriteZeros(f.Device, op.off, op.n)
		}
		return err
	}
}
