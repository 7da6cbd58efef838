package flush

import (
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/nbdmapper/nbdmapper/backing"
	"github.com/nbdmapper/nbdmapper/internal/testing/fault"
	"github.com/nbdmapper/nbdmapper/internal/testing/nbdtest"
)

// fileDisk is a real sparse file behind a backing.Faulty, tracked by an
// engine.
type fileDisk struct {
	name   string // the file's path, the device's name
	faulty *backing.Faulty
	dev    backing.Device
}

func newFileDisk(t *testing.T, e *Engine, name string) *fileDisk {
	t.Helper()
	f := fault.Files(t, 1<<20, name)[0]
	return &fileDisk{name: f.Name(), faulty: f, dev: e.Track(f)}
}

func logPanics(e *Engine) *fault.PanicLog {
	l := &fault.PanicLog{}
	e.OnPanic = l.OnPanic
	return l
}

// A FUA write whose durable write fails, on the RWF_DSYNC path or in the
// sync of the write+flush fallback, fails the device: every later flush
// fails with ErrSyncFailed, though later syncs succeed, and Stats say so. A
// failure the kernel reports before writing anything (EINVAL) or a failed
// plain write (the fallback's WriteAt) does not.
func TestWriteFUAFailure(t *testing.T) {
	type tcase struct {
		name   string
		inject func(f *backing.Faulty)
		is     func(error) bool
		sticky bool
		panics int
	}
	var cases []tcase
	for _, flt := range fault.All {
		cases = append(cases,
			tcase{"dsync " + flt.Name, func(f *backing.Faulty) { f.Inject(backing.OpDSync, flt.Hook()) }, flt.Is, true, flt.Panics()},
			tcase{"fallback sync " + flt.Name, func(f *backing.Faulty) {
				f.Inject(backing.OpDSync, func() error { return backing.ErrNotSupported })
				f.Inject(backing.OpSync, flt.Hook())
			}, flt.Is, true, flt.Panics()})
	}
	cases = append(cases,
		tcase{"dsync EINVAL", func(f *backing.Faulty) { f.Inject(backing.OpDSync, fault.Errno(unix.EINVAL).Hook()) },
			func(err error) bool { return errors.Is(err, unix.EINVAL) }, false, 0},
		tcase{"fallback write EIO", func(f *backing.Faulty) {
			f.Inject(backing.OpDSync, func() error { return backing.ErrNotSupported })
			f.Inject(backing.OpWrite, fault.Errno(unix.EIO).Hook())
		}, func(err error) bool { return errors.Is(err, unix.EIO) }, false, 0})

	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			e := New()
			panics := logPanics(e)
			a := newFileDisk(t, e, "a.img")
			a.write(t, 0, 1) // acknowledged before the failure
			tc.inject(a.faulty)
			err := e.WriteFUA(a.dev, []byte{2, 3}, 4096)
			if !tc.is(err) {
				t.Fatalf("WriteFUA: %v, want the device's error", err)
			}
			panics.Check(t, tc.panics)
			for _, op := range []backing.Op{backing.OpDSync, backing.OpSync, backing.OpWrite} {
				a.faulty.Inject(op, nil) // the device recovers
			}
			s := devStats(e, a.name)
			if s.Failed != tc.sticky || (s.FailedError != "") != tc.sticky {
				t.Fatalf("stats %+v, want failed %v with its error", s, tc.sticky)
			}
			for i := range 2 {
				a.write(t, int64(i), 4)
				err := e.Flush([]backing.Device{a.dev})
				if tc.sticky && (!errors.Is(err, ErrSyncFailed) || !tc.is(err)) {
					t.Fatalf("flush %d after the failure: %v, want ErrSyncFailed wrapping the failure", i, err)
				}
				if !tc.sticky && err != nil {
					t.Fatalf("flush %d after a failure that wrote nothing: %v", i, err)
				}
			}
		})
	}
}

