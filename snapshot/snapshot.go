package snapshot

import (
	"errors"
	"fmt"
	"sync"

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
	// Merge makes a snapshot-merge device: it merges the COW back into the
	// origin once activated (see merge.go). P and PO stores only.
	Merge bool
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
//	chunk 0: no exception: allocate COW chunk 3 (pending), copy origin
//	         [0, 3K) into it, write [3K, 4K) of the request
//	chunk 1: exception: write [4K, 8K) to COW chunk 2 in place
//	chunk 2: no exception: allocate COW chunk 4, write [8K, 9K), copy
//	         origin [9K, 12K)
//	then commit {0 -> 3, 2 -> 4} (persistent: sync, metadata, sync),
//	together with whatever other writers have ready, and only then return.
//
// Reads and writes to chunks that have an exception take the snapshot's
// mutex only to look the chunks up: they never wait for a commit.
type Snapshot struct {
	name   string
	id     backing.ID
	origin backing.Device
	cow    backing.Device
	opt    Options
	size   int64
	g      *group

	mu   sync.Mutex
	cond sync.Cond // a commit finished, pending exceptions went, I/O drained, a merge step ended

	// Guarded by mu.
	st         *store
	active     bool // copy-outs reach it; false for a handover destination until Activate
	overflowed bool
	closed     bool
	inflight   int // reads and writes running outside mu
	pending    map[uint64]*pending
	queue      []*pending // pending exceptions not yet committed, in allocation order
	committing bool

	handover // handover.go
	merge    // merge.go
}

var _ backing.Device = (*Snapshot)(nil)

// Open loads the snapshot of origin whose exceptions live on cow, reading
// or initialising the exception store, and registers it with every other
// snapshot and snapshot-origin device of the same origin (by backing.ID).
// name is for logs. Close unregisters it; it does not close origin or cow.
//
// A COW device that another loaded snapshot uses makes the new one a
// handover destination, as in dm: it reads nothing now, and takes the
// other one's exceptions when activated (Activate), which leaves the
// other one invalid. lvconvert --merge loads a snapshot-merge table on
// the COW of the snapshot being merged this way.
func Open(name string, origin, cow backing.Device, opt Options) (*Snapshot, error) {
	if origin.ID() == cow.ID() {
		return nil, ErrSameDevice
	}
	if opt.DiscardPassdownOrigin && !opt.DiscardZeroesCOW {
		return nil, errors.New("discard_passdown_origin feature depends on discard_zeroes_cow")
	}
	if opt.Merge && opt.Type == Transient {
		return nil, ErrMergeStore
	}
	size := opt.Size
	if size == 0 {
		size = origin.Size() &^ 511
	}
	if size < 0 || size > origin.Size() {
		return nil, fmt.Errorf("snapshot size %d beyond the origin's %d bytes", size, origin.Size())
	}
	s := &Snapshot{name: name, id: newStackedID(), origin: origin, cow: cow, opt: opt, size: size}
	s.cond.L = &s.mu
	s.g = groupOf(origin.ID())
	src, err := claimCOW(s)
	if err != nil {
		releaseGroup(s.g)
		return nil, err
	}
	if src == nil {
		st, err := openStore(cow, opt.Type, opt.ChunkSectors)
		if err != nil {
			releaseCOW(s)
			releaseGroup(s.g)
			return nil, err
		}
		s.st = st
		s.active = true
	} else {
		// Nothing is read until the handover; until then the snapshot
		// fails its I/O and prints the table's chunk size.
		s.st = &store{typ: opt.Type, chunkSectors: opt.ChunkSectors, chunk: int64(opt.ChunkSectors) * 512}
	}
	s.g.add(s)
	return s, nil
}

func (s *Snapshot) Name() string           { return s.name }
func (s *Snapshot) ID() backing.ID         { return s.id }
func (s *Snapshot) Size() int64            { return s.size }
func (s *Snapshot) Origin() backing.Device { return s.origin }
func (s *Snapshot) COW() backing.Device    { return s.cow }

// Sync makes the snapshot's completed writes durable: they are on the COW
// device, and, while merging, on the origin too.
func (s *Snapshot) Sync() error {
	if s.opt.Merge {
		return errors.Join(s.cow.Sync(), s.origin.Sync())
	}
	return s.cow.Sync()
}

// Devices lists the devices the snapshot reads or writes: COW and origin.
func (s *Snapshot) Devices() []backing.Device { return []backing.Device{s.cow, s.origin} }

// Type is the store type; ChunkSectors the chunk size in use (the on-disk
// one for an existing persistent store).
func (s *Snapshot) Type() Type { return s.opt.Type }

func (s *Snapshot) ChunkSectors() uint32 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.st.chunkSectors
}

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

