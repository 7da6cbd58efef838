package flush

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/nbdmapper/nbdmapper/backing"
	"github.com/nbdmapper/nbdmapper/internal/testing/fault"
	"github.com/nbdmapper/nbdmapper/internal/testing/golden"
	"github.com/nbdmapper/nbdmapper/internal/testing/nbdtest"
	"golang.org/x/sys/unix"
)

// disk is a tracked fault-injecting in-memory device: what reaches inner is
// what a crash would leave.
type disk struct {
	inner  *backing.Mem
	faulty *backing.Faulty
	dev    backing.Device // tracked by the engine
}

func newDisk(e *Engine, name string) *disk {
	inner := backing.NewMem(name, 1<<20)
	f := backing.NewFaulty(inner)
	return &disk{inner: inner, faulty: f, dev: e.Track(f)}
}

// hold makes the disk's syncs block until release is called; entered
// receives once per sync that reached the device.
func (d *disk) hold() (entered chan struct{}, release func()) {
	entered = make(chan struct{}, 1024)
	gate := make(chan struct{})
	d.faulty.BeforeSync(func() {
		entered <- struct{}{}
		<-gate
	})
	var once sync.Once
	return entered, func() { once.Do(func() { close(gate) }) }
}

func (d *disk) write(t testing.TB, off int64, b ...byte) {
	t.Helper()
	if _, err := d.dev.WriteAt(b, off); err != nil {
		t.Fatal(err)
	}
}

func devStats(e *Engine, name string) DeviceStats {
	for _, s := range e.Stats().Devices {
		if s.Name == name {
			return s
		}
	}
	return DeviceStats{}
}

// waitRequested waits until n flushes have registered with the device (the
// registration is what orders them), failing t if that takes longer than
// deadline.
func waitRequested(t testing.TB, e *Engine, name string, n uint64) {
	t.Helper()
	fault.WaitFor(t, fmt.Sprintf("%d flushes of %s", n, name), func() bool { return devStats(e, name).Requested >= n })
}

