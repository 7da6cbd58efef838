package discard_test

import (
	"bytes"
	"errors"
	"fmt"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/nbdmapper/nbdmapper/backing"
	"github.com/nbdmapper/nbdmapper/discard"
	"github.com/nbdmapper/nbdmapper/flush"
	"github.com/nbdmapper/nbdmapper/internal/testing/nbdtest"
	"github.com/nbdmapper/nbdmapper/internal/testing/sparse"
	"github.com/nbdmapper/nbdmapper/mapped"
	"github.com/nbdmapper/nbdmapper/table"
)

const (
	segs   = 1024
	segLen = 64 << 10 // bytes per table line
	half   = segs / 2 * segLen
)

// interleavedTable is the DUP-like layout: segment i of the virtual device
// on device i%2 at (i/2)*segLen, so the virtual device alternates between
// the two while each device's part is one contiguous run.
func interleavedTable(names [2]string) string {
	var b strings.Builder
	s := segLen / table.SectorSize
	for i := range segs {
		fmt.Fprintf(&b, "%d %d linear %s %d\n", i*s, s, names[i%2], i/2*s)
	}
	return b.String()
}

type rig struct {
	x    *mapped.Device
	eng  *discard.Engine
	recs [2]*backing.Recorder
	devs [2]backing.Device // what the table maps to (wrappers included)
}

// memRig builds the interleaved export over two in-memory devices, each
// wrapped by wrap (may be nil) and then by a Recorder.
func memRig(t *testing.T, eng *discard.Engine, wrap func(i int, d backing.Device) backing.Device) *rig {
	t.Helper()
	pool := &backing.Pool{}
	rg := &rig{eng: eng}
	names := [2]string{"a", "b"}
	for i, name := range names {
		var d backing.Device = backing.NewMem(name, half)
		if wrap != nil {
			d = wrap(i, d)
		}
		rg.recs[i] = backing.NewRecorder(d)
		rg.devs[i] = pool.Add(name, rg.recs[i])
	}
	rg.x = export(t, interleavedTable(names), pool, eng)
	return rg
}

// fileRig is memRig over two real sparse files.
func fileRig(t *testing.T, eng *discard.Engine) *rig {
	t.Helper()
	dir := t.TempDir()
	rg := &rig{eng: eng}
	var n int
	pool := &backing.Pool{Wrap: func(d backing.Device) backing.Device {
		rg.recs[n] = backing.NewRecorder(d)
		n++
		return rg.recs[n-1]
	}}
	t.Cleanup(func() { pool.Close() })
	var names [2]string
	for i := range names {
		names[i] = sparse.Create(t, filepath.Join(dir, fmt.Sprintf("disk%d.img", i)), half)
		d, err := pool.Open(names[i])
		if err != nil {
			t.Fatal(err)
		}
		rg.devs[i] = d
	}
	rg.x = export(t, interleavedTable(names), pool, eng)
	return rg
}

func export(t *testing.T, text string, open table.Opener, eng *discard.Engine) *mapped.Device {
	t.Helper()
	tb, err := table.Parse("interleaved.table", strings.NewReader(text), open)
	if err != nil {
		t.Fatal(err)
	}
	return mapped.New("x", tb, flush.New(), eng)
}

// engine makes an engine that batches trims within window, or, for window
// 0, issues each request's trims on their own (PerRequest); group-commit
// tests set their engines up themselves.
func engine(window time.Duration, maxRanges int) *discard.Engine {
	e := discard.New()
	e.Window = window
	e.PerRequest = window == 0
	if maxRanges > 0 {
		e.MaxRanges = maxRanges
	}
	return e
}

// discards returns the discard calls that reached r.
func discards(r *backing.Recorder) []backing.Range {
	var out []backing.Range
	for _, c := range r.Calls(backing.OpDiscard) {
		out = append(out, backing.Range{Off: c.Off, Len: c.Len})
	}
	return out
}

// fill writes one marked block at the start of every segment.
func fill(t *testing.T, x *mapped.Device) {
	t.Helper()
	blk := bytes.Repeat([]byte{0xaa}, 4096)
	for i := range segs {
		if err := x.Write(blk, int64(i)*segLen, false); err != nil {
			t.Fatal(err)
		}
	}
}