// Status is the line `dmsetup status` prints for the target, with dm's
// precedence: "Invalid", "Merge failed", "Overflow", or
// "<sectors_allocated>/<total_sectors> <metadata_sectors>". A merging
// snapshot's numbers fall as the merge proceeds; it is done when the
// allocated sectors equal the metadata sectors.
func (s *Snapshot) Status() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	switch {
	case !s.st.valid || s.handedOver:
		return "Invalid"
	case s.mergeFailed:
		return "Merge failed"
	case s.overflowed:
		return "Overflow"
	}
	a, t, m := s.st.usage()
	return fmt.Sprintf("%d/%d %d", a, t, m)
}

// Limits: with discard_zeroes_cow discards are cut to whole chunks, as dm
// sets discard_granularity and max_discard_sectors to the chunk size.
func (s *Snapshot) Limits() backing.Limits {
	if s.opt.DiscardZeroesCOW && !s.opt.Merge {
		chunk := int64(s.ChunkSectors()) * 512
		return backing.Limits{Granularity: chunk, MaxBytes: chunk}
	}
	return backing.Limits{Granularity: 512}
}

// Zero is not native: the caller writes zeros, which go through WriteAt's
// copy-on-write like any other data.
func (s *Snapshot) Zero(off, n int64, mayPunch bool) error { return backing.ErrNotSupported }

// Close stops a merge, unregisters the snapshot from its origin and frees
// its COW device; later I/O fails. A handover waiting for it is cancelled.
func (s *Snapshot) Close() error {
	s.stopMerge()
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil
	}
	s.closed = true
	s.mu.Unlock()
	s.g.remove(s)
	releaseGroup(s.g)
	releaseCOW(s)
	return nil
}

func (s *Snapshot) check(off, n int64) error {
	if off < 0 || n < 0 || off > s.size || n > s.size-off {
		return fmt.Errorf("snapshot %s: range [%d, %d) outside %d bytes", s.name, off, off+n, s.size)
	}
	return nil
}

// usableLocked reports why I/O must fail, if it must. Called with s.mu held.
func (s *Snapshot) usableLocked(write bool) error {
	switch {
	case s.closed:
		return fmt.Errorf("snapshot %s: closed: %w", s.name, ErrInvalid)
	case s.handedOver:
		return fmt.Errorf("snapshot %s: handed over to another table: %w", s.name, ErrInvalid)
	case !s.active:
		return fmt.Errorf("snapshot %s: not active (awaiting handover): %w", s.name, ErrInvalid)
	case !s.st.valid:
		return fmt.Errorf("snapshot %s: %w", s.name, ErrInvalid)
	case write && s.overflowed:
		return fmt.Errorf("snapshot %s: %w", s.name, ErrOverflow)
	}
	return nil
}