// TestPlanGolden drives scripted scenarios and records every plan, so that a
// change in what a flush decides shows up as a golden-file diff.
func TestPlanGolden(t *testing.T) {
	cases := []struct {
		name string
		run  func(t *testing.T, e *Engine, log func(label string, p Plan))
	}{
		{"clean devices are skipped", func(t *testing.T, e *Engine, log func(string, Plan)) {
			a, b := newDisk(e, "a.img"), newDisk(e, "b.img")
			devs := []backing.Device{a.dev, b.dev, a.dev}
			log("plan, nothing written", e.Plan(devs))
			p, err := e.FlushPlan(devs)
			if err != nil {
				t.Fatal(err)
			}
			log("flush", p)
		}},
		{"only the dirty device is synced", func(t *testing.T, e *Engine, log func(string, Plan)) {
			a, b := newDisk(e, "a.img"), newDisk(e, "b.img")
			a.write(t, 0, 1)
			a.write(t, 512, 2)
			devs := []backing.Device{a.dev, b.dev}
			log("plan after 2 writes to a", e.Plan(devs))
			p, err := e.FlushPlan(devs)
			if err != nil {
				t.Fatal(err)
			}
			log("flush", p)
			log("plan after the flush", e.Plan(devs))
			b.write(t, 0, 3)
			log("plan after a write to b", e.Plan(devs))
		}},
		{"group commit", func(t *testing.T, e *Engine, log func(string, Plan)) {
			a := newDisk(e, "a.img")
			devs := []backing.Device{a.dev}
			entered, release := a.hold()
			a.write(t, 0, 1)
			a.write(t, 1, 2)
			plans := make([]Plan, 5)
			var wg sync.WaitGroup
			flushAsync := func(i int) {
				wg.Add(1)
				go func() {
					defer wg.Done()
					p, err := e.FlushPlan(devs)
					if err != nil {
						t.Error(err)
					}
					plans[i] = p
				}()
			}
			flushAsync(0) // F1 starts S1
			nbdtest.Recv(t, entered, "a sync to reach the device")
			log("F2 arrives during S1, nothing new written", e.Plan(devs))
			flushAsync(1)
			waitRequested(t, e, "a.img", 2)
			a.write(t, 2, 3)
			log("F3 arrives after a write during S1", e.Plan(devs))
			flushAsync(2)
			waitRequested(t, e, "a.img", 3)
			log("F4 arrives too", e.Plan(devs))
			flushAsync(3)
			waitRequested(t, e, "a.img", 4)
			release()
			nbdtest.Wait(t, &wg, "the flushes")
			for i, p := range plans[:4] {
				log(fmt.Sprintf("F%d did", i+1), p)
			}
			log("F5 after all, nothing new written", e.Plan(devs))
			s := devStats(e, "a.img")
			if s.Syncs != 2 || s.Coalesced != 2 || a.faulty.Syncs() != 2 {
				t.Errorf("stats %+v, device saw %d syncs; want 2 syncs, 2 coalesced", s, a.faulty.Syncs())
			}
		}},
		{"untracked device", func(t *testing.T, e *Engine, log func(string, Plan)) {
			a := newDisk(e, "a.img")
			raw := backing.NewMem("raw.img", 4096)
			p, err := e.FlushPlan([]backing.Device{a.dev, raw})
			if err != nil {
				t.Fatal(err)
			}
			log("flush", p)
		}},
		{"failed sync is sticky", func(t *testing.T, e *Engine, log func(string, Plan)) {
			a, b := newDisk(e, "a.img"), newDisk(e, "b.img")
			devs := []backing.Device{a.dev, b.dev}
			a.write(t, 0, 1)
			b.write(t, 0, 1)
			a.faulty.FailSync(unix.EIO)
			p, err := e.FlushPlan(devs)
			if !errors.Is(err, unix.EIO) {
				t.Fatalf("flush with failing sync: %v, want EIO", err)
			}
			log("flush with a failing", p)
			a.faulty.FailSync(nil)
			p, err = e.FlushPlan(devs)
			if !errors.Is(err, ErrSyncFailed) || !errors.Is(err, unix.EIO) {
				t.Fatalf("flush after failed sync: %v, want ErrSyncFailed wrapping EIO", err)
			}
			log("next flush", p)
		}},
	}
	for _, tc := range cases {
		t.Run(strings.ReplaceAll(tc.name, " ", "_"), func(t *testing.T) {
			var out strings.Builder
			tc.run(t, New(), func(label string, p Plan) {
				fmt.Fprintf(&out, "# %s\n%s\n", label, p)
			})
			path := filepath.Join("testdata", strings.ReplaceAll(t.Name(), "/", "_")+".golden")
			golden.Check(t, path, out.String())
		})
	}
}

// N concurrent flushes of a clean device issue no sync.
func TestConcurrentFlushesCleanDevice(t *testing.T) {
	e := New()
	a, b := newDisk(e, "a.img"), newDisk(e, "b.img")
	const n = 64
	var wg sync.WaitGroup
	for range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := e.Flush([]backing.Device{a.dev, b.dev}); err != nil {
				t.Error(err)
			}
		}()
	}
	nbdtest.Wait(t, &wg, "the flushes")
	if a.faulty.Syncs()+b.faulty.Syncs() != 0 {
		t.Fatalf("clean devices saw %d+%d syncs, want 0", a.faulty.Syncs(), b.faulty.Syncs())
	}
	s := e.Stats()
	if s.Flushes != n || s.Devices[0].SkippedClean != n || s.Devices[1].Requested != n {
		t.Fatalf("stats %+v, want %d flushes all skipped clean", s, n)
	}
}