func TestWholeDeviceDiscardInterleaved(t *testing.T) {
	oneRun := []backing.Range{{Off: 0, Len: half}}
	var everySeg []backing.Range
	for i := range segs / 2 {
		everySeg = append(everySeg, backing.Range{Off: int64(i) * segLen, Len: segLen})
	}
	tests := []struct {
		name     string
		files    bool
		window   time.Duration
		baseline bool
		want     []backing.Range // on each device, in order
	}{
		{name: "files-window", files: true, window: time.Millisecond, want: oneRun},
		{name: "files-no-window", files: true, window: 0, want: oneRun},
		{name: "mem-window", window: time.Millisecond, want: oneRun},
		{name: "mem-baseline", baseline: true, want: everySeg},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			eng := engine(tc.window, 0)
			eng.Baseline = tc.baseline
			var rg *rig
			if tc.files {
				rg = fileRig(t, eng)
			} else {
				rg = memRig(t, eng, nil)
			}
			fill(t, rg.x)
			if err := rg.x.Trim(0, rg.x.Size(), false); err != nil {
				t.Fatal(err)
			}
			for i, rec := range rg.recs {
				if got := discards(rec); !slices.Equal(got, tc.want) {
					t.Errorf("device %d got %d discard calls %v..., want %d", i, len(got), got[:min(len(got), 4)], len(tc.want))
				}
				// The discard really deallocated: the device is one hole.
				holes, err := rg.devs[i].Holes(0, half)
				if err != nil {
					t.Fatal(err)
				}
				if !slices.Equal(holes, oneRun) {
					t.Errorf("device %d holes after discard = %v, want %v", i, holes, oneRun)
				}
			}
			st := eng.Stats()
			if len(st.Devices) != 2 {
				t.Fatalf("stats for %d devices, want 2", len(st.Devices))
			}
			for _, d := range st.Devices {
				want := discard.DeviceStats{Name: d.Name, RangesIn: segs / 2, BytesIn: half,
					Calls: uint64(len(tc.want)), BytesOut: half, MergedAway: segs/2 - uint64(len(tc.want))}
				if tc.baseline {
					want.MergedAway = 0
				}
				if d != want {
					t.Errorf("stats %+v, want %+v", d, want)
				}
			}
		})
	}
}

// TestSmallTrimsCoalesce sends many small adjacent trims at once, as a
// client discarding a device piece by piece with a deep queue does. The
// window never ends on its own; the batch is issued when it holds every
// trim, so what reaches the devices does not depend on timing.
func TestSmallTrimsCoalesce(t *testing.T) {
	tests := []struct {
		name      string
		n         int   // trims
		size      int64 // bytes each, adjacent from 0
		wantCalls []backing.Range
		wantB     []backing.Range
	}{
		// 64 one-segment trims: 32 adjacent ranges per device.
		{name: "segments", n: 64, size: segLen,
			wantCalls: []backing.Range{{Off: 0, Len: 32 * segLen}}, wantB: []backing.Range{{Off: 0, Len: 32 * segLen}}},
		// 16 trims of 1 KiB inside segment 0: each alone is smaller than the
		// 4 KiB granularity and would be dropped; merged they discard 16 KiB.
		{name: "sub-granule", n: 16, size: 1 << 10,
			wantCalls: []backing.Range{{Off: 0, Len: 16 << 10}}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			eng := engine(time.Hour, tc.n)
			rg := memRig(t, eng, nil)
			var wg sync.WaitGroup
			errs := make([]error, tc.n)
			for i := range tc.n {
				wg.Add(1)
				go func() {
					defer wg.Done()
					errs[i] = rg.x.Trim(int64(i)*tc.size, tc.size, false)
				}()
			}
			wg.Wait()
			if err := errors.Join(errs...); err != nil {
				t.Fatal(err)
			}
			if got := discards(rg.recs[0]); !slices.Equal(got, tc.wantCalls) {
				t.Errorf("device a got %v, want %v", got, tc.wantCalls)
			}
			if got := discards(rg.recs[1]); !slices.Equal(got, tc.wantB) {
				t.Errorf("device b got %v, want %v", got, tc.wantB)
			}
		})
	}

	// Without coalescing the sub-granule trims are each cut to nothing.
	t.Run("sub-granule-window-0", func(t *testing.T) {
		rg := memRig(t, engine(0, 0), nil)
		for i := range 16 {
			if err := rg.x.Trim(int64(i)<<10, 1<<10, false); err != nil {
				t.Fatal(err)
			}
		}
		if got := discards(rg.recs[0]); len(got) != 0 {
			t.Errorf("uncoalesced sub-granule trims reached the device: %v", got)
		}
	})
}