// exit ends I/O counted in inflight.
func (s *Snapshot) exit() {
	s.mu.Lock()
	if s.inflight--; s.inflight == 0 {
		s.cond.Broadcast()
	}
	s.mu.Unlock()
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

// op is one device call of a request, planned under s.mu and issued
// outside it: n bytes at pos of the request buffer, at off on dev. fill,
// when set, is the pending exception of a chunk this op starts; the parts
// of the chunk the op does not cover are copied from the origin first.
type op struct {
	dev    backing.Device
	off    int64
	pos, n int64
	fill   *pending
	in     int64 // the op's offset inside its chunk (fill only)
}

// plan is a request's ops. Consecutive ops that are consecutive on the
// same device are joined, so a read of a run of chunks is one call.
type plan struct{ ops []op }

var planPool = sync.Pool{New: func() any { return &plan{ops: make([]op, 0, 16)} }}

func getPlan() *plan { return planPool.Get().(*plan) }

func putPlan(p *plan) {
	if cap(p.ops) > 1024 {
		return
	}
	clear(p.ops)
	p.ops = p.ops[:0]
	planPool.Put(p)
}

func (p *plan) add(dev backing.Device, off, pos, n int64) {
	if k := len(p.ops) - 1; k >= 0 {
		if l := &p.ops[k]; l.fill == nil && l.dev == dev && l.off+l.n == off && l.pos+l.n == pos {
			l.n += n
			return
		}
	}
	p.ops = append(p.ops, op{dev: dev, off: off, pos: pos, n: n})
}

// run issues the ops of a read (write false) or a write. A fill op's
// failure is recorded in its pending exception (it fails the commit and
// invalidates the snapshot, as a failed copy does in dm) and the other ops
// still run; the first error of any op is returned.
func (s *Snapshot) run(pl *plan, p []byte, write bool) error {
	var first error
	for i := range pl.ops {
		o := &pl.ops[i]
		var err error
		if o.fill != nil {
			err = s.fillChunk(o, p[o.pos:o.pos+o.n])
			o.fill.err = err
		} else {
			err = backing.Guard(o.dev.Name(), onPanic(), func() error {
				if write {
					_, err := o.dev.WriteAt(p[o.pos:o.pos+o.n], o.off)
					return err
				}
				_, err := o.dev.ReadAt(p[o.pos:o.pos+o.n], o.off)
				return err
			})
		}
		if err != nil && first == nil {
			first = err
		}
	}
	return first
}

// fillChunk writes data into the fresh COW chunk of o, copying the rest of
// the chunk from the origin (the pending exception keeps the origin chunk
// still meanwhile).
func (s *Snapshot) fillChunk(o *op, data []byte) error {
	chunk := s.st.chunk
	start := int64(o.fill.old) * chunk
	cowAt := int64(o.fill.new) * chunk
	return backing.Guard(s.cow.Name(), onPanic(), func() error {
		if chunk <= copyBuffer && int64(len(data)) < chunk {
			// One read and one write: the origin chunk, overlaid.
			bp := copyPool.Get().(*[]byte)
			defer copyPool.Put(bp)
			buf := (*bp)[:chunk]
			k := max(min(chunk, s.origin.Size()-start), 0)
			clear(buf[k:])
			if k > 0 {
				if _, err := s.origin.ReadAt(buf[:k], start); err != nil {
					return err
				}
			}
			copy(buf[o.in:], data)
			_, err := s.cow.WriteAt(buf, cowAt)
			return err
		}
		if err := s.copyOrigin(cowAt, start, o.in); err != nil {
			return err
		}
		if _, err := s.cow.WriteAt(data, cowAt+o.in); err != nil {
			return err
		}
		tail := o.in + int64(len(data))
		return s.copyOrigin(cowAt+tail, start+tail, chunk-tail)
	})
}

// copyOrigin copies n bytes of the origin at from to the COW at to, in
// pieces of one pooled buffer; what lies past the origin's end is not
// copied (dm copies only what exists).
func (s *Snapshot) copyOrigin(to, from, n int64) error {
	n = min(n, s.origin.Size()-from)
	if n <= 0 {
		return nil
	}
	return copyRange(s.cow, to, s.origin, from, n)
}

// copyBuffer is the most one copy (a copy-out, a fill, a merge piece)
// holds at once, whatever the chunk size.
const copyBuffer = 256 << 10

// CopyMemory is what one request holds here beyond its own buffer while
// it copies a chunk (a first write's fill, an origin's copy-outs, which
// run one at a time): one copy buffer. The server charges it to the
// memory budget of every request of an export with snapshot targets.
const CopyMemory = copyBuffer

var copyPool = sync.Pool{New: func() any { b := make([]byte, copyBuffer); return &b }}

// copyRange copies n bytes from src at from to dst at to.
func copyRange(dst backing.Device, to int64, src backing.Device, from, n int64) error {
	bp := copyPool.Get().(*[]byte)
	defer copyPool.Put(bp)
	buf := *bp
	for done := int64(0); done < n; {
		k := min(int64(len(buf)), n-done)
		if _, err := src.ReadAt(buf[:k], from+done); err != nil {
			return err
		}
		if _, err := dst.WriteAt(buf[:k], to+done); err != nil {
			return err
		}
		done += k
	}
	return nil
}

func (s *Snapshot) ReadAt(p []byte, off int64) (int, error) {
	if err := s.check(off, int64(len(p))); err != nil {
		return 0, err
	}
	pl := getPlan()
	defer putPlan(pl)
	s.mu.Lock()
	if err := s.usableLocked(false); err != nil {
		through := s.passThroughLocked()
		s.mu.Unlock()
		if through {
			return s.origin.ReadAt(p, off)
		}
		return 0, err
	}
	// The part read from the origin is tracked, so that a copy-out
	// committed meanwhile waits for this read before the origin changes.
	lo, hi := int64(-1), int64(-1)
	chunk := s.st.chunk
	pieces(chunk, off, int64(len(p)), func(pc piece) error {
		if n, ok := s.st.lookup(pc.chunk); ok {
			pl.add(s.cow, int64(n)*chunk+pc.in, pc.pos, pc.n)
			return nil
		}
		at := int64(pc.chunk)*chunk + pc.in
		if lo < 0 {
			lo = at
		}
		hi = at + pc.n
		pl.add(s.origin, at, pc.pos, pc.n)
		return nil
	})
	var id uint64
	if lo >= 0 {
		id = s.g.reads.add(lo, hi)
	}
	s.inflight++
	s.mu.Unlock()
	defer s.exit()
	if id != 0 {
		defer s.g.reads.done(id)
	}
	if err := s.run(pl, p, false); err != nil {
		return 0, err
	}
	return len(p), nil
}

func (s *Snapshot) WriteAt(p []byte, off int64) (int, error) {
	if err := s.check(off, int64(len(p))); err != nil {
		return 0, err
	}
	if len(p) == 0 {
		// No chunk to claim: [off, off-1] would be taken for the chunk
		// holding off, which would get an exception with no copy in it.
		return 0, nil
	}
	if s.opt.Merge {
		return s.mergeWrite(p, off)
	}
	for {
		done, err := s.write(p, off)
		if done {
			if err != nil {
				return 0, err
			}
			return len(p), nil
		}
	}
}

// write is one attempt at WriteAt; done is false when a chunk of the write
// had a pending exception, which write waited for: try again.
func (s *Snapshot) write(p []byte, off int64) (done bool, err error) {
	pl := getPlan()
	defer putPlan(pl)
	s.mu.Lock()
	if err := s.usableLocked(true); err != nil {
		s.mu.Unlock()
		return true, err
	}
	chunk := s.st.chunk
	first, last := uint64(off/chunk), uint64((off+int64(len(p))-1)/chunk)
	busy, fresh, ferr := s.claimLocked(first, last)
	if busy != nil {
		s.mu.Unlock()
		<-busy.removed
		return false, nil
	}
	// Plan up to the first chunk that could not be allocated.
	next := 0
	pieces(chunk, off, int64(len(p)), func(pc piece) error {
		if n, ok := s.st.lookup(pc.chunk); ok {
			pl.add(s.cow, int64(n)*chunk+pc.in, pc.pos, pc.n)
			return nil
		}
		if next == len(fresh) || fresh[next].old != pc.chunk {
			return errFull
		}
		f := fresh[next]
		next++
		pl.ops = append(pl.ops, op{dev: s.cow, off: int64(f.new)*chunk + pc.in, pos: pc.pos, n: pc.n, fill: f, in: pc.in})
		return nil
	})
	s.inflight++
	s.mu.Unlock()
	defer s.exit()

	werr := s.run(pl, p, true)
	s.readyAll(fresh)
	cerr := s.awaitCommit(fresh)
	s.release(fresh)
	switch {
	case cerr != nil:
		return true, cerr
	case ferr != nil:
		return true, s.full(ferr)
	}
	return true, werr
}

// full handles a snapshot write that found the COW full: PO overflows
// (writes fail, reads go on), P and N invalidate.
func (s *Snapshot) full(cause error) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.opt.Type == PersistentOverflow {
		s.overflowed = true
		return fmt.Errorf("snapshot %s: %w", s.name, ErrOverflow)
	}
	return s.invalidateLocked(cause)
}

