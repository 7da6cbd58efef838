package snapshot

import (
	"errors"
	"fmt"
	"slices"

	"github.com/nbdmapper/nbdmapper/backing"
)

// Options configure a snapshot, as the snapshot target's arguments do.
type Options struct {
	Type Type
	// ChunkSectors is the table's chunk size. A persistent store that
	// already exists keeps the chunk size in its header, which wins; 0
	// means "from the header, or 32 for a new store" (P/PO only).
	ChunkSectors uint32
	// Size is the snapshot's size in bytes (the table line's length);
	// 0 means the origin's size. It may not exceed the origin.
	Size int64
	// DiscardZeroesCOW makes discards of chunks that have an exception zero
	// them in the COW (dm's discard_zeroes_cow); without it discards are
	// not supported and dropped.
	DiscardZeroesCOW bool
	// DiscardPassdownOrigin also discards the origin (needs DiscardZeroesCOW).
	DiscardPassdownOrigin bool
}

// Snapshot is a copy-on-write view of an origin device: a backing.Device
// whose reads come from the COW device where a chunk has an exception and
// from the origin elsewhere, and whose writes go to the COW device,
// copying the origin chunk in first when a write covers only part of it.
//
// Worked example, chunk size 4 KiB, exception for origin chunk 1 at COW
// chunk 2, and a 6 KiB write at 3 KiB:
//
//	origin chunk      0          1          2
//	                  [----------|==========|----------]
//	write                   [3K ..............9K)
//	chunk 0: no exception: allocate COW chunk 3, copy origin chunk 0,
//	         overlay [3K, 4K), write it to COW chunk 3
//	chunk 1: exception: write [4K, 8K) to COW chunk 2 in place
//	chunk 2: no exception: allocate COW chunk 4, copy, overlay [8K, 9K)
//	then commit {0 -> 3, 2 -> 4} (persistent: sync, metadata, sync)
//	and only then return.
type Snapshot struct {
	name   string
	id     backing.ID
	origin backing.Device
	cow    backing.Device
	opt    Options
	size   int64
	g      *group

	// Guarded by g.mu.
	st         *store
	overflowed bool
	closed     bool
}

var _ backing.Device = (*Snapshot)(nil)

// Open loads the snapshot of origin whose exceptions live on cow, reading
// or initialising the exception store, and registers it with every other
// snapshot and snapshot-origin device of the same origin (by backing.ID).
// name is for logs. Close unregisters it; it does not close origin or cow.
func Open(name string, origin, cow backing.Device, opt Options) (*Snapshot, error) {
	if origin.ID() == cow.ID() {
		return nil, ErrSameDevice
	}
	if opt.DiscardPassdownOrigin && !opt.DiscardZeroesCOW {
		return nil, errors.New("discard_passdown_origin feature depends on discard_zeroes_cow")
	}
	size := opt.Size
	if size == 0 {
		size = origin.Size() &^ 511
	}
	if size < 0 || size > origin.Size() {
		return nil, fmt.Errorf("snapshot size %d beyond the origin's %d bytes", size, origin.Size())
	}
	s := &Snapshot{name: name, id: newStackedID(), origin: origin, cow: cow, opt: opt, size: size}
	if err := claimCOW(s); err != nil {
		return nil, err
	}
	st, err := openStore(cow, opt.Type, opt.ChunkSectors)
	if err != nil {
		releaseCOW(s)
		return nil, err
	}
	s.st = st
	s.g = groupOf(origin.ID())
	s.g.mu.Lock()
	s.g.snaps = append(s.g.snaps, s)
	s.g.mu.Unlock()
	return s, nil
}

func (s *Snapshot) Name() string           { return s.name }
func (s *Snapshot) ID() backing.ID         { return s.id }
func (s *Snapshot) Size() int64            { return s.size }
func (s *Snapshot) Sync() error            { return s.cow.Sync() }
func (s *Snapshot) Origin() backing.Device { return s.origin }
func (s *Snapshot) COW() backing.Device    { return s.cow }