// TestWriteAfterPendingTrimKept: a trim is gathering, a write to part of
// its range arrives and completes, then the batch is issued. The write must
// survive and the discard calls must go around it.
func TestWriteAfterPendingTrimKept(t *testing.T) {
	eng := engine(time.Hour, 9)
	rg := memRig(t, eng, nil)
	fill(t, rg.x)

	// Virtual segments 0, 2, 4, 6 are device a's [0, 4*segLen).
	trimmed := make(chan error, 1)
	go func() { trimmed <- rg.x.Trim(0, 8*segLen, false) }()
	waitRangesIn(t, eng, 8)

	data := bytes.Repeat([]byte{0x5c}, 8192)
	woff := int64(2*segLen + 4096) // virtual segment 2 = device a at segLen
	if err := rg.x.Write(data, woff, false); err != nil {
		t.Fatal(err)
	}
	// A ninth range fills the batch (MaxRanges 9) and issues it.
	if err := rg.x.Trim(100*segLen, segLen, false); err != nil {
		t.Fatal(err)
	}
	if err := nbdtest.Recv(t, trimmed, "the trim"); err != nil {
		t.Fatal(err)
	}

	got := make([]byte, len(data))
	if _, err := rg.x.Read(got, woff); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, data) {
		t.Fatalf("write after a pending trim was undone")
	}
	wantA := []backing.Range{{Off: 0, Len: segLen + 4096}, {Off: segLen + 12288, Len: 3*segLen - 12288}, {Off: 50 * segLen, Len: segLen}}
	if got := discards(rg.recs[0]); !slices.Equal(got, wantA) {
		t.Errorf("device a discards = %v, want %v", got, wantA)
	}
}

func statsOf(t *testing.T, eng *discard.Engine, name string) discard.DeviceStats {
	t.Helper()
	for _, d := range eng.Stats().Devices {
		if d.Name == name {
			return d
		}
	}
	t.Fatalf("no stats for device %q", name)
	return discard.DeviceStats{}
}

// waitRangesIn waits until the engine has received n discard ranges.
func waitRangesIn(t *testing.T, eng *discard.Engine, n uint64) {
	t.Helper()
	nbdtest.Until(t, fmt.Sprintf("the engine to receive %d discard ranges", n), func() bool {
		var in uint64
		for _, d := range eng.Stats().Devices {
			in += d.RangesIn
		}
		return in >= n
	})
}

// waitParked waits until a goroutine whose stack holds frame is parked
// waiting for a channel or a condition (not a mutex, which is only held
// briefly), or until give returns true, and reports which happened first.
func waitParked(t *testing.T, frame string, give func() bool) (parked bool) {
	t.Helper()
	buf := make([]byte, 1<<20)
	nbdtest.Until(t, "a goroutine in "+frame+" to park", func() bool {
		if give() {
			return true
		}
		n := runtime.Stack(buf, true)
		for _, g := range strings.Split(string(buf[:n]), "\n\n") {
			state, _, _ := strings.Cut(g, "\n")
			long := strings.Contains(state, "[chan receive") || strings.Contains(state, "[select") ||
				strings.Contains(state, "[sync.Cond.Wait")
			if long && strings.Contains(g, frame) {
				parked = true
				return true
			}
		}
		return false
	})
	return parked
}

