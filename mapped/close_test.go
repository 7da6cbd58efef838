package mapped_test

import (
	"errors"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/nbdmapper/nbdmapper/backing"
	"github.com/nbdmapper/nbdmapper/discard"
	"github.com/nbdmapper/nbdmapper/flush"
	"github.com/nbdmapper/nbdmapper/mapped"
	"github.com/nbdmapper/nbdmapper/table"
)

// poll waits for cond, checking it every millisecond. It sets no bound of
// its own: a hang is go test's -timeout to report, with every stack.
func poll(cond func() bool) {
	for !cond() {
		time.Sleep(time.Millisecond)
	}
}

// parked reports whether some goroutine is blocked as state says (the
// wait reason in its stack's header, "sync.Mutex.Lock") inside fn.
func parked(state, fn string) bool {
	buf := make([]byte, 1<<20)
	buf = buf[:runtime.Stack(buf, true)]
	for _, g := range strings.Split(string(buf), "\n\n") {
		if strings.Contains(g, "["+state) && strings.Contains(g, fn+"(") {
			return true
		}
	}
	return false
}

// A Close that comes while a Resume activates the new table waits for it:
// otherwise the activation goes on after Close returned, on the table
// Close closed. Here that table's snapshot-merge line takes a snapshot's
// store over (lvconvert --merge) into the closed device and starts its
// merge there, and the COW stays claimed by the closed device for good: no
// table can merge it again.
func TestCloseWaitsForResume(t *testing.T) {
	g := &gate{Device: backing.NewMem("o", 1<<20), entered: make(chan struct{}), release: make(chan struct{})}
	devs := memOpener{"o": g, "c": backing.NewMem("c", 1<<20)}
	f, dc := flush.New(), discard.New()
	snap := mapped.New("snap", mustParse(t, "0 2048 snapshot o c P 8\n", devs), f, dc)
	defer snap.Close()
	d := mapped.New("d", mustParse(t, "0 2048 snapshot-origin o\n", devs), f, dc)
	d.Load(mustParse(t, "0 2048 snapshot-merge o c P 8\n", devs))

	// A read of the snapshot in flight holds the handover up.
	read := make(chan error, 1)
	go func() { _, err := snap.Read(make([]byte, 512), 0); read <- err }()
	<-g.entered
	resumed := make(chan error, 1)
	go func() { _, err := d.Resume(); resumed <- err }()
	poll(func() bool { return strings.Contains(snap.Table().Status(), "Invalid") }) // the handover has begun
	closed := make(chan error, 1)
	go func() { closed <- d.Close() }()
	// Let the read go on once Close has returned, or waits for the Resume.
	closeReturned := false
	poll(func() bool {
		select {
		case err := <-closed:
			closed <- err
			closeReturned = true
			return true
		default:
			return parked("sync.Mutex.Lock", "mapped.(*Device).Close")
		}
	})
	close(g.release)
	if err := <-read; err != nil {
		t.Fatal(err)
	}
	if err := <-resumed; err != nil {
		t.Fatal(err)
	}
	if err := <-closed; err != nil {
		t.Fatal(err)
	}
	again, err := table.Parse("again.table", strings.NewReader("0 2048 snapshot-merge o c P 8\n"), devs)
	if err != nil {
		t.Fatalf("Close returned before the Resume it raced: %v; after both, the COW cannot be merged again: %v", closeReturned, err)
	}
	again.Close()
}

// A closed device takes no more part in the suspend cycle: a table loaded
// into it is closed rather than held, which would keep its COW claimed,
// and suspends and resumes fail rather than flush the devices below or
// activate a closed table.
func TestClosedDeviceRefusesTheCycle(t *testing.T) {
	devs := memOpener{"o": backing.NewMem("o", 1<<20), "c": backing.NewMem("c", 1<<20)}
	d := mapped.New("d", mustParse(t, "0 2048 snapshot-origin o\n", devs), flush.New(), discard.New())
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	d.Load(mustParse(t, "0 2048 snapshot-merge o c P 8\n", devs))
	again, err := table.Parse("again.table", strings.NewReader("0 2048 snapshot-merge o c P 8\n"), devs)
	if err != nil {
		t.Fatalf("a table loaded into a closed device keeps its COW claimed: %v", err)
	}
	again.Close()
	if err := d.Suspend(); !errors.Is(err, mapped.ErrClosed) {
		t.Fatalf("suspend of a closed device: %v, want %v", err, mapped.ErrClosed)
	}
	if _, err := d.Resume(); !errors.Is(err, mapped.ErrClosed) {
		t.Fatalf("resume of a closed device: %v, want %v", err, mapped.ErrClosed)
	}
}

// Close waits for a suspend in progress, but not for the requests in
// flight that the suspend waits for: they may never end (held by a
// suspended device below, as here by a gate). The suspend gives up.
func TestCloseDoesNotWaitForRequestsInFlight(t *testing.T) {
	g := &gate{Device: backing.NewMem("m", 1<<20), entered: make(chan struct{}), release: make(chan struct{})}
	d := mapped.New("d", mustParse(t, "0 2048 linear m 0\n", memOpener{"m": g}), flush.New(), discard.New())
	read := make(chan error, 1)
	go func() { _, err := d.Read(make([]byte, 512), 0); read <- err }()
	<-g.entered
	suspended := make(chan error, 1)
	go func() { suspended <- d.Suspend() }()
	poll(func() bool { return parked("sync.Cond.Wait", "mapped.(*Device).suspend") })
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	if err := <-suspended; !errors.Is(err, mapped.ErrClosed) {
		t.Fatalf("suspend interrupted by Close: %v, want %v", err, mapped.ErrClosed)
	}
	close(g.release)
	if err := <-read; err != nil {
		t.Fatal(err)
	}
}