// Devices lists the devices the snapshot reads or writes: COW and origin.
func (s *Snapshot) Devices() []backing.Device { return []backing.Device{s.cow, s.origin} }

// Type is the store type; ChunkSectors the chunk size in use (the on-disk
// one for an existing persistent store).
func (s *Snapshot) Type() Type { return s.opt.Type }

func (s *Snapshot) ChunkSectors() uint32 { return s.st.chunkSectors }

// Features are the feature arguments as dm prints them: "", or
// "1 discard_zeroes_cow", or "2 discard_zeroes_cow discard_passdown_origin".
func (s *Snapshot) Features() []string {
	switch {
	case s.opt.DiscardPassdownOrigin:
		return []string{"2", "discard_zeroes_cow", "discard_passdown_origin"}
	case s.opt.DiscardZeroesCOW:
		return []string{"1", "discard_zeroes_cow"}
	}
	return nil
}

// Status is the line `dmsetup status` prints for the target:
// "<sectors_allocated>/<total_sectors> <metadata_sectors>", "Invalid" or
// "Overflow".
func (s *Snapshot) Status() string {
	s.g.mu.RLock()
	defer s.g.mu.RUnlock()
	switch {
	case !s.st.valid:
		return "Invalid"
	case s.overflowed:
		return "Overflow"
	}
	a, t, m := s.st.usage()
	return fmt.Sprintf("%d/%d %d", a, t, m)
}

// Limits: with discard_zeroes_cow discards are cut to whole chunks, as dm
// sets discard_granularity and max_discard_sectors to the chunk size.
func (s *Snapshot) Limits() backing.Limits {
	if s.opt.DiscardZeroesCOW {
		return backing.Limits{Granularity: s.st.chunk, MaxBytes: s.st.chunk}
	}
	return backing.Limits{Granularity: 512}
}

// Holes reports nothing: the snapshot does not know its allocation.
func (s *Snapshot) Holes(off, n int64) ([]backing.Range, error) { return nil, nil }

// Zero is not native: the caller writes zeros, which go through WriteAt's
// copy-on-write like any other data.
func (s *Snapshot) Zero(off, n int64, mayPunch bool) error { return backing.ErrNotSupported }

// Close unregisters the snapshot from its origin; later I/O fails.
func (s *Snapshot) Close() error {
	s.g.mu.Lock()
	defer s.g.mu.Unlock()
	if s.closed {
		return nil
	}
	s.closed = true
	s.g.snaps = slices.DeleteFunc(s.g.snaps, func(x *Snapshot) bool { return x == s })
	releaseCOW(s)
	return nil
}

func (s *Snapshot) check(off, n int64) error {
	if off < 0 || n < 0 || off > s.size || n > s.size-off {
		return fmt.Errorf("snapshot %s: range [%d, %d) outside %d bytes", s.name, off, off+n, s.size)
	}
	return nil
}

// usable reports why I/O must fail, if it must. Called with g.mu held.
func (s *Snapshot) usable(write bool) error {
	switch {
	case s.closed:
		return fmt.Errorf("snapshot %s: closed: %w", s.name, ErrInvalid)
	case !s.st.valid:
		return fmt.Errorf("snapshot %s: %w", s.name, ErrInvalid)
	case write && s.overflowed:
		return fmt.Errorf("snapshot %s: %w", s.name, ErrOverflow)
	}
	return nil
}

// piece is the part of a request inside one chunk.
type piece struct {
	chunk uint64 // origin chunk
	in    int64  // offset inside the chunk
	pos   int64  // offset in the request buffer
	n     int64
}

// pieces splits [off, off+n) at chunk boundaries.
func pieces(chunk, off, n int64, fn func(piece) error) error {
	for pos := int64(0); pos < n; {
		c, in := (off+pos)/chunk, (off+pos)%chunk
		k := min(chunk-in, n-pos)
		if err := fn(piece{chunk: uint64(c), in: in, pos: pos, n: k}); err != nil {
			return err
		}
		pos += k
	}
	return nil
}

