package remote

import (
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nbdmapper/nbdmapper/backing"
	"github.com/nbdmapper/nbdmapper/flush"
	"github.com/nbdmapper/nbdmapper/internal/testing/nbdtest"
)

// TestRetryAfterRestart kills the remote while a write is in flight on it
// (nbdkit's delay filter holds each write 300 ms), restarts it, and checks
// that the write was sent again and succeeded. Every acknowledged write
// had been flushed when the connection dropped, so flushes go on working.
func TestRetryAfterRestart(t *testing.T) {
	dir := shortDir(t)
	file := sparseFile(t, dir, "f", 4*mib)
	k := startNbdkit(t, dir, "k", "--filter=delay", "file", file, "delay-write=300ms")
	d := openURI(t, k.URI(""), testOptions(t))

	if _, err := d.WriteAt(pattern(64<<10, 1), 0); err != nil {
		t.Fatal(err)
	}
	if err := d.Sync(); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() {
		_, err := d.WriteAt(pattern(64<<10, 2), 1*mib)
		done <- err
	}()
	nbdtest.Until(t, "the write to reach nbdkit", func() bool { return k.Count("Write") == 2 })
	k.Kill()
	nbdtest.Until(t, "every connection's loss to be seen", func() bool { return d.Stats().State == StateDown })
	if st := d.Stats(); st.Lost {
		t.Fatalf("after the kill: %+v; want down, nothing lost (all was flushed)", st)
	}
	k.Start()
	if err := nbdtest.Recv(t, done, "the retried write"); err != nil {
		t.Fatalf("write across a restart: %v", err)
	}
	st := d.Stats()
	if st.Retries < 1 || st.Reconnects < 1 || st.State != StateUp || st.Lost {
		t.Fatalf("stats %+v; want a retry, a reconnection, up, nothing lost", st)
	}
	if err := d.Sync(); err != nil {
		t.Fatalf("flush after a clean reconnection: %v", err)
	}
	mustEqual(t, "the retried write on the server's file", readFile(t, file, 1*mib, 64<<10), pattern(64<<10, 2))
}

// TestLostWritesFailFlushes: writes acknowledged and not flushed when the
// remote dies may be gone, so the next flush fails, and every one after
// it, through the flush engine too; reads and writes go on.
func TestLostWritesFailFlushes(t *testing.T) {
	dir := shortDir(t)
	file := sparseFile(t, dir, "f", 4*mib)
	k := startNbdkit(t, dir, "k", "file", file)
	f := flush.New()
	d := openURI(t, k.URI(""), testOptions(t))
	dev := f.Track(d)

	if _, err := dev.WriteAt(pattern(4096, 1), 0); err != nil {
		t.Fatal(err)
	}
	if err := f.Flush([]backing.Device{dev}); err != nil {
		t.Fatal(err)
	}
	if _, err := dev.WriteAt(pattern(4096, 2), 8192); err != nil { // acknowledged, not flushed
		t.Fatal(err)
	}
	flushes := k.Count("Flush")
	k.Kill()
	k.Start()
	nbdtest.Until(t, "the reconnection", func() bool { return d.Stats().Reconnects > 0 })
	if st := d.Stats(); !st.Lost || st.Unflushed != 1 {
		t.Fatalf("stats %+v; want lost, 1 unflushed", st)
	}
	// Writes and reads work again.
	if _, err := dev.WriteAt(pattern(4096, 3), 16384); err != nil {
		t.Fatal(err)
	}
	back := make([]byte, 4096)
	if _, err := dev.ReadAt(back, 16384); err != nil {
		t.Fatal(err)
	}
	mustEqual(t, "read after the restart", back, pattern(4096, 3))
	// Flushes do not, and never will.
	for i := range 3 {
		err := f.Flush([]backing.Device{dev})
		if !errors.Is(err, ErrUnflushedLost) {
			t.Fatalf("flush %d after losing unflushed writes: %v, want ErrUnflushedLost", i, err)
		}
		if i > 0 && !errors.Is(err, flush.ErrSyncFailed) {
			t.Fatalf("flush %d: %v, want the engine's sticky ErrSyncFailed", i, err)
		}
	}
	if n := k.Count("Flush") - flushes; n != 0 {
		t.Fatalf("%d flushes reached the restarted remote; a flush over the gap must not be sent", n)
	}
}

// TestDeadline: with the remote gone for good, requests fail with
// ErrTimeout at their deadline, and work again once it is back.
func TestDeadline(t *testing.T) {
	dir := shortDir(t)
	k := startNbdkit(t, dir, "k", "file", sparseFile(t, dir, "f", 4*mib))
	opts := testOptions(t)
	opts.Timeout = 300 * time.Millisecond
	d := openURI(t, k.URI(""), opts)
	k.Kill()
	b := make([]byte, 4096)
	if _, err := d.ReadAt(b, 0); !errors.Is(err, ErrTimeout) {
		t.Fatalf("read with the remote gone: %v, want ErrTimeout", err)
	}
	if err := d.Sync(); !errors.Is(err, ErrTimeout) {
		t.Fatalf("flush with the remote gone: %v, want ErrTimeout", err)
	}
	if st := d.Stats(); st.Timeouts != 2 || st.State != StateDown || st.DialErrors == 0 {
		t.Fatalf("stats %+v; want 2 timeouts, down, failed reconnections", st)
	}
	k.Start()
	nbdtest.Until(t, "the reconnection", func() bool { return d.Stats().State == StateUp })
	if _, err := d.ReadAt(b, 0); err != nil {
		t.Fatal(err)
	}
}