// gateDev blocks its first Discard until released (later ones pass), and
// counts the writes that reach it while that discard is held.
type gateDev struct {
	backing.Device
	entered, release chan struct{}
	first            atomic.Bool
	held             atomic.Bool
	writesWhileHeld  atomic.Int32
}

func (g *gateDev) Discard(off, n int64) error {
	if g.first.CompareAndSwap(false, true) {
		g.held.Store(true)
		close(g.entered)
		<-g.release
		g.held.Store(false)
	}
	return g.Device.Discard(off, n)
}

func (g *gateDev) WriteAt(p []byte, off int64) (int, error) {
	if g.held.Load() {
		g.writesWhileHeld.Add(1)
	}
	return g.Device.WriteAt(p, off)
}

// TestWriteWaitsForIssuedDiscard: a discard call is already running on the
// device when a write to the same range arrives. The write must wait for it,
// or the discard would undo the write.
func TestWriteWaitsForIssuedDiscard(t *testing.T) {
	gate := &gateDev{entered: make(chan struct{}), release: make(chan struct{})}
	rg := memRig(t, engine(0, 0), func(i int, d backing.Device) backing.Device {
		if i == 0 {
			gate.Device = d
			return gate
		}
		return d
	})
	trimmed := make(chan error, 1)
	go func() { trimmed <- rg.x.Trim(0, segLen, false) }()
	nbdtest.Recv(t, gate.entered, "the discard to reach the device")

	data := bytes.Repeat([]byte{0x33}, 4096)
	written := make(chan error, 1)
	go func() { written <- rg.x.Write(data, 4096, false) }()
	// The write must park behind the discard without reaching the device.
	if !waitParked(t, "mapped.(*Device).Write", func() bool { return gate.writesWhileHeld.Load() > 0 }) {
		t.Fatal("the write reached the device while a discard of its range was running")
	}
	select {
	case err := <-written:
		t.Fatalf("the write returned (%v) while a discard of its range was running", err)
	default:
	}
	close(gate.release)
	if err := nbdtest.Recv(t, trimmed, "the trim"); err != nil {
		t.Fatal(err)
	}
	if err := nbdtest.Recv(t, written, "the write"); err != nil {
		t.Fatal(err)
	}
	if n := gate.writesWhileHeld.Load(); n != 0 {
		t.Fatalf("%d writes reached the device while the discard was running", n)
	}
	got := make([]byte, len(data))
	if _, err := rg.x.Read(got, 4096); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, data) {
		t.Fatalf("write was undone by a discard issued before it")
	}
	calls := rg.recs[0].Calls()
	if len(calls) != 2 || calls[0].Op != backing.OpDiscard || calls[1].Op != backing.OpWrite {
		t.Errorf("device a calls = %v, want the discard then the write", calls)
	}
}

// TestWriteRacingTrimKeepsData races a write against a trim that the engine
// already holds, at whatever point the trim has reached (gathering, being
// issued, running): the write must always survive.
func TestWriteRacingTrimKeepsData(t *testing.T) {
	eng := engine(100*time.Microsecond, 0)
	rg := memRig(t, eng, nil)
	data := bytes.Repeat([]byte{0x77}, 4096)
	got := make([]byte, len(data))
	var held uint64
	for i := range 200 {
		off := int64(i%segs) * segLen
		trimmed := make(chan error, 1)
		go func() { trimmed <- rg.x.Trim(off, segLen, false) }()
		held++
		waitRangesIn(t, eng, held)
		if i%3 == 0 { // sometimes let the window run out first
			time.Sleep(time.Duration(i%7) * 30 * time.Microsecond)
		}
		woff := off + int64(i%16)*4096
		if err := rg.x.Write(data, woff, false); err != nil {
			t.Fatal(err)
		}
		if err := nbdtest.Recv(t, trimmed, "the trim"); err != nil {
			t.Fatal(err)
		}
		if _, err := rg.x.Read(got, woff); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, data) {
			t.Fatalf("round %d: write racing a trim was undone", i)
		}
	}
}

// notSupported cannot discard, like a filesystem without hole punching.
type notSupported struct{ backing.Device }