// A durable write that finds no descriptor of its own (the process is out
// of them) wrote nothing: the FUA write is written and flushed instead,
// this once, and does not fail the device; the next goes the durable way
// again.
func TestWriteFUANoDescriptor(t *testing.T) {
	e := New()
	a := newFileDisk(t, e, "a.img")
	var dsyncs atomic.Int32
	a.faulty.Inject(backing.OpDSync, func() error {
		if dsyncs.Add(1) == 1 {
			return fmt.Errorf("reopening: %w: %w", backing.ErrNoDescriptor, unix.EMFILE)
		}
		return nil
	})
	for i := range 2 {
		if err := e.WriteFUA(a.dev, []byte{byte(i + 1)}, 4096); err != nil {
			t.Fatalf("FUA write %d: %v", i, err)
		}
		got := make([]byte, 1)
		if _, err := a.dev.ReadAt(got, 4096); err != nil || got[0] != byte(i+1) {
			t.Fatalf("FUA write %d read back %v (%v)", i, got, err)
		}
	}
	s := devStats(e, a.name)
	if n := dsyncs.Load(); n != 2 || s.Failed || s.Syncs != 1 {
		t.Fatalf("%d durable writes tried, stats %+v; want 2, one sync (the fallback's), not failed", n, s)
	}
}

func (d *fileDisk) write(t testing.TB, off int64, b ...byte) {
	t.Helper()
	if _, err := d.dev.WriteAt(b, off); err != nil {
		t.Fatal(err)
	}
}

// Every flush waiting on a failing sync gets its error, whether it started
// the sync, joined it or queued behind it, and whether the sync fails on the
// flush's goroutine or on the one the engine starts for a queued sync; every
// later flush fails too, and nothing hangs.
func TestGroupCommitFailure(t *testing.T) {
	for _, flt := range fault.All {
		for _, failing := range []int{1, 2} { // the running sync, or the queued one
			t.Run(fmt.Sprintf("%s/sync %d fails", flt.Name, failing), func(t *testing.T) {
				e := New()
				panics := logPanics(e)
				a := newFileDisk(t, e, "a.img")
				entered := make(chan struct{}, 4)
				gate := make(chan struct{})
				var syncs atomic.Int32
				fail := flt.Hook()
				a.faulty.Inject(backing.OpSync, func() error {
					entered <- struct{}{}
					<-gate
					if int(syncs.Add(1)) == failing {
						return fail()
					}
					return nil
				})
				flush := func(results chan<- error) {
					go func() { results <- e.Flush([]backing.Device{a.dev}) }()
				}
				a.write(t, 0, 1)
				first := make(chan error, 5) // the flush that starts S1 and those joining it
				next := make(chan error, 4)  // flushes queued behind S1, served by S2
				flush(first)
				fault.Within(t, "first sync starts", entered)
				for range 4 {
					flush(first)
				}
				waitRequested(t, e, a.name, 5)
				a.write(t, 1, 2) // completes during S1: later flushes need S2
				for range 4 {
					flush(next)
				}
				waitRequested(t, e, a.name, 9)
				close(gate)

				for i := range 5 {
					err := fault.Within(t, "flushes joined to the first sync", first)
					if failing == 1 && !flt.Is(err) || failing == 2 && err != nil {
						t.Errorf("flush %d on the first sync: %v", i, err)
					}
				}
				for i := range 4 {
					err := fault.Within(t, "flushes queued behind the first sync", next)
					if failing == 1 && !errors.Is(err, ErrSyncFailed) || failing == 2 && !flt.Is(err) {
						t.Errorf("queued flush %d: %v", i, err)
					}
				}
				if err := e.Flush([]backing.Device{a.dev}); !errors.Is(err, ErrSyncFailed) {
					t.Fatalf("flush after the failure: %v, want ErrSyncFailed", err)
				}
				if got := int(syncs.Load()); got != failing {
					t.Errorf("%d syncs reached the device, want %d", got, failing)
				}
				panics.Check(t, flt.Panics())
				if s := devStats(e, a.name); !s.Failed || s.SyncErrors != 1 {
					t.Errorf("stats %+v, want failed after one sync error", s)
				}
			})
		}
	}
}

