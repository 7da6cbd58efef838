package snapshot

import (
	"bytes"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/nbdmapper/nbdmapper/backing"
	"github.com/nbdmapper/nbdmapper/internal/testing/nbdtest"
)

// queued reports how many pending exceptions of s are ready and waiting
// for a commit.
func queued(s *Snapshot) (ready int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, p := range s.queue {
		if p.ready {
			ready++
		}
	}
	return ready
}

// TestBatchedCommits: first writes that become ready while a commit runs
// share the next one. The first writer's commit is held in its first sync
// until the other 15 writers have copied their chunks; those 15 then go
// out as one commit: one metadata write for 15 exceptions, and one sync,
// since the first commit's final sync began after their data was written.
func TestBatchedCommits(t *testing.T) {
	const writers = 16
	origin, mem := newPair(t, 256<<10, 1<<20)
	cow := backing.NewFaulty(mem)
	s := open(t, origin, cow, Options{Type: Persistent, ChunkSectors: 8})
	before := ReadStats()
	var once sync.Once
	held := make(chan struct{})
	cow.BeforeSync(func() {
		once.Do(func() {
			close(held)
			nbdtest.Until(t, "15 exceptions ready behind the running commit", func() bool { return queued(s) == writers-1 })
		})
	})
	syncs0 := cow.Syncs()
	var wg sync.WaitGroup
	errs := make(chan error, writers)
	write := func(i int) {
		defer wg.Done()
		if _, err := s.WriteAt(bytes.Repeat([]byte{byte(i + 1)}, 4096), int64(i)*4096); err != nil {
			errs <- err
		}
	}
	wg.Add(1)
	go write(0)
	nbdtest.Recv(t, held, "the first commit's sync")
	for i := 1; i < writers; i++ {
		wg.Add(1)
		go write(i)
	}
	nbdtest.Wait(t, &wg, "the writers")
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	after := ReadStats()
	commits, exceptions := after.Commits-before.Commits, after.Exceptions-before.Exceptions
	if commits != 2 || exceptions != writers {
		t.Fatalf("%d exceptions in %d commits, want %d in 2", exceptions, commits, writers)
	}
	if after.MaxBatch < writers-1 {
		t.Fatalf("largest batch %d, want %d", after.MaxBatch, writers-1)
	}
	if syncs := cow.Syncs() - syncs0; syncs != 3 {
		t.Fatalf("%d COW syncs for 2 commits, want 3 (data, metadata 1 + data 2, metadata 2)", syncs)
	}
	// The exceptions are in allocation order on disk and the data is there,
	// after a restart too.
	want := patternOf(t, origin, 256<<10)
	for i := 0; i < writers; i++ {
		copy(want[i*4096:], bytes.Repeat([]byte{byte(i + 1)}, 4096))
	}
	checkRead(t, 0, s, want, 0, 256<<10)
	s.Close()
	s2 := open(t, origin, mem, Options{Type: Persistent, ChunkSectors: 8})
	checkRead(t, 1, s2, want, 0, 256<<10)
	var e [16]byte
	for i := 0; i < writers; i++ {
		mem.ReadAt(e[:], 4096+int64(i)*16)
		if got := getException(e[:], 0); got.New != uint64(2+i) {
			t.Fatalf("metadata entry %d: %+v, want COW chunk %d (allocation order)", i, got, 2+i)
		}
	}
}

// TestNoWaitForCommit: while a commit is held in its sync, reads (of chunks
// with and without exceptions) and writes to chunks that have an exception
// complete; an origin write to a chunk every snapshot has, too.
func TestNoWaitForCommit(t *testing.T) {
	origin, mem := newPair(t, 64<<10, 1<<20)
	cow := backing.NewFaulty(mem)
	s := open(t, origin, cow, Options{Type: Persistent, ChunkSectors: 8})
	o, err := NewOrigin("origin", origin, 0)
	if err != nil {
		t.Fatal(err)
	}
	mustWrite(t, s, []byte("copied"), 0) // chunk 0 has an exception
	gate := make(chan struct{})
	entered := make(chan struct{}, 1)
	cow.BeforeSync(func() {
		select {
		case entered <- struct{}{}:
		default:
		}
		<-gate
	})
	done := make(chan error, 1)
	go func() { _, err := s.WriteAt([]byte("first"), 5*4096); done <- err }() // needs a commit
	nbdtest.Recv(t, entered, "the commit's sync")
	buf := make([]byte, 8192)
	if _, err := s.ReadAt(buf, 0); err != nil { // chunk 0 (COW) and 1 (origin)
		t.Fatal(err)
	}
	mustWrite(t, s, []byte("in place"), 100)
	mustWrite(t, o, []byte("origin"), 0) // chunk 0: already copied
	close(gate)
	if err := nbdtest.Recv(t, done, "the first write"); err != nil {
		t.Fatal(err)
	}
}