func (notSupported) Discard(off, n int64) error { return backing.ErrNotSupported }

func TestUnsupportedDetectedOnce(t *testing.T) {
	eng := engine(0, 0)
	rg := memRig(t, eng, func(i int, d backing.Device) backing.Device {
		if i == 1 {
			return notSupported{d}
		}
		return d
	})
	for range 3 {
		if err := rg.x.Trim(0, 4*segLen, false); err != nil {
			t.Fatalf("trim on a device without discard failed: %v", err)
		}
	}
	if n := rg.recs[1].Count(backing.OpDiscard); n != 1 {
		t.Errorf("device without discard was asked %d times, want once", n)
	}
	if n := rg.recs[0].Count(backing.OpDiscard); n != 3 {
		t.Errorf("device with discard got %d calls, want 3", n)
	}
	if st := statsOf(t, eng, "b"); st.Unsupported != 3 || st.Errors != 0 || st.Calls != 1 {
		t.Errorf("unsupported device stats %+v, want 3 unsupported, 1 call, 0 errors", st)
	}
}

// TestForget: what the engine keeps of a device (its counters, that it
// cannot discard) goes when the device is forgotten, and comes back afresh
// with its next trim.
func TestForget(t *testing.T) {
	eng := engine(0, 0)
	rg := memRig(t, eng, func(i int, d backing.Device) backing.Device {
		if i == 1 {
			return notSupported{d}
		}
		return d
	})
	if err := rg.x.Trim(0, 4*segLen, false); err != nil {
		t.Fatal(err)
	}
	eng.Forget(rg.devs[1])
	if got := eng.Stats().Devices; len(got) != 1 || got[0].Name != "a" {
		t.Fatalf("after forgetting b the engine has %+v, want a alone", got)
	}
	if err := eng.Discard([]discard.Extent{{Dev: rg.devs[1], Off: 0, Len: segLen}}); err != nil {
		t.Fatal(err)
	}
	if n := rg.recs[1].Count(backing.OpDiscard); n != 2 {
		t.Errorf("the forgotten device was asked to discard %d times, want twice (that it cannot is forgotten too)", n)
	}
	if st := statsOf(t, eng, "b"); st.RangesIn != 1 || st.Unsupported != 1 {
		t.Errorf("the forgotten device's counters start afresh: %+v, want 1 range in, 1 unsupported", st)
	}
}

// failing fails every discard.
type failing struct{ backing.Device }

func (failing) Discard(off, n int64) error { return syscall.EIO }

// TestErrorsReachTheirWaiters: two trims share a batch, one on a failing
// device: only that trim fails.
func TestErrorsReachTheirWaiters(t *testing.T) {
	eng := engine(time.Hour, 2)
	rg := memRig(t, eng, func(i int, d backing.Device) backing.Device {
		if i == 1 {
			return failing{d}
		}
		return d
	})
	var errA, errB error
	var wg sync.WaitGroup
	wg.Add(2)
	go func() { defer wg.Done(); errA = rg.x.Trim(0, segLen, false) }()      // device a
	go func() { defer wg.Done(); errB = rg.x.Trim(segLen, segLen, false) }() // device b
	wg.Wait()
	if errA != nil {
		t.Errorf("trim on the healthy device failed: %v", errA)
	}
	if !errors.Is(errB, syscall.EIO) {
		t.Errorf("trim on the failing device returned %v, want EIO", errB)
	}
	if st := statsOf(t, eng, "b"); st.Errors != 1 {
		t.Errorf("failing device stats %+v, want 1 error", st)
	}
}

// noZero has no native zeroing.
type noZero struct{ backing.Device }

func (noZero) Zero(off, n int64, mayPunch bool) error { return backing.ErrNotSupported }

