package mapped_test

import (
	"bytes"
	"errors"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/nbdmapper/nbdmapper/backing"
	"github.com/nbdmapper/nbdmapper/discard"
	"github.com/nbdmapper/nbdmapper/flush"
	"github.com/nbdmapper/nbdmapper/mapped"
	"github.com/nbdmapper/nbdmapper/table"
)

// wait fails the test if ch does not deliver within a bound that only
// turns a hang into a failure.
func wait[T any](t *testing.T, what string, ch <-chan T) T {
	t.Helper()
	select {
	case v := <-ch:
		return v
	case <-time.After(60 * time.Second):
		t.Fatalf("gave up waiting for %s", what)
	}
	panic("unreachable")
}

// until polls cond with the same bound.
func until(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("gave up waiting for %s", what)
		}
		time.Sleep(time.Millisecond)
	}
}

func mustParse(t *testing.T, text string, devs memOpener) *table.Table {
	t.Helper()
	tb, err := table.Parse("t.table", strings.NewReader(text), devs)
	if err != nil {
		t.Fatal(err)
	}
	return tb
}

// gate blocks reads until released, to hold a request in flight.
type gate struct {
	backing.Device
	entered chan struct{}
	release chan struct{}
	once    sync.Once
}

func (g *gate) ReadAt(p []byte, off int64) (int, error) {
	g.once.Do(func() { close(g.entered) })
	<-g.release
	return g.Device.ReadAt(p, off)
}

// TestSuspendDrainsHoldsAndResumes: suspend waits for the request in
// flight, flushes the devices below, and holds new requests (they wait,
// they do not fail) until resume.
func TestSuspendDrainsHoldsAndResumes(t *testing.T) {
	rec := backing.NewRecorder(backing.NewMem("m", 1<<20))
	g := &gate{Device: rec, entered: make(chan struct{}), release: make(chan struct{})}
	d := mapped.New("d", mustParse(t, "0 2048 linear m 0\n", memOpener{"m": g}), flush.New(), discard.New())

	read := make(chan error, 1)
	go func() { _, err := d.Read(make([]byte, 512), 0); read <- err }()
	<-g.entered
	suspended := make(chan error, 1)
	go func() { suspended <- d.Suspend() }()
	until(t, "suspend to start holding", func() bool { return d.Info().InFlight == 1 })
	select {
	case <-suspended:
		t.Fatal("suspend returned with a request in flight")
	case <-time.After(10 * time.Millisecond):
	}
	close(g.release)
	if err := wait(t, "the read in flight", read); err != nil {
		t.Fatal(err)
	}
	if err := wait(t, "suspend", suspended); err != nil {
		t.Fatal(err)
	}
	if n := rec.Count(backing.OpSync); n != 1 {
		t.Fatalf("suspend synced the device %d times, want 1", n)
	}

	wrote := make(chan error, 1)
	go func() { wrote <- d.Write([]byte("held"), 4096, false) }()
	until(t, "the write to be held", func() bool { return d.Info().Held == 1 })
	if n := rec.Count(backing.OpWrite); n != 0 {
		t.Fatalf("a write reached the device while suspended")
	}
	if swapped, err := d.Resume(); err != nil || swapped {
		t.Fatalf("resume: swapped %v, %v", swapped, err)
	}
	if err := wait(t, "the held write", wrote); err != nil {
		t.Fatal(err)
	}
	in := d.Info()
	if in.Suspended || in.Suspends != 1 || in.Resumes != 1 || in.Held != 1 {
		t.Fatalf("info %+v", in)
	}
}

// TestReloadAndResize: a loaded table stays inactive until resume, which
// swaps it in; a shrink fails requests past the new end with ErrBeyondEnd.
func TestReloadAndResize(t *testing.T) {
	a, b := backing.NewMem("a", 1<<20), backing.NewMem("b", 1<<20)
	a.WriteAt(bytes.Repeat([]byte{'a'}, 1<<20), 0)
	b.WriteAt(bytes.Repeat([]byte{'b'}, 1<<20), 0)
	devs := memOpener{"a": a, "b": b}
	d := mapped.New("d", mustParse(t, "0 2048 linear a 0\n", devs), flush.New(), discard.New())
	read := func(off int64) byte {
		t.Helper()
		p := make([]byte, 1)
		if _, err := d.Read(p, off); err != nil {
			t.Fatal(err)
		}
		return p[0]
	}
	d.Load(mustParse(t, "0 1024 linear b 0\n", devs))
	if got := read(0); got != 'a' || d.Size() != 1<<20 || !d.Info().InactiveTable {
		t.Fatalf("before resume: read %q, size %d, info %+v", got, d.Size(), d.Info())
	}
	if swapped, err := d.Resume(); err != nil || !swapped {
		t.Fatalf("resume: swapped %v, %v", swapped, err)
	}
	if got := read(0); got != 'b' || d.Size() != 512<<10 {
		t.Fatalf("after resume: read %q, size %d", got, d.Size())
	}
	if _, err := d.Read(make([]byte, 512), 600<<10); !errors.Is(err, mapped.ErrBeyondEnd) {
		t.Fatalf("read past the new end: %v", err)
	}
	if err := d.Write(make([]byte, 512), 600<<10, false); !errors.Is(err, mapped.ErrBeyondEnd) {
		t.Fatalf("write past the new end: %v", err)
	}
	// Growing back by appending a segment.
	d.Load(mustParse(t, "0 1024 linear b 0\n1024 1024 linear a 1024\n", devs))
	d.Resume()
	if got := read(600 << 10); got != 'a' || d.Size() != 1<<20 {
		t.Fatalf("after growing: read %q, size %d", got, d.Size())
	}
	if in := d.Info(); in.Reloads != 2 || in.Suspends != 2 || in.InactiveTable {
		t.Fatalf("info %+v", in)
	}
}