// run coalesces device I/O over consecutive chunks that are also
// consecutive on the same device.
type run struct {
	dev      backing.Device
	off, pos int64
	n        int64
	write    bool
	p        []byte
}

func (r *run) add(dev backing.Device, off, pos, n int64) error {
	if r.n > 0 && r.dev == dev && r.off+r.n == off && r.pos+r.n == pos {
		r.n += n
		return nil
	}
	if err := r.flush(); err != nil {
		return err
	}
	r.dev, r.off, r.pos, r.n = dev, off, pos, n
	return nil
}

func (r *run) flush() error {
	if r.n == 0 {
		return nil
	}
	var err error
	if r.write {
		_, err = r.dev.WriteAt(r.p[r.pos:r.pos+r.n], r.off)
	} else {
		_, err = r.dev.ReadAt(r.p[r.pos:r.pos+r.n], r.off)
	}
	r.n = 0
	return err
}

func (s *Snapshot) ReadAt(p []byte, off int64) (int, error) {
	if err := s.check(off, int64(len(p))); err != nil {
		return 0, err
	}
	s.g.mu.RLock()
	defer s.g.mu.RUnlock()
	if err := s.usable(false); err != nil {
		return 0, err
	}
	r := run{p: p}
	chunk := s.st.chunk
	err := pieces(chunk, off, int64(len(p)), func(pc piece) error {
		if n, ok := s.st.lookup(pc.chunk); ok {
			return r.add(s.cow, int64(n)*chunk+pc.in, pc.pos, pc.n)
		}
		return r.add(s.origin, int64(pc.chunk)*chunk+pc.in, pc.pos, pc.n)
	})
	if err == nil {
		err = r.flush()
	}
	if err != nil {
		return 0, err
	}
	return len(p), nil
}

func (s *Snapshot) WriteAt(p []byte, off int64) (int, error) {
	if err := s.check(off, int64(len(p))); err != nil {
		return 0, err
	}
	// Fast path: every chunk already has an exception.
	s.g.mu.RLock()
	err := s.usable(true)
	if err == nil && s.allMapped(off, int64(len(p))) {
		err = s.writeMapped(p, off)
		s.g.mu.RUnlock()
		if err != nil {
			return 0, err
		}
		return len(p), nil
	}
	s.g.mu.RUnlock()
	if err != nil {
		return 0, err
	}

	s.g.mu.Lock()
	defer s.g.mu.Unlock()
	if err := s.usable(true); err != nil {
		return 0, err
	}
	if err := s.writeCopying(p, off); err != nil {
		return 0, err
	}
	return len(p), nil
}

// allMapped reports whether every chunk of [off, off+n) has an exception.
func (s *Snapshot) allMapped(off, n int64) bool {
	if n == 0 {
		return true
	}
	for c := off / s.st.chunk; c <= (off+n-1)/s.st.chunk; c++ {
		if _, ok := s.st.lookup(uint64(c)); !ok {
			return false
		}
	}
	return true
}

func (s *Snapshot) writeMapped(p []byte, off int64) error {
	r := run{p: p, write: true}
	chunk := s.st.chunk
	err := pieces(chunk, off, int64(len(p)), func(pc piece) error {
		n, _ := s.st.lookup(pc.chunk)
		return r.add(s.cow, int64(n)*chunk+pc.in, pc.pos, pc.n)
	})
	if err == nil {
		err = r.flush()
	}
	return err
}