func TestWriteZeroes(t *testing.T) {
	tests := []struct {
		name      string
		files     bool
		native    bool // device zeroes natively
		mayPunch  bool
		fast      bool
		wantErr   error
		wantZero  bool // the range reads back zeros afterwards
		wantCalls int  // zero calls reaching device a
	}{
		{name: "file-punch", files: true, native: true, mayPunch: true, wantZero: true, wantCalls: 1},
		{name: "file-no-hole", files: true, native: true, wantZero: true, wantCalls: 1},
		{name: "file-fast", files: true, native: true, fast: true, wantZero: true, wantCalls: 1},
		{name: "written-zeros", mayPunch: true, wantZero: true, wantCalls: 1},
		{name: "fast-fails", mayPunch: true, fast: true, wantErr: backing.ErrNotSupported, wantCalls: 1},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			eng := engine(0, 0)
			var rg *rig
			switch {
			case tc.files:
				rg = fileRig(t, eng)
			case tc.native:
				rg = memRig(t, eng, nil)
			default:
				rg = memRig(t, eng, func(_ int, d backing.Device) backing.Device { return noZero{d} })
			}
			fill(t, rg.x)
			// Segments 0, 2, 4 sent as three requests' worth of extents in
			// one: whole segments 0..5, device a gets one merged call.
			err := rg.x.WriteZeroes(0, 6*segLen, tc.mayPunch, tc.fast, false)
			if !errors.Is(err, tc.wantErr) || (err != nil && tc.wantErr == nil) {
				t.Fatalf("WriteZeroes = %v, want %v", err, tc.wantErr)
			}
			buf := make([]byte, 6*segLen)
			if _, err := rg.x.Read(buf, 0); err != nil {
				t.Fatal(err)
			}
			if isZero := !bytes.ContainsFunc(buf, func(r rune) bool { return r != 0 }); isZero != tc.wantZero {
				t.Errorf("range reads as zeros = %v, want %v", isZero, tc.wantZero)
			}
			zeros := rg.recs[0].Calls(backing.OpZero)
			if len(zeros) != tc.wantCalls {
				t.Fatalf("device a got zero calls %v, want %d", zeros, tc.wantCalls)
			}
			if z := zeros[0]; z.Off != 0 || z.Len != 3*segLen || z.Punch != tc.mayPunch {
				t.Errorf("zero call %v, want 0+%d punch=%v", z, 3*segLen, tc.mayPunch)
			}
			if tc.wantErr != nil {
				// Known now: the next fast zero fails without asking the device.
				err := rg.x.WriteZeroes(0, segLen, tc.mayPunch, true, false)
				if !errors.Is(err, backing.ErrNotSupported) {
					t.Errorf("second fast zero = %v, want ErrNotSupported", err)
				}
				if n := rg.recs[0].Count(backing.OpZero); n != 1 {
					t.Errorf("second fast zero reached the device (%d zero calls)", n)
				}
			}
			st := statsOf(t, eng, rg.recs[0].Name())
			if st.ZeroRangesIn == 0 || st.ZeroCalls != uint64(tc.wantCalls) {
				t.Errorf("stats %+v, want ZeroRangesIn > 0 and ZeroCalls %d", st, tc.wantCalls)
			}
		})
	}
}

// TestWriteZeroesCutsPendingTrim: zeroing is a write. A discard issued
// after it over the same range may leave anything there (NBD only promises
// zeros for WRITE_ZEROES), so a gathering trim must go around it.
func TestWriteZeroesCutsPendingTrim(t *testing.T) {
	eng := engine(time.Hour, 3)
	rg := memRig(t, eng, nil)
	trimmed := make(chan error, 1)
	go func() { trimmed <- rg.x.Trim(0, 2*segLen, false) }() // a: 0+segLen, b: 0+segLen
	waitRangesIn(t, eng, 2)
	if err := rg.x.WriteZeroes(4096, 8192, false, false, false); err != nil {
		t.Fatal(err)
	}
	if err := rg.x.Trim(10*segLen, segLen, false); err != nil { // third range: issue
		t.Fatal(err)
	}
	if err := nbdtest.Recv(t, trimmed, "the trim"); err != nil {
		t.Fatal(err)
	}
	want := []backing.Range{{Off: 0, Len: 4096}, {Off: 12288, Len: segLen - 12288}, {Off: 5 * segLen, Len: segLen}}
	if got := discards(rg.recs[0]); !slices.Equal(got, want) {
		t.Errorf("device a discards = %v, want %v", got, want)
	}
}