// Flushes that arrive during a sync share at most one more sync, however
// many there are and however many writes land meanwhile.
func TestConcurrentFlushesDuringSync(t *testing.T) {
	cases := []struct {
		name         string
		writeDuring  bool // a write completes during the first sync
		wantSyncs    int
		wantCoalesce uint64
	}{
		{"no write during sync: all join the running sync", false, 1, 32},
		{"write during sync: all share one more sync", true, 2, 31},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			e := New()
			a := newDisk(e, "a.img")
			entered, release := a.hold()
			a.write(t, 0, 1)
			first := make(chan error)
			go func() { first <- e.Flush([]backing.Device{a.dev}) }()
			nbdtest.Recv(t, entered, "a sync to reach the device")
			if tc.writeDuring {
				a.write(t, 1, 2)
			}
			var wg sync.WaitGroup
			for i := range 32 {
				wg.Add(1)
				go func() {
					defer wg.Done()
					if i%2 == 0 {
						_ = a.dev.Sync() // a direct Sync is a flush too
						return
					}
					if err := e.Flush([]backing.Device{a.dev}); err != nil {
						t.Error(err)
					}
				}()
			}
			waitRequested(t, e, "a.img", 33)
			release()
			if err := nbdtest.Recv(t, first, "the first flush"); err != nil {
				t.Fatal(err)
			}
			nbdtest.Wait(t, &wg, "the flushes")
			if got := a.faulty.Syncs(); got != tc.wantSyncs {
				t.Errorf("device saw %d syncs, want %d", got, tc.wantSyncs)
			}
			s := devStats(e, "a.img")
			if s.Coalesced != tc.wantCoalesce || s.Dirty || a.faulty.Pending() != 0 {
				t.Errorf("stats %+v, pending %d; want %d coalesced, clean", s, a.faulty.Pending(), tc.wantCoalesce)
			}
		})
	}
}

// A write that completes while a sync runs keeps the device dirty.
func TestWriteDuringSyncStaysDirty(t *testing.T) {
	e := New()
	a := newDisk(e, "a.img")
	entered, release := a.hold()
	a.write(t, 0, 1)
	done := make(chan error)
	go func() { done <- e.Flush([]backing.Device{a.dev}) }()
	nbdtest.Recv(t, entered, "a sync to reach the device")
	a.write(t, 1, 2)
	release()
	if err := nbdtest.Recv(t, done, "the flush"); err != nil {
		t.Fatal(err)
	}
	if !devStats(e, "a.img").Dirty {
		t.Fatal("device clean after a write landed during its sync")
	}
	if p := e.Plan([]backing.Device{a.dev}); p.Entries[0].Action != Sync {
		t.Fatalf("next plan %v, want sync", p)
	}
	if err := e.Flush([]backing.Device{a.dev}); err != nil {
		t.Fatal(err)
	}
	a.faulty.Crash()
	got := make([]byte, 2)
	a.inner.ReadAt(got, 0)
	if !bytes.Equal(got, []byte{1, 2}) {
		t.Fatalf("after crash %v, want [1 2]", got)
	}
}

// TestRandomDurability runs writers on several devices, each owning a slot
// of every device, flushing at random; after each flush the slot's last
// value must already be on the inner device, i.e. survive a crash.
func TestRandomDurability(t *testing.T) {
	e := New()
	var syncs atomic.Int64
	e.Observe = func(string, time.Duration) { syncs.Add(1) }
	disks := []*disk{newDisk(e, "a.img"), newDisk(e, "b.img"), newDisk(e, "c.img")}
	devs := []backing.Device{disks[0].dev, disks[1].dev, disks[2].dev}
	const workers, rounds = 8, 150
	var wg sync.WaitGroup
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			seed := uint32(w*7919 + 1)
			next := func() uint32 { seed ^= seed << 13; seed ^= seed >> 17; seed ^= seed << 5; return seed }
			last := make([]uint32, len(disks))
			for r := range rounds {
				d := int(next() % uint32(len(disks)))
				v := uint32(w<<16 | r + 1)
				var buf [4]byte
				binary.LittleEndian.PutUint32(buf[:], v)
				if _, err := disks[d].dev.WriteAt(buf[:], int64(w)*512); err != nil {
					t.Error(err)
					return
				}
				last[d] = v
				if next()%3 != 0 {
					continue
				}
				// Flush a random subset (FUA-like) or everything.
				sub := devs
				if next()%2 == 0 {
					sub = []backing.Device{devs[d]}
				}
				if err := e.Flush(sub); err != nil {
					t.Error(err)
					return
				}
				for i, dk := range disks {
					if !contains(sub, dk.dev) {
						continue
					}
					dk.inner.ReadAt(buf[:], int64(w)*512)
					if got := binary.LittleEndian.Uint32(buf[:]); got != last[i] {
						t.Errorf("worker %d: %s slot holds %#x after flush, want %#x", w, dk.inner.Name(), got, last[i])
						return
					}
				}
			}
		}()
	}
	nbdtest.Wait(t, &wg, "the flushes")
	s := e.Stats()
	var total uint64
	for _, d := range s.Devices {
		total += d.Syncs
	}
	if total != uint64(syncs.Load()) || total == 0 {
		t.Fatalf("stats count %d syncs, Observe saw %d", total, syncs.Load())
	}
	var real int
	for _, d := range disks {
		real += d.faulty.Syncs()
	}
	if uint64(real) != total {
		t.Fatalf("devices saw %d syncs, stats say %d", real, total)
	}
	t.Logf("%d flushes, %d syncs: %+v", s.Flushes, total, s.Devices)
}

