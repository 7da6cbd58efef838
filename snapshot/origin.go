package snapshot

import (
	"fmt"

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
//	each snapshot commits its new exceptions (sync, metadata, sync), and
//	only then is the origin written.
//
// A snapshot whose COW cannot take the copy is invalidated (even PO, as in
// dm); the origin write goes ahead regardless.
type Origin struct {
	name   string
	id     backing.ID
	origin backing.Device
	size   int64
	g      *group
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
func (o *Origin) Close() error                                { return nil }
func (o *Origin) Holes(off, n int64) ([]backing.Range, error) { return o.origin.Holes(off, n) }

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
	err := o.change(off, int64(len(p)), func() (err error) {
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
	return o.change(off, n, func() error { return o.origin.Discard(off, n) })
}

func (o *Origin) Zero(off, n int64, mayPunch bool) error {
	if err := o.check(off, n); err != nil {
		return err
	}
	return o.change(off, n, func() error { return o.origin.Zero(off, n, mayPunch) })
}

// change runs fn, which modifies [off, off+n) of the origin, after copying
// the old contents out to every snapshot that needs them.
func (o *Origin) change(off, n int64, fn func() error) error {
	g := o.g
	g.mu.RLock()
	if !g.needsCopy(off, n) {
		defer g.mu.RUnlock()
		return fn()
	}
	g.mu.RUnlock()
	g.mu.Lock()
	defer g.mu.Unlock()
	for _, s := range g.snaps {
		s.copyOut(off, n)
	}
	return fn()
}

// needsCopy reports whether some valid snapshot lacks an exception for a
// chunk of [off, off+n). Called with g.mu held.
func (g *group) needsCopy(off, n int64) bool {
	for _, s := range g.snaps {
		if !s.st.valid {
			continue
		}
		if lo, k := s.clip(off, n); k > 0 && !s.allMapped(lo, k) {
			return true
		}
	}
	return false
}

// clip cuts [off, off+n) to the snapshot's size: dm skips snapshots that
// end before the write.
func (s *Snapshot) clip(off, n int64) (int64, int64) {
	if off >= s.size {
		return off, 0
	}
	return off, min(n, s.size-off)
}

// copyOut gives s an exception for every chunk of [off, off+n) it lacks,
// holding the origin's current contents. Failure invalidates s. Called
// with g.mu held for writing.
func (s *Snapshot) copyOut(off, n int64) {
	if !s.st.valid {
		return
	}
	off, n = s.clip(off, n)
	if n == 0 {
		return
	}
	chunk := s.st.chunk
	var fresh []exception
	var buf []byte
	var cerr error
	for c := uint64(off / chunk); c <= uint64((off+n-1)/chunk); c++ {
		if _, ok := s.st.lookup(c); ok {
			continue
		}
		nc, err := s.st.prepare()
		if err != nil {
			cerr = err
			break
		}
		if buf == nil {
			buf = make([]byte, chunk)
		}
		if err := s.readOriginChunk(buf, c); err != nil {
			cerr = err
			break
		}
		if err := s.st.writeChunk(buf, nc); err != nil {
			cerr = err
			break
		}
		fresh = append(fresh, exception{Old: c, New: nc})
	}
	if len(fresh) > 0 {
		if err := s.st.commit(fresh); err != nil {
			cerr = err
		}
	}
	if cerr != nil {
		s.invalidate(cerr)
	}
}