// A sync that a flush runs on a goroutine of its own (every device but its
// first) and a sync of a device the engine does not track turn a panic into
// an error for that flush, leaving the other devices alone; so does
// SyncEach.
func TestSyncPanicOnFlushGoroutine(t *testing.T) {
	e := New()
	panics := logPanics(e)
	a := newFileDisk(t, e, "a.img")
	b := newFileDisk(t, e, "b.img")
	u := backing.NewFaulty(backing.NewMem("untracked", 4096))
	b.faulty.Inject(backing.OpSync, fault.Panic.Hook())
	u.Inject(backing.OpSync, fault.Panic.Hook())
	a.write(t, 0, 1)
	b.write(t, 0, 1)

	err := e.Flush([]backing.Device{a.dev, b.dev, u})
	if !errors.Is(err, backing.ErrPanic) || !strings.Contains(err.Error(), b.name) || !strings.Contains(err.Error(), "untracked") {
		t.Fatalf("flush: %v, want panics of %s and untracked", err, b.name)
	}
	panics.Check(t, 2)
	if sa, sb := devStats(e, a.name), devStats(e, b.name); sa.Failed || sa.Dirty || !sb.Failed {
		t.Fatalf("a %+v, b %+v: want a synced, b failed", sa, sb)
	}
	if err := e.SyncEach([]backing.Device{a.dev, u}); !errors.Is(err, backing.ErrPanic) {
		t.Fatalf("SyncEach: %v, want ErrPanic", err)
	}
	if err := e.Flush([]backing.Device{a.dev}); err != nil {
		t.Fatalf("a, after b failed: %v", err)
	}
}

// Errors and panics of writes, discards and zeroing through a tracked
// device come back as errors, leave the device dirty, and do not fail its
// flushes: nothing was acknowledged.
func TestTrackedWriteFailure(t *testing.T) {
	ops := []struct {
		op backing.Op
		do func(d backing.Device) error
	}{
		{backing.OpWrite, func(d backing.Device) error { _, err := d.WriteAt([]byte{1}, 0); return err }},
		{backing.OpDiscard, func(d backing.Device) error { return d.Discard(0, 4096) }},
		{backing.OpZero, func(d backing.Device) error { return d.Zero(0, 4096, false) }},
	}
	for _, o := range ops {
		for _, flt := range fault.All {
			t.Run(fmt.Sprintf("%s/%s", o.op, flt.Name), func(t *testing.T) {
				e := New()
				logPanics(e)
				a := newFileDisk(t, e, "a.img")
				a.faulty.Inject(o.op, flt.Hook())
				if err := o.do(a.dev); !flt.Is(err) {
					t.Fatalf("%s: %v, want the device's error", o.op, err)
				}
				if s := devStats(e, a.name); !s.Dirty {
					t.Fatalf("stats %+v: a failed %s must leave the device dirty", s, o.op)
				}
				if err := e.Flush([]backing.Device{a.dev}); err != nil {
					t.Fatalf("flush after a failed %s: %v", o.op, err)
				}
			})
		}
	}
}

// A durable write that fails while a sync of the same device runs may have
// taken the write-back error that sync should have reported (one per open
// file), so the flushes waiting on that sync fail too.
func TestDSyncFailureDuringSync(t *testing.T) {
	e := New()
	a := newFileDisk(t, e, "a.img")
	entered := make(chan struct{}, 1)
	gate := make(chan struct{})
	a.faulty.Inject(backing.OpSync, func() error {
		entered <- struct{}{}
		<-gate
		return nil
	})
	a.faulty.Inject(backing.OpDSync, fault.Errno(unix.EIO).Hook())
	a.write(t, 0, 1)
	done := make(chan error, 1)
	go func() { done <- e.Flush([]backing.Device{a.dev}) }()
	fault.Within(t, "sync starts", entered)
	if err := e.WriteFUA(a.dev, []byte{2}, 1); !errors.Is(err, unix.EIO) {
		t.Fatalf("WriteFUA: %v, want EIO", err)
	}
	close(gate)
	if err := fault.Within(t, "flush", done); !errors.Is(err, ErrSyncFailed) || !errors.Is(err, unix.EIO) {
		t.Fatalf("flush whose sync ran across the failure: %v, want ErrSyncFailed wrapping EIO", err)
	}
}