// TestConcurrentFirstWrites races writers on the snapshot and on the origin
// over the same chunks, then checks every chunk against the two possible
// orders: a chunk is either the origin's old data with the snapshot's
// write over it, and the origin shows the origin write; each device only
// ever shows its own writes.
func TestConcurrentFirstWrites(t *testing.T) {
	for _, typ := range []Type{Persistent, Transient} {
		t.Run(typ.String(), func(t *testing.T) {
			const chunks = 64
			origin, cow := newPair(t, chunks*4096, 2<<20)
			s := open(t, origin, cow, Options{Type: typ, ChunkSectors: 8})
			o, err := NewOrigin("origin", origin, 0)
			if err != nil {
				t.Fatal(err)
			}
			old := patternOf(t, origin, chunks*4096)
			var wg sync.WaitGroup
			for w := 0; w < 8; w++ {
				wg.Add(2)
				go func() { // snapshot: the first half of each chunk
					defer wg.Done()
					for c := w; c < chunks; c += 8 {
						if _, err := s.WriteAt(bytes.Repeat([]byte{'S'}, 2048), int64(c)*4096); err != nil {
							t.Error(err)
						}
					}
				}()
				go func() { // origin: the second half
					defer wg.Done()
					for c := chunks - 1 - w; c >= 0; c -= 8 {
						if _, err := o.WriteAt(bytes.Repeat([]byte{'O'}, 2048), int64(c)*4096+2048); err != nil {
							t.Error(err)
						}
					}
				}()
			}
			nbdtest.Wait(t, &wg, "the writers")
			wantSnap, wantOrig := bytes.Clone(old), bytes.Clone(old)
			for c := 0; c < chunks; c++ {
				copy(wantSnap[c*4096:], bytes.Repeat([]byte{'S'}, 2048))
				copy(wantOrig[c*4096+2048:], bytes.Repeat([]byte{'O'}, 2048))
			}
			checkRead(t, 0, s, wantSnap, 0, chunks*4096)
			checkRead(t, 0, origin, wantOrig, 0, chunks*4096)
			if st := s.Status(); typ == Persistent && st != fmt.Sprintf("%d/4096 16", (chunks+2)*8) {
				t.Fatalf("status %q", st)
			}
		})
	}
}

// readGate holds the first ReadAt in flight until released.
type readGate struct {
	backing.Device
	armed         atomic.Bool
	entered, gate chan struct{}
}

func (g *readGate) ReadAt(p []byte, off int64) (int, error) {
	if g.armed.CompareAndSwap(true, false) {
		close(g.entered)
		<-g.gate
	}
	return g.Device.ReadAt(p, off)
}

// TestOriginWriteWaitsForReads: a snapshot read of an origin chunk in
// flight when an origin write copies that chunk out is waited for before
// the origin changes, so it returns the old data (dm's tracked chunks).
func TestOriginWriteWaitsForReads(t *testing.T) {
	mem, cow := newPair(t, 64<<10, 1<<20)
	origin := &readGate{Device: mem, entered: make(chan struct{}), gate: make(chan struct{})}
	s := open(t, origin, cow, Options{Type: Persistent, ChunkSectors: 8})
	o, err := NewOrigin("origin", origin, 0)
	if err != nil {
		t.Fatal(err)
	}
	want := patternOf(t, mem, 12288)
	origin.armed.Store(true)
	read := make(chan []byte, 1)
	go func() {
		p := make([]byte, 8192)
		if _, err := s.ReadAt(p, 4096); err != nil {
			t.Error(err)
		}
		read <- p
	}()
	nbdtest.Recv(t, origin.entered, "the snapshot read to reach the origin")
	wrote := make(chan error, 1)
	go func() { _, err := o.WriteAt(bytes.Repeat([]byte{'N'}, 4096), 8192); wrote <- err }()
	nbdtest.Until(t, "the origin write to wait for the read, or to go on without it", func() bool {
		s.g.reads.mu.Lock()
		waiting := s.g.reads.waiters > 0
		s.g.reads.mu.Unlock()
		return waiting || bytes.Equal(patternOf(t, mem, 12288)[8192:], bytes.Repeat([]byte{'N'}, 4096))
	})
	close(origin.gate)
	if got := nbdtest.Recv(t, read, "the read"); !bytes.Equal(got, want[4096:]) {
		t.Fatal("the snapshot read returned the origin's new data")
	}
	if err := nbdtest.Recv(t, wrote, "the origin write"); err != nil {
		t.Fatal(err)
	}
	checkRead(t, 0, s, want, 0, 12288)
}
