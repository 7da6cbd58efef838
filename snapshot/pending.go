package snapshot

import (
	"fmt"
	"slices"
	"sync"

	"github.com/nbdmapper/nbdmapper/backing"
)

// A pending exception is a COW chunk allocated for an origin chunk whose
// copy is being made, dm's dm_snap_pending_exception. While it exists the
// origin chunk does not change: origin writes (and merges) wait for it, so
// the copy and the reads of the snapshot that still go to the origin see
// the old contents. Its life:
//
//	claim     allocate the COW chunk, join the store's queue (under mu)
//	copy      fill the chunk: origin data, a snapshot write, or both
//	ready     the data is written (or failed): any committer may take it
//	commit    one metadata write for every ready exception at the head
//	          of the queue, between two syncs (group commit)
//	release   wait for reads of the origin chunk that began before the
//	          commit, then remove it: waiters go on
//
// Commits are pipelined: a commit's final sync, which makes its metadata
// durable, also makes durable the data of the exceptions that were ready
// when it began, so the next commit, which takes those, skips its first
// sync. Under a steady stream of first writes a commit costs one sync:
//
//	commit 1:  sync  area{a}  [b, c ready]  sync ─ ack a
//	commit 2:                  area{b, c}  [d ready]  sync ─ ack b, c
//	commit 3:                                area{d}  sync ─ ack d
//
// Commits follow allocation order, as dm's do since 4.8: an exception is
// committed only with every one allocated before it, so the metadata lists
// exceptions in the order of their COW chunks, and a crash leaks no chunk
// below the last committed one.
type pending struct {
	old, new uint64
	ready    bool  // data written; err says whether it failed
	synced   bool  // a sync that began after ready has completed
	done     bool  // committed (or failed: err)
	err      error // copy or commit failure
	removed  chan struct{}
}

// claimLocked looks at origin chunks [first, last]. If one of them has a
// pending exception it returns it, allocating nothing: the caller waits for
// it to be removed and tries again. Otherwise it gives every chunk without
// an exception a pending one, in order, and returns them; it stops at the
// first chunk the COW cannot hold, with errFull. Called with s.mu held.
func (s *Snapshot) claimLocked(first, last uint64) (busy *pending, fresh []*pending, err error) {
	for c := first; c <= last; c++ {
		if p := s.pending[c]; p != nil {
			return p, nil, nil
		}
	}
	for c := first; c <= last; c++ {
		if _, ok := s.st.lookup(c); ok {
			continue
		}
		n, err := s.st.prepare()
		if err != nil {
			return nil, fresh, err
		}
		p := &pending{old: c, new: n, removed: make(chan struct{})}
		if s.pending == nil {
			s.pending = make(map[uint64]*pending)
		}
		s.pending[c] = p
		s.queue = append(s.queue, p)
		fresh = append(fresh, p)
	}
	return nil, fresh, nil
}

// readyAll marks copies finished, so that a committer can take them.
func (s *Snapshot) readyAll(ps []*pending) {
	if len(ps) == 0 {
		return
	}
	s.mu.Lock()
	for _, p := range ps {
		p.ready = true
	}
	s.cond.Broadcast()
	s.mu.Unlock()
}