// invalidateLocked marks the snapshot invalid after cause (dm's
// __invalidate_snapshot); every later I/O fails. For a persistent store
// the header is rewritten with valid = 0. Called with s.mu held.
func (s *Snapshot) invalidateLocked(cause error) error {
	if s.st.valid {
		if err := s.st.invalidate(); err != nil {
			cause = errors.Join(cause, err)
		}
	}
	return fmt.Errorf("snapshot %s: %w: %w", s.name, ErrInvalid, cause)
}

// Discard drops the request unless discard_zeroes_cow was given. With it,
// whole chunks that have an exception are zeroed in the COW (so the
// snapshot reads zeros there, not the origin), parts of chunks are
// discarded on the COW, and chunks without exception are left alone:
// discarding them must not trigger a copy-out. discard_passdown_origin
// also discards the origin, without copy-outs to other snapshots, as dm
// does. A merging snapshot drops discards: dm's "once merging, discards no
// longer effect change".
func (s *Snapshot) Discard(off, n int64) error {
	if s.opt.Merge {
		return nil
	}
	if !s.opt.DiscardZeroesCOW {
		return backing.ErrNotSupported
	}
	if err := s.check(off, n); err != nil {
		return err
	}
	if n == 0 {
		return nil
	}
	type call struct{ at, n int64 }
	var calls []call
	for {
		s.mu.Lock()
		if err := s.usableLocked(true); err != nil {
			s.mu.Unlock()
			return err
		}
		chunk := s.st.chunk
		var busy *pending
		for c := uint64(off / chunk); c <= uint64((off+n-1)/chunk) && busy == nil; c++ {
			busy = s.pending[c]
		}
		if busy != nil {
			s.mu.Unlock()
			<-busy.removed
			continue
		}
		pieces(chunk, off, n, func(pc piece) error {
			if c, ok := s.st.lookup(pc.chunk); ok {
				calls = append(calls, call{int64(c)*chunk + pc.in, pc.n})
			}
			return nil
		})
		s.inflight++
		s.mu.Unlock()
		break
	}
	defer s.exit()
	chunk := int64(s.ChunkSectors()) * 512
	for _, c := range calls {
		var err error
		if c.n == chunk {
			err = zeroOrWrite(s.cow, c.at, c.n)
		} else if err = s.cow.Discard(c.at, c.n); errors.Is(err, backing.ErrNotSupported) {
			err = nil
		}
		if err != nil {
			return err
		}
	}
	if s.opt.DiscardPassdownOrigin {
		if err := s.origin.Discard(off, n); err != nil && !errors.Is(err, backing.ErrNotSupported) {
			return err
		}
	}
	return nil
}

