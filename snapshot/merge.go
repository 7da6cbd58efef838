package snapshot

import (
	"fmt"
	"sync"
	"time"

	"github.com/nbdmapper/nbdmapper/backing"
)

// merge is a snapshot-merge device's state: dm's snapshot-merge, which
// copies the COW's chunks back into the origin in the background while the
// device serves the snapshot's contents.
//
// The order is the kernel's (dm-snap.c snapshot_merge_next_chunks,
// dm-snap-persistent.c prepare_merge and commit_merge): from the last
// entry of the last metadata area backwards, a run of entries whose origin
// and COW chunks are both consecutive at a time (here at most mergeBatch
// bytes of it), and for each run
//
//  1. copy the run's origin chunks out to the other snapshots of the
//     origin that lack them (the merge changes the origin)
//  2. mark the run as merging and wait for writes to it in flight
//  3. copy COW -> origin, in pieces of copyBuffer
//  4. sync the origin
//  5. clear the run's entries in the metadata area: write it between two
//     syncs of the COW
//  6. forget the exceptions; writes held at 2 go on, now to the origin
//
// A crash anywhere before 5 is durable leaves the entries on disk, and the
// merge copies the run again when the store is served again; after 5 the
// origin already holds the run. Merging one run at most holds mergeBatch
// bytes of writes back and copyBuffer bytes of memory.
//
// Meanwhile reads see the snapshot: chunks still on the COW are read from
// it, the rest from the origin. Writes, as dm's snapshot_merge_map sends
// them: to a chunk still on the COW, in place on the COW (the merge copies
// it back later), unless the chunk is in the run being merged, in which
// case the write waits for the run and then goes to the origin; to any
// other chunk, to the origin, through the origin's copy-outs to the other
// snapshots. Discards are dropped. An invalid snapshot sends everything to
// the origin; a failed step stops the merge with status "Merge failed".
//
// Between runs the merge sleeps so as to copy at most the configured rate
// (Configure's MergeRate, `nbdmapper serve --merge-rate`).
type merge struct {
	// Guarded by the snapshot's mu.
	mergeLo, mergeHi uint64 // origin chunks [lo, hi) being merged now
	mergeFailed      bool
	mergeDone        bool
	mergeWaiters     int // writes waiting for the run being merged (tests watch it)

	writes tracker // in-place COW writes in flight, in origin chunks

	mergeMu  sync.Mutex // mergeRun
	mergeRun *mergeRun
}

type mergeRun struct{ stop, done chan struct{} }

// mergeBatch bounds one merge step, whatever the run's length.
const mergeBatch = 4 << 20

// startMerge starts the background merge of a snapshot-merge device, unless
// it runs already.
func (s *Snapshot) startMerge() {
	if !s.opt.Merge {
		return
	}
	s.mergeMu.Lock()
	defer s.mergeMu.Unlock()
	if s.mergeRun != nil {
		return
	}
	r := &mergeRun{stop: make(chan struct{}), done: make(chan struct{})}
	s.mergeRun = r
	stats.mergesRunning.Add(1)
	go s.mergeLoop(r)
}

// stopMerge stops the merge after the step in progress and waits for it.
func (s *Snapshot) stopMerge() {
	s.mergeMu.Lock()
	r := s.mergeRun
	s.mergeRun = nil
	s.mergeMu.Unlock()
	if r != nil {
		close(r.stop)
		<-r.done
	}
}

// Merging reports whether the snapshot is a snapshot-merge device whose
// merge has not finished (or failed).
func (s *Snapshot) Merging() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.opt.Merge && !s.mergeDone && !s.mergeFailed && s.st.valid && !s.handedOver
}

func (s *Snapshot) mergeLoop(r *mergeRun) {
	defer close(r.done)
	defer stats.mergesRunning.Add(-1)
	var next time.Time
	for {
		select {
		case <-r.stop:
			return
		default:
		}
		var n int64
		var more bool
		err := backing.Guard(s.name, onPanic(), func() (err error) {
			n, more, err = s.mergeStep()
			return err
		})
		if err != nil {
			s.failMerge(err)
			return
		}
		if !more {
			return
		}
		rate := config.Load().MergeRate
		if rate <= 0 {
			continue
		}
		now := time.Now()
		if next.Before(now) {
			next = now
		}
		next = next.Add(time.Duration(float64(n) / float64(rate) * float64(time.Second)))
		if d := next.Sub(now); d > 0 {
			t := time.NewTimer(d)
			select {
			case <-r.stop:
				t.Stop()
				return
			case <-t.C:
			}
		}
	}
}