// awaitCommit returns once every exception of ps is committed or failed,
// committing batches itself when nobody else is: the caller that finds the
// head of the queue ready and no commit running takes every ready
// exception at the head and commits them together, outside mu, while
// others queue behind it. It returns the first failure among ps.
func (s *Snapshot) awaitCommit(ps []*pending) error {
	if len(ps) == 0 {
		return nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	for !allDone(ps) {
		if s.committing || len(s.queue) == 0 || !s.queue[0].ready {
			s.cond.Wait()
			continue
		}
		// The exceptions whose data a sync covers already go first, on
		// their own: the ones that became ready since then are covered
		// by this commit's final sync and go in the next.
		dataSynced := s.queue[0].synced
		k := 1
		for k < len(s.queue) && s.queue[k].ready && s.queue[k].synced == dataSynced {
			k++
		}
		batch := slices.Clone(s.queue[:k])
		s.queue = append(s.queue[:0], s.queue[k:]...)
		s.committing = true
		valid := s.st.valid
		s.mu.Unlock()
		err := s.commitBatch(batch, valid, dataSynced)
		var next []*pending
		if err == nil && s.st.typ != Transient {
			// What is ready now has its data written: the sync that
			// makes this batch durable covers that data too.
			s.mu.Lock()
			for _, p := range s.queue {
				if !p.ready {
					break
				}
				next = append(next, p)
			}
			s.mu.Unlock()
			err = backing.Guard(s.cow.Name(), onPanic(), s.cow.Sync)
			if err != nil {
				err = fmt.Errorf("sync metadata: %w", err)
			}
		}
		s.mu.Lock()
		if err == nil {
			for _, p := range next {
				p.synced = true
			}
		}
		s.committing = false
		s.finishBatch(batch, err)
		s.cond.Broadcast()
	}
	for _, p := range ps {
		if p.err != nil {
			return p.err
		}
	}
	return nil
}

func allDone(ps []*pending) bool {
	for _, p := range ps {
		if !p.done {
			return false
		}
	}
	return true
}

// commitBatch writes one batch's metadata (store.commit: a sync unless
// the batch's data is synced already, then the metadata; the caller syncs
// after). A copy that failed fails the batch: dm commits it with valid = 0,
// which invalidates the snapshot. A panic in a device becomes an error, so
// that the queue always advances.
func (s *Snapshot) commitBatch(batch []*pending, valid, dataSynced bool) error {
	if !valid {
		return ErrInvalid
	}
	for _, p := range batch {
		if p.err != nil {
			return p.err
		}
	}
	es := make([]exception, len(batch))
	for i, p := range batch {
		es[i] = exception{Old: p.old, New: p.new}
	}
	return backing.Guard(s.cow.Name(), onPanic(), func() error { return s.st.commit(es, dataSynced) })
}

// finishBatch records a batch's outcome. Called with s.mu held, by the
// committer, before the next commit can start.
func (s *Snapshot) finishBatch(batch []*pending, err error) {
	if err == nil && !s.st.valid {
		err = ErrInvalid
	}
	if err == nil {
		for _, p := range batch {
			s.st.exc[p.old] = p.new
			p.done = true
		}
		s.st.shownArea = s.st.curArea
		if s.st.typ != Transient {
			stats.commits.Add(1)
			stats.exceptions.Add(uint64(len(batch)))
			stats.maxBatch(uint64(len(batch)))
		}
		return
	}
	ierr := s.invalidateLocked(err)
	for _, p := range batch {
		p.done, p.err = true, ierr
	}
}

// release removes ps once the reads of their origin chunks that began
// before they were committed have finished (see tracker), so that nothing
// waiting on them, an origin write above all, overwrites an origin chunk
// such a read is still reading.
func (s *Snapshot) release(ps []*pending) {
	if len(ps) == 0 {
		return
	}
	lo, hi := s.chunkSpan(ps)
	s.g.reads.drain(lo, hi, s.g.reads.mark())
	s.removePending(ps)
}

// chunkSpan is the origin byte range of the chunks of ps.
func (s *Snapshot) chunkSpan(ps []*pending) (lo, hi int64) {
	lo, hi = int64(ps[0].old)*s.st.chunk, int64(ps[0].old+1)*s.st.chunk
	for _, p := range ps[1:] {
		lo = min(lo, int64(p.old)*s.st.chunk)
		hi = max(hi, int64(p.old+1)*s.st.chunk)
	}
	return lo, hi
}

// tracker records I/O in flight over byte ranges, so that a change can wait
// for the I/O that began before a given moment (dm's tracked chunks). Each
// span gets a sequence number; mark returns the next one, and drain waits
// until no span numbered below the mark overlaps a range. I/O that begins
// after the mark is not waited for, so a steady stream of new reads cannot
// hold a change back.
type tracker struct {
	mu      sync.Mutex
	cond    sync.Cond
	seq     uint64
	spans   map[uint64]span
	waiters int
}

type span struct{ off, end int64 }

// add records [off, end) and returns its number for done.
func (t *tracker) add(off, end int64) uint64 {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.spans == nil {
		t.spans = make(map[uint64]span)
		t.cond.L = &t.mu
	}
	t.seq++
	t.spans[t.seq] = span{off, end}
	return t.seq
}

func (t *tracker) done(id uint64) {
	t.mu.Lock()
	delete(t.spans, id)
	if t.waiters > 0 {
		t.cond.Broadcast()
	}
	t.mu.Unlock()
}

func (t *tracker) mark() uint64 {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.seq + 1
}

// drain waits until no span numbered below mark overlaps [off, end).
func (t *tracker) drain(off, end int64, mark uint64) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for t.overlaps(off, end, mark) {
		t.waiters++
		t.cond.Wait()
		t.waiters--
	}
}

func (t *tracker) overlaps(off, end int64, mark uint64) bool {
	for id, sp := range t.spans {
		if id < mark && sp.off < end && off < sp.end {
			return true
		}
	}
	return false
}
