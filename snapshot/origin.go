package snapshot

import (
	"fmt"
	"sync/atomic"

	"github.com/nbdmapper/nbdmapper/backing"
)

// Origin is the snapshot-origin device: the origin, passed through, except
// that a write first copies every chunk it changes out to each snapshot of
// the origin that has no exception for that chunk yet.
//
// Worked example, two snapshots A (chunk 4 KiB) and B (chunk 8 KiB), and a
// 2 KiB write at 7 KiB:
//
//	origin bytes     0     4K    8K    12K   16K
//	A chunks         [ 0  ][ 1  ][ 2  ][ 3  ]
//	B chunks         [    0    ][    1     ]
//	write                    [7K..9K)
//	A: chunks 1 and 2 are copied out (unless A already has them)
//	B: chunks 0 and 1 are copied out
//	each snapshot commits its new exceptions (sync, metadata, sync),
//	sharing the commit with other writers' exceptions that are ready,
//	and only then is the origin written.
//
// A snapshot whose COW cannot take the copy is invalidated (even PO, as in
// dm); the origin write goes ahead regardless.
type Origin struct {
	name   string
	id     backing.ID
	origin backing.Device
	size   int64
	g      *group
	closed atomic.Bool
}

var _ backing.Device = (*Origin)(nil)

// NewOrigin returns the snapshot-origin device for origin, size bytes long
// (0 means the whole origin). It shares its group with every Snapshot of
// the same origin device, loaded before or after it.
func NewOrigin(name string, origin backing.Device, size int64) (*Origin, error) {
	if size == 0 {
		size = origin.Size() &^ 511
	}
	if size < 0 || size > origin.Size() {
		return nil, fmt.Errorf("snapshot-origin size %d beyond the origin's %d bytes", size, origin.Size())
	}
	return &Origin{name: name, id: newStackedID(), origin: origin, size: size, g: groupOf(origin.ID())}, nil
}

func (o *Origin) Name() string                                { return o.name }
func (o *Origin) ID() backing.ID                              { return o.id }
func (o *Origin) Size() int64                                 { return o.size }
func (o *Origin) Sync() error                                 { return o.origin.Sync() }
func (o *Origin) Limits() backing.Limits                      { return o.origin.Limits() }
func (o *Origin) Holes(off, n int64) ([]backing.Range, error) { return o.origin.Holes(off, n) }

// Close gives up the origin's group (the snapshots of its origin device
// keep theirs). The origin device belongs to whoever opened it. Closing
// twice does nothing.
func (o *Origin) Close() error {
	if o.closed.CompareAndSwap(false, true) {
		releaseGroup(o.g)
	}
	return nil
}

// Devices lists the origin: copy-outs are synced to the COW devices when
// they are committed, so a flush of the origin device needs only the origin.
func (o *Origin) Devices() []backing.Device { return []backing.Device{o.origin} }

func (o *Origin) check(off, n int64) error {
	if off < 0 || n < 0 || off > o.size || n > o.size-off {
		return fmt.Errorf("snapshot-origin %s: range [%d, %d) outside %d bytes", o.name, off, off+n, o.size)
	}
	return nil
}

func (o *Origin) ReadAt(p []byte, off int64) (int, error) {
	if err := o.check(off, int64(len(p))); err != nil {
		return 0, err
	}
	return o.origin.ReadAt(p, off)
}

// ReadAtSparse reads the origin sparsely (backing.SparseReader): reads pass
// through to it, so its holes are the origin's.
func (o *Origin) ReadAtSparse(p []byte, off, minHole int64, maxHoles int, holes []backing.Range) ([]backing.Range, error) {
	if err := o.check(off, int64(len(p))); err != nil {
		return holes, err
	}
	return backing.ReadSparse(o.origin, p, off, minHole, maxHoles, holes)
}

func (o *Origin) WriteAt(p []byte, off int64) (int, error) {
	if err := o.check(off, int64(len(p))); err != nil {
		return 0, err
	}
	var n int
	err := o.g.change(off, int64(len(p)), func() (err error) {
		n, err = o.origin.WriteAt(p, off)
		return err
	})
	return n, err
}

