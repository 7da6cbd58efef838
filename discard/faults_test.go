package discard_test

import (
	"bytes"
	"fmt"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/nbdmapper/nbdmapper/backing"
	"github.com/nbdmapper/nbdmapper/discard"
	"github.com/nbdmapper/nbdmapper/internal/testing/fault"
)

// faultyFiles opens two real sparse files, a.img and b.img, each behind a
// backing.Faulty.
func faultyFiles(t *testing.T) [2]*backing.Faulty {
	return [2]*backing.Faulty(fault.Files(t, 1<<20, "a.img", "b.img"))
}

func ext(d backing.Device, off, n int64) discard.Extent {
	return discard.Extent{Dev: d, Off: off, Len: n}
}

// Three trims share a batch while device a fails: the trims that touch a get
// a's error, the one on b alone succeeds, and the one on both names only a.
// The engine is left with nothing in flight.
func TestBatchedDiscardFailure(t *testing.T) {
	for _, flt := range fault.All {
		t.Run(flt.Name, func(t *testing.T) {
			eng := engine(time.Hour, 4) // the fourth range seals the batch
			panics := &fault.PanicLog{}
			eng.OnPanic = panics.OnPanic
			devs := faultyFiles(t)
			a, b := devs[0], devs[1]
			a.Inject(backing.OpDiscard, flt.Hook())
			reqs := [][]discard.Extent{
				{ext(a, 0, 64<<10)},
				{ext(b, 0, 64<<10)},
				{ext(a, 128<<10, 64<<10), ext(b, 128<<10, 64<<10)},
			}
			results := make([]chan error, len(reqs))
			for i, exts := range reqs {
				results[i] = make(chan error, 1)
				go func() { results[i] <- eng.Discard(exts) }()
			}
			for i, want := range []bool{true, false, true} {
				err := fault.Within(t, fmt.Sprintf("trim %d", i), results[i])
				if want && (!flt.Is(err) || !strings.Contains(err.Error(), a.Name()) || strings.Contains(err.Error(), b.Name())) {
					t.Errorf("trim %d: %v, want a's error alone", i, err)
				}
				if !want && err != nil {
					t.Errorf("trim %d on the healthy device: %v", i, err)
				}
			}
			panics.Check(t, flt.Panics())
			if st := statsOf(t, eng, a.Name()); st.Errors != 1 {
				t.Errorf("a's stats %+v, want 1 error", st)
			}
			claimed := make(chan struct{})
			go func() { eng.Claim(a, 0, 1<<20); close(claimed) }()
			fault.Within(t, "Claim after the failed batch", claimed)
		})
	}
}

// A batch the window timer seals is issued on the timer's goroutine (its
// last device) and on goroutines of its own (the others): a panic on either
// fails the trim that waits for it, and the process goes on.
func TestDiscardPanicOnTimer(t *testing.T) {
	for _, panicking := range []int{0, 1} { // on a launched goroutine, or on the timer's
		t.Run(fmt.Sprintf("device %d of 2", panicking+1), func(t *testing.T) {
			eng := engine(time.Millisecond, 0)
			panics := &fault.PanicLog{}
			eng.OnPanic = panics.OnPanic
			devs := faultyFiles(t)
			devs[panicking].Inject(backing.OpDiscard, fault.Panic.Hook())
			done := make(chan error, 1)
			go func() { done <- eng.Discard([]discard.Extent{ext(devs[0], 0, 64<<10), ext(devs[1], 0, 64<<10)}) }()
			err := fault.Within(t, "trim sealed by the timer", done)
			if !fault.Panic.Is(err) || !strings.Contains(err.Error(), devs[panicking].Name()) {
				t.Fatalf("trim: %v, want the panic of %s", err, devs[panicking].Name())
			}
			panics.Check(t, 1)
			healthy := devs[1-panicking]
			if st := statsOf(t, eng, healthy.Name()); st.BytesOut != 64<<10 || st.Errors != 0 {
				t.Errorf("healthy device stats %+v, want its range discarded", st)
			}
		})
	}
}