// The kernel reports a write-back error once per open file, to whichever
// call checks first. A sync that returns 0 while a durable write of its
// device is in the device may have had its error taken by that write, so
// its flushes are answered only once the write is out, and fail with it.
func TestSyncWaitsForDurableWrite(t *testing.T) {
	e := New()
	a := newFileDisk(t, e, "a.img")
	entered := make(chan struct{}, 1)
	gate := make(chan struct{})
	a.faulty.Inject(backing.OpDSync, func() error {
		entered <- struct{}{}
		<-gate
		return unix.EIO
	})
	fua := make(chan error, 1)
	go func() { fua <- e.WriteFUA(a.dev, []byte{2}, 1) }()
	fault.Within(t, "the durable write to reach the device", entered)
	a.write(t, 0, 1)
	flushed := make(chan error, 1)
	go func() { flushed <- e.Flush([]backing.Device{a.dev}) }()
	nbdtest.Until(t, "the sync to come back", func() bool { return devStats(e, a.name).Syncs == 1 })
	unanswered(t, flushed, "the flush")
	close(gate)
	if err := fault.Within(t, "WriteFUA", fua); !errors.Is(err, unix.EIO) {
		t.Fatalf("WriteFUA: %v, want EIO", err)
	}
	if err := fault.Within(t, "flush", flushed); !errors.Is(err, ErrSyncFailed) || !errors.Is(err, unix.EIO) {
		t.Fatalf("flush whose sync overlapped the failed write: %v, want ErrSyncFailed wrapping EIO", err)
	}
}

// The other way round: a durable write whose RWF_DSYNC returns 0 while a
// sync of its device is in the device may have had its error taken by that
// sync, so it is answered once the sync is out, and fails with it.
func TestDurableWriteWaitsForSync(t *testing.T) {
	e := New()
	a := newFileDisk(t, e, "a.img")
	entered := make(chan struct{}, 1)
	gate := make(chan struct{})
	var syncs atomic.Int32
	a.faulty.Inject(backing.OpSync, func() error {
		if syncs.Add(1) > 1 {
			return nil // the durable write's own (Faulty.WriteAtDSync syncs)
		}
		entered <- struct{}{}
		<-gate
		return unix.EIO
	})
	a.write(t, 0, 1)
	flushed := make(chan error, 1)
	go func() { flushed <- e.Flush([]backing.Device{a.dev}) }()
	fault.Within(t, "the sync to reach the device", entered)
	fua := make(chan error, 1)
	go func() { fua <- e.WriteFUA(a.dev, []byte{2}, 1) }()
	tr := e.lookup(a.dev)
	nbdtest.Until(t, "the durable write to come back", func() bool {
		tr.mu.Lock()
		defer tr.mu.Unlock()
		// The sync has ticket 1, the durable write 2.
		return tr.tickets == 2 && len(tr.inflight[durableCall]) == 0 || len(fua) == 1
	})
	unanswered(t, fua, "WriteFUA")
	close(gate)
	if err := fault.Within(t, "flush", flushed); !errors.Is(err, unix.EIO) {
		t.Fatalf("flush: %v, want EIO", err)
	}
	if err := fault.Within(t, "WriteFUA", fua); !errors.Is(err, ErrSyncFailed) || !errors.Is(err, unix.EIO) {
		t.Fatalf("WriteFUA that overlapped the failed sync: %v, want ErrSyncFailed wrapping EIO", err)
	}
}

// unanswered fails t if what already has its answer in ch: it must wait
// for a call of the other kind that it overlapped in the device.
func unanswered(t *testing.T, ch chan error, what string) {
	t.Helper()
	select {
	case err := <-ch:
		t.Fatalf("%s answered (%v) while a call it overlapped was in the device", what, err)
	default:
	}
}

// Containing panics costs the hot paths nothing: a tracked write and a FUA
// write through RWF_DSYNC on a real file allocate nothing.
func TestRecoveryAllocatesNothing(t *testing.T) {
	e := New()
	f := fault.Files(t, 1<<20, "a.img")[0]
	d := e.Track(f.Device) // the real file, with its RWF_DSYNC
	p := make([]byte, 4096)
	for name, fn := range map[string]func(){
		"WriteAt":  func() { d.WriteAt(p, 0) },
		"WriteFUA": func() { e.WriteFUA(d, p, 0) },
	} {
		if n := testing.AllocsPerRun(20, fn); n != 0 {
			t.Errorf("%s: %v allocations per call", name, n)
		}
	}
}