func TestObserve(t *testing.T) {
	eng := engine(0, 0)
	var mu sync.Mutex
	seen := map[string]int{}
	eng.Observe = func(device, op string, d time.Duration) {
		mu.Lock()
		defer mu.Unlock()
		seen[device+" "+op]++
		if d < 0 {
			t.Errorf("negative duration %v", d)
		}
	}
	rg := memRig(t, eng, nil)
	if err := rg.x.Trim(0, 4*segLen, false); err != nil {
		t.Fatal(err)
	}
	if err := rg.x.WriteZeroes(0, 2*segLen, true, false, false); err != nil {
		t.Fatal(err)
	}
	want := map[string]int{"a discard": 1, "b discard": 1, "a zero": 1, "b zero": 1}
	mu.Lock()
	defer mu.Unlock()
	for k, n := range want {
		if seen[k] != n {
			t.Errorf("Observe saw %q %d times, want %d (all: %v)", k, seen[k], n, seen)
		}
	}
}

// fastZero can refuse slow zeroing per call, as a remote NBD export with
// FAST_ZERO does (backing.FastZeroer); its Zero always works.
type fastZero struct {
	backing.Device
	refuse    bool
	fastCalls int
}

func (f *fastZero) ZeroFast(off, n int64, mayPunch bool) error {
	f.fastCalls++
	if f.refuse {
		return backing.ErrNotSupported
	}
	return f.Device.Zero(off, n, mayPunch)
}

// TestWriteZeroesFastZeroer: a FAST_ZERO request goes to a FastZeroer's
// ZeroFast; a refusal fails that request only (it is not remembered, and
// says nothing of zeroing without FAST_ZERO, which goes to Zero).
func TestWriteZeroesFastZeroer(t *testing.T) {
	eng := engine(0, 0)
	pool := &backing.Pool{}
	var recs [2]*backing.Recorder
	var fzs [2]*fastZero
	names := [2]string{"fa", "fb"}
	for i, name := range names {
		recs[i] = backing.NewRecorder(backing.NewMem(name, 4*segLen))
		fzs[i] = &fastZero{Device: recs[i], refuse: true}
		pool.Add(name, fzs[i])
	}
	var b strings.Builder
	s := segLen / table.SectorSize
	for i := range 8 {
		fmt.Fprintf(&b, "%d %d linear %s %d\n", i*s, s, names[i%2], i/2*s)
	}
	x := export(t, b.String(), pool, eng)
	if err := x.Write(bytes.Repeat([]byte{0xaa}, 8*segLen), 0, false); err != nil {
		t.Fatal(err)
	}
	for range 2 {
		if err := x.WriteZeroes(0, 4*segLen, true, true, false); !errors.Is(err, backing.ErrNotSupported) {
			t.Fatalf("refused fast zero: %v, want ErrNotSupported", err)
		}
	}
	if fzs[0].fastCalls != 2 {
		t.Fatalf("device a asked %d times, want 2: a refusal is not remembered", fzs[0].fastCalls)
	}
	if err := x.WriteZeroes(0, 4*segLen, true, false, false); err != nil {
		t.Fatalf("zero without FAST_ZERO after a refusal: %v", err)
	}
	if n := recs[0].Count(backing.OpZero); n != 1 {
		t.Fatalf("device a got %d native zero calls, want 1", n)
	}
	if err := x.Write(bytes.Repeat([]byte{0xbb}, 8*segLen), 0, false); err != nil {
		t.Fatal(err)
	}
	fzs[0].refuse, fzs[1].refuse = false, false
	if err := x.WriteZeroes(0, 4*segLen, true, true, false); err != nil {
		t.Fatalf("fast zero the device accepts: %v", err)
	}
	buf := make([]byte, 8*segLen)
	if _, err := x.Read(buf, 0); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(buf[:4*segLen], make([]byte, 4*segLen)) || !bytes.Equal(buf[4*segLen:], bytes.Repeat([]byte{0xbb}, 4*segLen)) {
		t.Fatal("fast zero did not zero exactly its range")
	}
}