// TestHungRemote: a remote that stops answering (nbdkit's delay filter
// holding reads for a minute) fails the request at its deadline, and the
// connection is dropped and made again; other requests go on.
func TestHungRemote(t *testing.T) {
	dir := shortDir(t)
	k := startNbdkit(t, dir, "k", "--filter=delay", "file", sparseFile(t, dir, "f", 4*mib), "delay-read=60")
	opts := testOptions(t)
	opts.Timeout = 300 * time.Millisecond
	opts.Connections = 1
	d := openURI(t, k.URI(""), opts)
	b := make([]byte, 4096)
	if _, err := d.ReadAt(b, 0); !errors.Is(err, ErrTimeout) {
		t.Fatalf("read from a hung remote: %v, want ErrTimeout", err)
	}
	nbdtest.Until(t, "the hung connection to be replaced", func() bool {
		st := d.Stats()
		return st.Drops >= 1 && st.Reconnects >= 1 && st.State == StateUp
	})
	if _, err := d.WriteAt(b, 0); err != nil {
		t.Fatalf("write after the hung read: %v", err)
	}
}

// TestChurn: sixteen writers on four connections while the remote is
// killed and restarted three times. Every write succeeds (sent again as
// needed), every byte reads back, and the flush after the churn fails:
// writes were acknowledged and unflushed when connections dropped.
func TestChurn(t *testing.T) {
	dir := shortDir(t)
	const size = 8 * mib
	file := sparseFile(t, dir, "f", size)
	k := startNbdkit(t, dir, "k", "file", file)
	d := openURI(t, k.URI(""), testOptions(t))
	const writers, each = 16, 200
	var wg sync.WaitGroup
	errs := make(chan error, writers)
	for w := range writers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range each {
				off := int64(w)*size/writers + int64(i%8)*4096
				if _, err := d.WriteAt(pattern(4096, byte(w+i)), off); err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	for range 3 {
		before := d.Stats().Requests["write"]
		nbdtest.Until(t, "writes to flow", func() bool { return d.Stats().Requests["write"] > before+50 })
		k.Kill()
		k.Start()
	}
	nbdtest.Wait(t, &wg, "the writers")
	close(errs)
	for err := range errs {
		t.Fatalf("a write failed across restarts: %v", err)
	}
	for w := range writers {
		for slot := range 8 {
			last := each - 8 + slot // the last write to each slot
			off := int64(w)*size/writers + int64(slot)*4096
			b := make([]byte, 4096)
			if _, err := d.ReadAt(b, off); err != nil {
				t.Fatal(err)
			}
			mustEqual(t, "a slot's last write", b, pattern(4096, byte(w+last)))
		}
	}
	st := d.Stats()
	if st.Drops < 3 || st.Reconnects < 3 {
		t.Fatalf("stats %+v: want >= 3 drops and reconnections", st)
	}
	if err := d.Sync(); !errors.Is(err, ErrUnflushedLost) {
		t.Fatalf("flush after losing connections with unflushed writes: %v", err)
	}
}

// TestLostTrimsLoseNothing: a trim the remote may have forgotten loses no
// data (a trimmed range may read back as anything), and a FUA write is
// durable when acknowledged: neither makes a dropped connection fail later
// flushes.
func TestLostTrimsLoseNothing(t *testing.T) {
	dir := shortDir(t)
	k := startNbdkit(t, dir, "k", "file", sparseFile(t, dir, "f", 4*mib))
	d := openURI(t, k.URI(""), testOptions(t))
	if err := d.Discard(0, mib); err != nil {
		t.Fatal(err)
	}
	if _, err := d.WriteAtDSync(pattern(4096, 1), mib); err != nil {
		t.Fatal(err)
	}
	k.Kill()
	k.Start()
	nbdtest.Until(t, "the reconnection", func() bool { return d.Stats().State == StateUp && d.Stats().Reconnects > 0 })
	if st := d.Stats(); st.Lost || st.Unflushed != 0 {
		t.Fatalf("stats %+v: a trim and a FUA write made the remote dirty", st)
	}
	if err := d.Sync(); err != nil {
		t.Fatalf("flush after losing only a trim and a FUA write: %v", err)
	}
}

// TestPanicOnReaderContained: a panic on a connection's reader (here from
// an Observe hook that panics once) ends that connection only: it is
// reported, the request it was finishing is sent again, and the device
// goes on.
func TestPanicOnReaderContained(t *testing.T) {
	dir := shortDir(t)
	k := startNbdkit(t, dir, "k", "file", sparseFile(t, dir, "f", 4*mib))
	opts := testOptions(t)
	var panics atomic.Int32
	opts.OnPanic = func(v any, stack []byte) { panics.Add(1) }
	opts.Connections = 1
	d := openURI(t, k.URI(""), opts)
	var once atomic.Bool
	hook := func(device, op string, _ time.Duration) {
		if !once.Swap(true) {
			panic("observer bug")
		}
	}
	d.observe.Store(&hook)
	if _, err := d.WriteAt(pattern(4096, 7), 0); err != nil {
		t.Fatalf("write across a panicking reader: %v", err)
	}
	readBack(t, d, 0, pattern(4096, 7))
	st := d.Stats()
	if panics.Load() != 1 || st.Drops != 1 || st.Retries != 1 || st.Reconnects != 1 {
		t.Fatalf("%d panics, stats %+v: want 1 panic, 1 drop, 1 retry, 1 reconnection", panics.Load(), st)
	}
}