// writeCopying is WriteAt's slow path, with g.mu held for writing.
func (s *Snapshot) writeCopying(p []byte, off int64) error {
	chunk := s.st.chunk
	var fresh []exception
	var buf []byte
	werr := pieces(chunk, off, int64(len(p)), func(pc piece) error {
		data := p[pc.pos : pc.pos+pc.n]
		if n, ok := s.st.lookup(pc.chunk); ok {
			_, err := s.cow.WriteAt(data, int64(n)*chunk+pc.in)
			return err
		}
		n, err := s.st.prepare()
		if err != nil {
			return err
		}
		if pc.n < chunk {
			// Partial chunk: the rest of it comes from the origin.
			if buf == nil {
				buf = make([]byte, chunk)
			}
			if err := s.readOriginChunk(buf, pc.chunk); err != nil {
				return err
			}
			copy(buf[pc.in:], data)
			data = buf
		}
		if err := s.st.writeChunk(data, n); err != nil {
			return err
		}
		fresh = append(fresh, exception{Old: pc.chunk, New: n})
		return nil
	})
	// Commit what was copied even if a later chunk failed, so that no
	// allocated chunk is lost.
	if len(fresh) > 0 {
		if err := s.st.commit(fresh); err != nil {
			return s.invalidate(err)
		}
	}
	switch {
	case werr == nil:
		return nil
	case errors.Is(werr, errFull) && s.opt.Type == PersistentOverflow:
		s.overflowed = true
		return fmt.Errorf("snapshot %s: %w", s.name, ErrOverflow)
	default:
		return s.invalidate(werr)
	}
}

// readOriginChunk reads origin chunk c into buf; a last chunk cut short by
// the end of the origin is padded with zeros (dm copies only what exists).
func (s *Snapshot) readOriginChunk(buf []byte, c uint64) error {
	start := int64(c) * s.st.chunk
	n := min(s.st.chunk, s.origin.Size()-start)
	clear(buf[max(n, 0):])
	if n <= 0 {
		return nil
	}
	_, err := s.origin.ReadAt(buf[:n], start)
	return err
}

// invalidate marks the snapshot invalid after cause (dm's
// __invalidate_snapshot); every later I/O fails. Called with g.mu held.
func (s *Snapshot) invalidate(cause error) error {
	if err := s.st.invalidate(); err != nil {
		cause = errors.Join(cause, err)
	}
	return fmt.Errorf("snapshot %s: %w: %w", s.name, ErrInvalid, cause)
}

// Discard drops the request unless discard_zeroes_cow was given. With it,
// whole chunks that have an exception are zeroed in the COW (so the
// snapshot reads zeros there, not the origin), parts of chunks are
// discarded on the COW, and chunks without exception are left alone:
// discarding them must not trigger a copy-out. discard_passdown_origin
// also discards the origin, without copy-outs to other snapshots, as dm does.
func (s *Snapshot) Discard(off, n int64) error {
	if !s.opt.DiscardZeroesCOW {
		return backing.ErrNotSupported
	}
	if err := s.check(off, n); err != nil {
		return err
	}
	s.g.mu.Lock()
	defer s.g.mu.Unlock()
	if err := s.usable(true); err != nil {
		return err
	}
	chunk := s.st.chunk
	err := pieces(chunk, off, n, func(pc piece) error {
		c, ok := s.st.lookup(pc.chunk)
		if !ok {
			return nil
		}
		at := int64(c)*chunk + pc.in
		if pc.n == chunk {
			return zeroOrWrite(s.cow, at, pc.n)
		}
		if err := s.cow.Discard(at, pc.n); err != nil && !errors.Is(err, backing.ErrNotSupported) {
			return err
		}
		return nil
	})
	if err == nil && s.opt.DiscardPassdownOrigin {
		if err = s.origin.Discard(off, n); errors.Is(err, backing.ErrNotSupported) {
			err = nil
		}
	}
	return err
}

// zeroOrWrite zeroes [off, off+n) on d, writing zeros if d cannot natively.
func zeroOrWrite(d backing.Device, off, n int64) error {
	err := d.Zero(off, n, false)
	if !errors.Is(err, backing.ErrNotSupported) {
		return err
	}
	return backing.WriteZeros(d, off, n)
}