// zeroOrWrite zeroes [off, off+n) on d, writing zeros if d cannot natively.
func zeroOrWrite(d backing.Device, off, n int64) error {
	err := d.Zero(off, n, false)
	if !errors.Is(err, backing.ErrNotSupported) {
		return err
	}
	return backing.WriteZeros(d, off, n)
}

// holeBlock is the smallest hole Holes reports: a hole piece left between
// chunks with exceptions that is smaller is reported as data, which is
// always safe, and keeps an answer to at most one range per 4 KiB (the
// bound mapped.HolesMemory assumes).
const holeBlock = 4096

// Holes reports where the snapshot reads zeros because nothing was ever
// allocated: the origin's holes, less the chunks that have an exception
// (their data is on the COW, whatever it holds). Block status on a
// snapshot therefore shows holes where both the COW has no exception and
// the origin has a hole.
//
//	origin     [hole.................][data][hole......]
//	exceptions        [c2]                       [c7]
//	Holes      [hole ][c2][hole......][data][hole][c7]
func (s *Snapshot) Holes(off, n int64) ([]backing.Range, error) {
	if err := s.check(off, n); err != nil {
		return nil, err
	}
	holes, err := s.origin.Holes(off, n)
	if err != nil || len(holes) == 0 {
		return nil, err
	}
	s.mu.Lock()
	if err := s.usableLocked(false); err != nil {
		through := s.passThroughLocked()
		s.mu.Unlock()
		if through {
			return holes, nil
		}
		return nil, nil
	}
	chunk := s.st.chunk
	s.mu.Unlock()
	var out []backing.Range
	emit := func(lo, hi int64) {
		if chunk < holeBlock {
			lo, hi = (lo+holeBlock-1)&^(holeBlock-1), hi&^(holeBlock-1)
		}
		if hi > lo {
			out = append(out, backing.Range{Off: lo, Len: hi - lo})
		}
	}
	for _, h := range holes {
		lo, hi := max(h.Off, off), min(h.End(), off+n)
		start := lo // start of the hole piece being built
		// Look the chunks up a slice at a time, so that a long hole does
		// not hold the snapshot's mutex for long.
		for c := lo / chunk; c*chunk < hi; {
			s.mu.Lock()
			for k := 0; k < 4096 && c*chunk < hi; k, c = k+1, c+1 {
				if _, ok := s.st.lookup(uint64(c)); ok {
					emit(start, max(start, c*chunk))
					start = min(hi, (c+1)*chunk)
				}
			}
			s.mu.Unlock()
		}
		emit(start, hi)
	}
	return out, nil
}