// mergeStep merges one run (see merge) and returns how many bytes it
// copied; more is false once nothing is left to do.
func (s *Snapshot) mergeStep() (copied int64, more bool, err error) {
	s.mu.Lock()
	st := s.st
	switch {
	case s.closed || s.handedOver || !s.active || s.mergeDone || s.mergeFailed:
		s.mu.Unlock()
		return 0, false, nil
	case !st.valid:
		s.mu.Unlock()
		logf("snapshot %s: snapshot is invalid: can't merge", s.name)
		return 0, false, nil
	}
	s.mu.Unlock()

	last, n, err := st.prepareMerge()
	s.mu.Lock()
	st.shownArea = st.curArea
	s.mu.Unlock()
	if err != nil {
		return 0, false, fmt.Errorf("read error in exception store: %w", err)
	}
	if n == 0 {
		s.mu.Lock()
		s.mergeDone = true
		s.mu.Unlock()
		stats.mergesDone.Add(1)
		logf("snapshot %s: merge complete", s.name)
		return 0, false, nil
	}
	n = min(n, max(1, int(mergeBatch/st.chunk)))
	old0, new0 := last.Old+1-uint64(n), last.New+1-uint64(n)

	s.mu.Lock()
	s.mergeLo, s.mergeHi = old0, old0+uint64(n)
	mark := s.writes.mark()
	s.mu.Unlock()
	defer s.endStep()
	s.writes.drain(int64(old0), int64(old0)+int64(n), mark)

	off := int64(old0) * st.chunk
	length := min(int64(n)*st.chunk, s.origin.Size()-off)
	if length > 0 {
		err = s.g.change(off, length, func() error {
			return copyRange(s.origin, off, s.cow, int64(new0)*st.chunk, length)
		})
		if err != nil {
			return 0, false, fmt.Errorf("copying chunks %d-%d back: %w", old0, old0+uint64(n)-1, err)
		}
		if err := syncMerged(s.origin); err != nil {
			return 0, false, fmt.Errorf("flush after merge: %w", err)
		}
	}
	nextFree, err := st.commitMerge(n)
	if err != nil {
		return 0, false, fmt.Errorf("write error in exception store: %w", err)
	}
	s.mu.Lock()
	for c := old0; c < old0+uint64(n); c++ {
		delete(st.exc, c)
	}
	st.nextFree = nextFree
	s.mu.Unlock()
	stats.mergedChunks.Add(uint64(n))
	stats.mergedBytes.Add(uint64(max(length, 0)))
	return max(length, 0), true, nil
}

// endStep ends a merge step: writes held for its run go on.
func (s *Snapshot) endStep() {
	s.mu.Lock()
	s.mergeLo, s.mergeHi = 0, 0
	s.cond.Broadcast()
	s.mu.Unlock()
}

// failMerge stops the merge for good after a device error (dm's "Merge
// failed"); the device goes on serving the snapshot.
func (s *Snapshot) failMerge(err error) {
	s.mu.Lock()
	s.mergeFailed = true
	s.mergeLo, s.mergeHi = 0, 0
	s.cond.Broadcast()
	s.mu.Unlock()
	stats.mergeFailures.Add(1)
	logf("snapshot %s: merge failed: %v", s.name, err)
}

// passThroughLocked says whether I/O that usableLocked refused goes to the
// origin instead: on an invalid merging snapshot, as dm redirects it.
func (s *Snapshot) passThroughLocked() bool {
	return s.opt.Merge && s.active && !s.closed && !s.handedOver && !s.st.valid
}

// mergeWrite is WriteAt on a snapshot-merge device.
func (s *Snapshot) mergeWrite(p []byte, off int64) (int, error) {
	for pos := int64(0); pos < int64(len(p)); {
		k, err := s.mergeWritePart(p[pos:], off+pos)
		if err != nil {
			return 0, err
		}
		pos += k
	}
	return len(p), nil
}

// mergeWritePart writes a prefix of p at off: the chunks from off on that
// are all on the COW and not being merged, or all not on the COW. It
// returns the prefix's length.
func (s *Snapshot) mergeWritePart(p []byte, off int64) (int64, error) {
	s.mu.Lock()
	for {
		if err := s.usableLocked(false); err != nil {
			through := s.passThroughLocked()
			s.mu.Unlock()
			if !through {
				return 0, err
			}
			return int64(len(p)), s.writeOrigin(p, off)
		}
		c0 := uint64(off / s.st.chunk)
		if _, ok := s.st.lookup(c0); !ok || c0 < s.mergeLo || c0 >= s.mergeHi {
			break
		}
		s.mergeWaiters++
		s.cond.Wait() // the chunk is being merged: wait for its run
		s.mergeWaiters--
	}
	chunk := s.st.chunk
	_, onCOW := s.st.lookup(uint64(off / chunk))
	pl := getPlan()
	defer putPlan(pl)
	end := off
	for end < off+int64(len(p)) {
		c := uint64(end / chunk)
		n, ok := s.st.lookup(c)
		if ok != onCOW || (ok && c >= s.mergeLo && c < s.mergeHi) {
			break
		}
		k := min(int64(c+1)*chunk, off+int64(len(p))) - end
		if ok {
			pl.add(s.cow, int64(n)*chunk+end%chunk, end-off, k)
		}
		end += k
	}
	length := end - off
	if !onCOW {
		s.mu.Unlock()
		return length, s.writeOrigin(p[:length], off)
	}
	id := s.writes.add(off/chunk, (end-1)/chunk+1)
	s.inflight++
	s.mu.Unlock()
	defer s.exit()
	defer s.writes.done(id)
	return length, s.run(pl, p, true)
}

// writeOrigin writes p at off on the origin, copying out to the other
// snapshots first.
func (s *Snapshot) writeOrigin(p []byte, off int64) error {
	return s.g.change(off, int64(len(p)), func() error {
		_, err := s.origin.WriteAt(p, off)
		return err
	})
}