// TestSuspendBelowHoldsAbove: a device stacked on a suspended one waits for
// it, as dm's stacked devices do.
func TestSuspendBelowHoldsAbove(t *testing.T) {
	disk := backing.NewMem("disk", 1<<20)
	mds := parseSet(t, memOpener{"disk": disk}, "top=0 1024 linear /dev/mapper/base 1024", "base=0 2048 linear disk 0")
	top, base := mds[0], mds[1]
	if err := base.Suspend(); err != nil {
		t.Fatal(err)
	}
	wrote := make(chan error, 1)
	go func() { wrote <- top.Write([]byte("stacked"), 0, false) }()
	until(t, "the write to wait below", func() bool { return base.Info().Held == 1 })
	base.Resume()
	if err := wait(t, "the stacked write", wrote); err != nil {
		t.Fatal(err)
	}
	p := make([]byte, 7)
	disk.ReadAt(p, 1024*512)
	if string(p) != "stacked" {
		t.Fatalf("disk holds %q", p)
	}
}

// A table loaded while Resume runs is swapped in only on a suspended
// device: Load takes no part in the suspend cycle, and a Resume that saw
// no table to swap, suspended nothing, and then found one would have
// swapped it under requests in flight on the old table.
func TestResumeRacingLoadSuspends(t *testing.T) {
	a := backing.NewMem("a", 1<<20)
	devs := memOpener{"a": a}
	d := mapped.New("d", mustParse(t, "0 2048 linear a 0\n", devs), flush.New(), discard.New())
	for i := range 5000 {
		tb := mustParse(t, "0 2048 linear a 0\n", devs)
		before := d.Info().Suspends
		var wg sync.WaitGroup
		var swapped bool
		var err error
		start := make(chan struct{})
		wg.Add(2)
		go func() { defer wg.Done(); <-start; swapped, err = d.Resume() }()
		go func() { defer wg.Done(); <-start; d.Load(tb) }()
		close(start)
		wg.Wait()
		if err != nil {
			t.Fatal(err)
		}
		if swapped && d.Info().Suspends == before {
			t.Fatalf("iteration %d: Resume swapped a table in without suspending the device", i)
		}
		if d.InactiveTable() != nil {
			if _, err := d.Resume(); err != nil {
				t.Fatal(err)
			}
		}
	}
}

// A suspend whose flush failed leaves the writes acknowledged on the old
// table's devices in doubt; a resume that swaps the table anyway keeps
// those devices in every later flush, which then fails, as it would have
// had the table stayed.
func TestFailedSuspendFlushOutlivesReload(t *testing.T) {
	f := flush.New()
	x := backing.NewFaulty(backing.NewMem("x", 1<<20))
	devs := memOpener{"x": f.Track(x), "y": f.Track(backing.NewMem("y", 1<<20))}
	d := mapped.New("d", mustParse(t, "0 2048 linear x 0\n", devs), f, discard.New())
	if err := d.Write([]byte("acknowledged"), 0, false); err != nil {
		t.Fatal(err)
	}
	d.Load(mustParse(t, "0 2048 linear y 0\n", devs))
	x.FailSync(syscall.EIO)
	if _, err := d.Resume(); err == nil {
		t.Fatal("a resume whose suspend could not flush the old table succeeded")
	}
	if swapped, err := d.Resume(); !swapped || err != nil {
		t.Fatalf("second resume: swapped %v, %v", swapped, err)
	}
	for range 2 {
		if err := d.Flush(); !errors.Is(err, flush.ErrSyncFailed) {
			t.Fatalf("a flush after the reload: %v, want %v: a write acknowledged through the old table may be lost (%d writes a crash would lose)", err, flush.ErrSyncFailed, x.Crash())
		}
	}
}

// A suspend whose flush failed has not made the device's writes durable;
// suspending again retries the flush rather than reporting success because
// the device is already suspended.
func TestRetriedSuspendRetriesFlush(t *testing.T) {
	f := flush.New()
	x := backing.NewFaulty(backing.NewMem("x", 1<<20))
	d := mapped.New("d", mustParse(t, "0 2048 linear x 0\n", memOpener{"x": f.Track(x)}), f, discard.New())
	defer d.Close()
	if err := d.Write([]byte("acknowledged"), 0, false); err != nil {
		t.Fatal(err)
	}
	x.FailSync(syscall.EIO)
	if err := d.Suspend(); err == nil {
		t.Fatal("a suspend whose flush failed succeeded")
	}
	if err := d.Suspend(); err == nil {
		t.Fatalf("a retried suspend succeeded with its flush failing (%d writes a crash would lose)", x.Crash())
	}
	if !d.Info().Suspended {
		t.Fatal("the device resumed by itself")
	}
}