func contains(devs []backing.Device, d backing.Device) bool {
	for _, x := range devs {
		if x == d {
			return true
		}
	}
	return false
}

func TestSyncEachIsUnconditional(t *testing.T) {
	e := New()
	a := newDisk(e, "a.img")
	if err := e.SyncEach([]backing.Device{a.dev, a.dev, a.dev}); err != nil {
		t.Fatal(err)
	}
	if a.faulty.Syncs() != 3 || devStats(e, "a.img").Syncs != 3 {
		t.Fatalf("device saw %d syncs, stats %+v; want 3", a.faulty.Syncs(), devStats(e, "a.img"))
	}
}

func TestTrackOnce(t *testing.T) {
	e := New()
	m := backing.NewMem("m", 4096)
	w := e.Track(m)
	if e.Track(m) != w || e.Track(w) != w {
		t.Fatal("tracking the same device twice gave two wrappers")
	}
	if len(e.Stats().Devices) != 1 {
		t.Fatalf("%d tracked devices, want 1", len(e.Stats().Devices))
	}
	// Discard and Zero dirty the device like writes do.
	for name, op := range map[string]func() error{
		"discard": func() error { return w.Discard(0, 4096) },
		"zero":    func() error { return w.Zero(0, 4096, false) },
	} {
		if err := op(); err != nil {
			t.Fatal(err)
		}
		if !devStats(e, "m").Dirty {
			t.Fatalf("%s left the device clean", name)
		}
		if err := w.Sync(); err != nil {
			t.Fatal(err)
		}
		if devStats(e, "m").Dirty {
			t.Fatalf("sync after %s left the device dirty", name)
		}
	}
}

// Closing a tracked device ends its tracking: the engine keeps nothing of
// it, and tracking the device again starts afresh. A flush through the
// closed wrapper (a mapped device keeps the devices whose suspend flush
// failed, to fail every later flush) still gets its sticky error, without
// a call on the closed device.
func TestCloseUntracks(t *testing.T) {
	e := New()
	ok, failing := newDisk(e, "ok"), newDisk(e, "failing")
	ok.write(t, 0, 1)
	failing.write(t, 0, 1)
	failing.faulty.FailSync(syscall.EIO)
	if err := e.Flush([]backing.Device{ok.dev, failing.dev}); !errors.Is(err, syscall.EIO) {
		t.Fatalf("flush: %v, want EIO", err)
	}
	for _, d := range []*disk{ok, failing} {
		if err := d.dev.Close(); err != nil {
			t.Fatal(err)
		}
	}
	if got := e.Stats().Devices; len(got) != 0 {
		t.Fatalf("after Close the engine still tracks %d devices", len(got))
	}
	syncs := failing.faulty.Syncs()
	if err := e.Flush([]backing.Device{ok.dev, failing.dev}); !errors.Is(err, ErrSyncFailed) {
		t.Errorf("a flush through the closed wrappers: %v, want the failed one's ErrSyncFailed", err)
	}
	if n := failing.faulty.Syncs(); n != syncs {
		t.Errorf("the flush reached the closed device: %d syncs, want %d", n, syncs)
	}
	again := e.Track(ok.faulty)
	if again == ok.dev || len(e.Stats().Devices) != 1 || devStats(e, "ok").Dirty {
		t.Errorf("tracking the device again: a new wrapper %v, %d tracked, dirty %v; want a new clean one",
			again != ok.dev, len(e.Stats().Devices), devStats(e, "ok").Dirty)
	}
}