// Discard and Zero change the origin too, so they copy out first.
func (o *Origin) Discard(off, n int64) error {
	if err := o.check(off, n); err != nil {
		return err
	}
	return o.g.change(off, n, func() error { return o.origin.Discard(off, n) })
}

func (o *Origin) Zero(off, n int64, mayPunch bool) error {
	if err := o.check(off, n); err != nil {
		return err
	}
	return o.g.change(off, n, func() error { return o.origin.Zero(off, n, mayPunch) })
}

// change runs fn, which modifies [off, off+n) of the origin, after copying
// the old contents out to every snapshot that needs them (dm's
// __origin_write). Snapshots are visited in the group's order; in each,
// change waits for other copies of the same chunks, claims the chunks it
// lacks, copies them and marks them ready without waiting for the commit,
// so that what it holds never keeps another writer's commit from going
// through. Then it waits for every commit, for the snapshot reads of those
// origin chunks that began before them, and only then runs fn. A merging
// snapshot gets no copies: its chunks go back to the origin, not out of it.
func (g *group) change(off, n int64, fn func() error) error {
	if n == 0 {
		return fn()
	}
	type held struct {
		s     *Snapshot
		fresh []*pending
	}
	var hs []held
	for _, s := range g.list() {
		if fresh := s.copyOut(off, n); len(fresh) > 0 {
			hs = append(hs, held{s, fresh})
		}
	}
	if len(hs) == 0 {
		return fn()
	}
	lo, hi := off, off+n
	for _, h := range hs {
		h.s.awaitCommit(h.fresh) // a failure has invalidated h.s; the origin write goes on
		l, e := h.s.chunkSpan(h.fresh)
		lo, hi = min(lo, l), max(hi, e)
	}
	g.reads.drain(lo, hi, g.reads.mark())
	for _, h := range hs {
		h.s.removePending(h.fresh)
	}
	return fn()
}

// clip cuts [off, off+n) to the snapshot's size: dm skips snapshots that
// end before the write.
func (s *Snapshot) clip(off, n int64) (int64, int64) {
	if off >= s.size {
		return off, 0
	}
	return off, min(n, s.size-off)
}

// copyOut gives s a pending exception for every chunk of [off, off+n) it
// lacks, copies the origin's current contents into them and marks them
// ready; the caller waits for their commit and removes them. It waits
// first for pending exceptions of the same chunks, made by others. A COW
// that cannot take the copy invalidates s.
func (s *Snapshot) copyOut(off, n int64) []*pending {
	off, n = s.clip(off, n)
	if n == 0 {
		return nil
	}
	for {
		s.mu.Lock()
		if !s.active || s.opt.Merge || s.closed || s.handedOver || !s.st.valid {
			s.mu.Unlock()
			return nil
		}
		chunk := s.st.chunk
		busy, fresh, err := s.claimLocked(uint64(off/chunk), uint64((off+n-1)/chunk))
		if busy != nil {
			s.mu.Unlock()
			<-busy.removed
			continue
		}
		if err != nil {
			// dm invalidates a snapshot that cannot take a copy-out,
			// even PO. The chunks claimed before fail with it.
			ierr := s.invalidateLocked(err)
			for _, p := range fresh {
				p.err = ierr
			}
		}
		s.mu.Unlock()
		for _, p := range fresh {
			if p.err == nil {
				start := int64(p.old) * chunk
				p.err = backing.Guard(s.cow.Name(), onPanic(), func() error {
					return s.copyOrigin(int64(p.new)*chunk, start, chunk)
				})
			}
		}
		s.readyAll(fresh)
		return fresh
	}
}

// removePending forgets ps and wakes their waiters. The caller has waited
// for the reads ps protect (release does both).
func (s *Snapshot) removePending(ps []*pending) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, p := range ps {
		if s.pending[p.old] == p {
			delete(s.pending, p.old)
		}
		close(p.removed)
	}
	s.cond.Broadcast()
}