// Write-zeroes over two devices while one fails, natively or in the
// fallback that writes zeros: the request gets that device's error, the
// other device is zeroed, and the engine serves the next request.
func TestZeroFailure(t *testing.T) {
	paths := []struct {
		name   string
		inject func(f *backing.Faulty, flt fault.Fault)
	}{
		{"native", func(f *backing.Faulty, flt fault.Fault) { f.Inject(backing.OpZero, flt.Hook()) }},
		{"written zeros", func(f *backing.Faulty, flt fault.Fault) {
			f.Inject(backing.OpZero, func() error { return backing.ErrNotSupported })
			f.Inject(backing.OpWrite, flt.Hook())
		}},
	}
	for _, path := range paths {
		for _, flt := range fault.All {
			for _, failing := range []int{0, 1} { // on Zero's goroutine, or the caller's
				t.Run(fmt.Sprintf("%s/%s/device %d of 2", path.name, flt.Name, failing+1), func(t *testing.T) {
					eng := engine(0, 0)
					panics := &fault.PanicLog{}
					eng.OnPanic = panics.OnPanic
					devs := faultyFiles(t)
					healthy := devs[1-failing]
					data := bytes.Repeat([]byte{0x5a}, 8192)
					if _, err := healthy.WriteAt(data, 4096); err != nil {
						t.Fatal(err)
					}
					path.inject(devs[failing], flt)
					exts := []discard.Extent{ext(devs[0], 0, 512<<10), ext(devs[1], 0, 512<<10)}
					done := make(chan error, 1)
					go func() { done <- eng.Zero(exts, false, false) }()
					err := fault.Within(t, "write-zeroes", done)
					if !flt.Is(err) || !strings.Contains(err.Error(), devs[failing].Name()) {
						t.Fatalf("Zero: %v, want %s's error", err, devs[failing].Name())
					}
					panics.Check(t, flt.Panics())
					got := make([]byte, len(data))
					if _, err := healthy.ReadAt(got, 4096); err != nil || !bytes.Equal(got, make([]byte, len(data))) {
						t.Fatalf("healthy device not zeroed (err %v)", err)
					}
					if err := eng.Zero([]discard.Extent{ext(healthy, 0, 4096)}, true, false); err != nil {
						t.Fatalf("next write-zeroes: %v", err)
					}
				})
			}
		}
	}
}

// Over the wire, with libnbd: trims and write-zeroes on a device that
// fails or panics get the errno of its error, those on the healthy device
// succeed, and the connection stays up for the next request.
func TestServerDeviceFaults(t *testing.T) {
	for _, tc := range []struct {
		flt   fault.Fault
		errno string // Python's errno name for the NBD error
	}{
		{fault.Errno(unix.EIO), "EIO"},
		{fault.Errno(unix.ENOSPC), "ENOSPC"},
		{fault.Errno(unix.EROFS), "EPERM"},
		{fault.Panic, "EIO"},
	} {
		t.Run(tc.flt.Name, func(t *testing.T) {
			eng := engine(time.Millisecond, 0)
			panics := &fault.PanicLog{}
			eng.OnPanic = panics.OnPanic
			devs := faultyFiles(t)
			pool := &backing.Pool{}
			for _, d := range devs {
				pool.Add(d.Name(), d)
			}
			x := export(t, fmt.Sprintf("0 1024 linear %s 0\n1024 1024 linear %s 0\n", devs[0].Name(), devs[1].Name()), pool, eng)
			devs[0].Inject(backing.OpDiscard, tc.flt.Hook())
			devs[0].Inject(backing.OpZero, tc.flt.Hook())
			nbdsh(t, serve(t, x), fmt.Sprintf(`
for name, call in [("trim", lambda off: h.trim(65536, off)), ("zero", lambda off: h.zero(65536, off))]:
    try:
        call(0)
        raise SystemExit(name + " on the failing device succeeded")
    except nbd.Error as e:
        if e.errno != "%s":
            raise SystemExit("%%s: errno %%s, want %s" %% (name, e.errno))
    call(1024 * 512)  # the healthy device
h.pwrite(b"x" * 4096, 0)
`, tc.errno, tc.errno))
			panics.Check(t, 2*tc.flt.Panics())
		})
	}
}

// panicLimits is a device whose Limits panics.
type panicLimits struct{ backing.Device }

func (panicLimits) Limits() backing.Limits { panic("device bug: limits") }

// The timer's goroutine also plans the batch, asking each device for its
// limits: a device that panics there fails the trims waiting for it, and
// the other device's are issued.
func TestDiscardLimitsPanic(t *testing.T) {
	eng := engine(time.Millisecond, 0)
	panics := &fault.PanicLog{}
	eng.OnPanic = panics.OnPanic
	devs := faultyFiles(t)
	bad := panicLimits{devs[0]}
	done := make(chan error, 1)
	go func() { done <- eng.Discard([]discard.Extent{ext(bad, 0, 64<<10), ext(devs[1], 0, 64<<10)}) }()
	if err := fault.Within(t, "trim", done); !fault.Panic.Is(err) {
		t.Fatalf("trim: %v, want the panic", err)
	}
	if n := len(eng.Stats().Devices); n != 2 {
		t.Fatalf("%d devices in stats", n)
	}
	if st := statsOf(t, eng, devs[1].Name()); st.BytesOut != 64<<10 {
		t.Errorf("healthy device stats %+v, want its range discarded", st)
	}
}