// A discard or zeroing that a hole map answers without the device, over
// holes it knows, still dirties the device, so that the flush after it
// syncs: the hole may come from a punch not synced yet.
func TestSkippedDiscardDirties(t *testing.T) {
	e := New()
	f := backing.NewFaulty(backing.NewMem("m", 1<<20))
	h := backing.NewHoleMap(f)
	w := e.Track(h)
	if holes, err := h.Holes(0, 1<<20); err != nil || len(holes) != 1 {
		t.Fatalf("holes of a fresh Mem: %v, %v", holes, err)
	}
	for i, op := range []func() error{
		func() error { return w.Discard(0, 4096) },
		func() error { return w.Zero(0, 4096, true) },
	} {
		if err := op(); err != nil {
			t.Fatal(err)
		}
		if st := h.Stats(); st.Skipped != uint64(i+1) {
			t.Fatalf("op %d: hole map stats %+v, want it skipped", i, st)
		}
		if !devStats(e, "m").Dirty {
			t.Fatalf("op %d, skipped by the hole map, left the device clean", i)
		}
		if err := w.Sync(); err != nil {
			t.Fatal(err)
		}
		if f.Syncs() != i+1 {
			t.Fatalf("op %d: the device saw %d syncs, want %d", i, f.Syncs(), i+1)
		}
	}
}

// noDSync hides a device's WriteAtDSync, forcing WriteFUA's write+flush path.
type noDSync struct{ backing.Device }

func TestWriteFUASurvivesCrash(t *testing.T) {
	cases := []struct {
		name      string
		wrap      func(*backing.Faulty) backing.Device
		wantSyncs uint64 // syncs the engine issued
	}{
		{"dsync device", func(f *backing.Faulty) backing.Device { return f }, 0},
		{"write then flush", func(f *backing.Faulty) backing.Device { return noDSync{f} }, 1},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			e := New()
			inner := backing.NewMem("a.img", 1<<16)
			f := backing.NewFaulty(inner)
			d := e.Track(tc.wrap(f))
			if err := e.WriteFUA(d, []byte{1, 2, 3}, 100); err != nil {
				t.Fatal(err)
			}
			f.Crash()
			got := make([]byte, 3)
			inner.ReadAt(got, 100)
			if !bytes.Equal(got, []byte{1, 2, 3}) {
				t.Fatalf("after crash %v, want [1 2 3]", got)
			}
			if s := devStats(e, "a.img"); s.Syncs != tc.wantSyncs || s.Dirty {
				t.Fatalf("stats %+v, want %d syncs and clean", s, tc.wantSyncs)
			}
		})
	}
}

// fastZero is a device that can refuse slow zeroing, as a remote NBD
// export with FAST_ZERO does: refuse decides per call.
type fastZero struct {
	backing.Device
	refuse bool
	calls  int
}

func (f *fastZero) ZeroFast(off, n int64, mayPunch bool) error {
	f.calls++
	if f.refuse {
		return backing.ErrNotSupported
	}
	return f.Zero(off, n, mayPunch)
}

// TestTrackFastZeroer: a device that refuses slow zeroing keeps ZeroFast
// through the engine's wrapper, which dirties the device like Zero; a
// device without it gets a wrapper without it.
func TestTrackFastZeroer(t *testing.T) {
	e := New()
	fz := &fastZero{Device: backing.NewMem("fz", 4096)}
	w := e.Track(fz)
	z, ok := w.(backing.FastZeroer)
	if !ok {
		t.Fatal("the wrapper of a FastZeroer hides ZeroFast")
	}
	if e.Track(fz) != w || e.Track(w) != w {
		t.Fatal("tracking the same device twice gave two wrappers")
	}
	if err := z.ZeroFast(0, 4096, true); err != nil || fz.calls != 1 {
		t.Fatalf("ZeroFast: %v, %d calls", err, fz.calls)
	}
	if !devStats(e, "fz").Dirty {
		t.Fatal("ZeroFast left the device clean")
	}
	if err := e.Flush([]backing.Device{w}); err != nil || devStats(e, "fz").Dirty || devStats(e, "fz").Syncs != 1 {
		t.Fatalf("flush after ZeroFast: %v, %+v", err, devStats(e, "fz"))
	}
	if _, ok := e.Track(backing.NewMem("plain", 4096)).(backing.FastZeroer); ok {
		t.Fatal("a device without ZeroFast got a wrapper with it")
	}
}
