package mapped

import (
	"slices"
	"sync"

	"github.com/nbdmapper/nbdmapper/backing"
	"github.com/nbdmapper/nbdmapper/discard"
	"github.com/nbdmapper/nbdmapper/table"
)

// Every request walks the active table once, here. Requests reaching these
// methods have been validated at the protocol edge against the size the
// client was told (range, flags, read-only); each is checked again against
// the table it is admitted to.

// WalkExtents bounds the device extents a trim, zeroing or cache request
// holds at once, whatever its length: they walk their range in pieces of
// at most this many extents, and BlockStatus answers for at most this many
// (a prefix of the range, as NBD allows).
const WalkExtents = 1024

// Memory a request's walk may hold, for the server's budget.
const (
	// WalkMemory covers a trim, zeroing or cache walk: WalkExtents
	// extents, the discard engine's copies and plans of them, and a
	// CacheBuffer.
	WalkMemory = WalkExtents*256 + CacheBuffer
	// HolesMemory covers one Holes answer inside BlockStatus: at most one
	// range per 4 KiB block of a holeQuery, and the question a hole map
	// asks the file system meanwhile.
	HolesMemory = holeQuery/4096*16 + backing.HoleQueryMemory
)

// Holes a read reports (ReadSparse), and how many: a hole shorter than
// MinHole is read as data (zeros from the device, or cleared for a zero
// target) unless it is the whole read, and a read reports at most MaxHoles
// holes, reading the rest as data, so that a reply has at most
// 2*MaxHoles+1 chunks and a read makes a bounded number of device reads
// per extent.
const (
	MinHole  = 4096
	MaxHoles = 32
)

// Read fills p from the device at off. On failure it also reports the
// offset of the extent that failed, for a structured reply's ERROR_OFFSET.
// Holes the backing devices know of are cleared rather than read.
func (m *Device) Read(p []byte, off int64) (failed int64, err error) {
	l, err := m.admit(off, int64(len(p)))
	if err != nil {
		return off, err
	}
	defer m.exit()
	_, failed, err = readAt(l.t, p, off, MinHole, MaxHoles, nil, false)
	return failed, err
}

// ReadSparse is Read that leaves holes unread: it appends the holes of
// [off, off+len(p)) to holes (virtual offsets, ascending, none adjacent,
// at most MaxHoles, each at least MinHole unless it is the whole read) and
// leaves their bytes in p as they were; they read as zeros. Holes are zero
// targets and what the backing devices report as holes
// (backing.ReadSparse: a HoleMap's cached holes); error targets fail the
// read as before.
func (m *Device) ReadSparse(p []byte, off int64, holes []backing.Range) (_ []backing.Range, failed int64, err error) {
	l, err := m.admit(off, int64(len(p)))
	if err != nil {
		return holes, off, err
	}
	defer m.exit()
	return readAt(l.t, p, off, MinHole, MaxHoles, holes, true)
}

// ReadAtSparse makes a mapped device below another table a
// backing.SparseReader: the device above reads it sparsely too.
func (m *Device) ReadAtSparse(p []byte, off, minHole int64, maxHoles int, holes []backing.Range) ([]backing.Range, error) {
	l, err := m.admit(off, int64(len(p)))
	if err != nil {
		return holes, err
	}
	defer m.exit()
	holes, _, err = readAt(l.t, p, off, minHole, maxHoles, holes, true)
	return holes, err
}

// readAt reads [off, off+len(p)) of t extent by extent, appending the
// holes it leaves unread to holes. Each extent's holes come in device
// offsets and are moved to virtual ones, joined to a hole that ends where
// they start, so that holes spanning extents (a zero target beside a hole
// in a file, a striped hole) are one; holes that end up shorter than
// minHole are cleared and dropped at the end. Without sparse every hole is
// cleared (in a pooled list, so that a read allocates nothing) and none is
// returned.
func readAt(t *table.Table, p []byte, off, minHole int64, maxHoles int, holes []backing.Range, sparse bool) (_ []backing.Range, failed int64, err error) {
	r := readerPool.Get().(*extentReader)
	if !sparse {
		holes = r.own[:0]
	}
	r.p, r.off, r.minHole, r.max, r.holes, r.first = p, off, minHole, maxHoles, holes, len(holes)
	t.Map(off, int64(len(p)), r.yield)
	holes, failed, err = r.finish(), r.failed, r.err
	if !sparse {
		for _, h := range holes {
			clear(p[h.Off-off : h.End()-off])
		}
		r.own, holes = holes[:0], nil
	}
	*r = extentReader{yield: r.yield, dev: r.dev[:0], own: r.own}
	readerPool.Put(r)
	return holes, failed, err
}

// extentReader carries readAt's state through Table.Map. It is pooled with
// its yield func bound once, so a read allocates no closure.
type extentReader struct {
	p       []byte
	off     int64
	minHole int64
	max     int
	holes   []backing.Range // virtual; holes[first:] are this read's
	first   int
	dev     []backing.Range // one extent's holes, device offsets (reused)
	own     []backing.Range // holes of a read that clears them (reused)
	err     error
	failed  int64
	yield   func(table.Extent) bool
}

var readerPool = sync.Pool{New: func() any {
	r := new(extentReader)
	r.yield = r.read
	return r
}}

func (r *extentReader) read(e table.Extent) bool {
	buf := r.p[e.VOff-r.off : e.VOff-r.off+e.Len]
	switch e.Kind {
	case table.KindMapped:
		room := r.max - (len(r.holes) - r.first)
		r.dev, r.err = backing.ReadSparse(e.Dev, buf, e.Off, r.minHole, room, r.dev[:0])
		for _, h := range r.dev {
			if at := h.Off - e.Off + e.VOff; !r.addHole(at, h.Len) {
				clear(r.p[at-r.off : at-r.off+h.Len]) // not reached: room bounds them
			}
		}
	case table.KindZero:
		if !r.addHole(e.VOff, e.Len) {
			clear(buf)
		}
	case table.KindError:
		r.err = table.ErrTarget
	}
	if r.err != nil {
		r.failed = e.VOff
	}
	return r.err == nil
}

// addHole adds the virtual hole [at, at+n), joining it to the last one if
// that ends at at; false if there is no room for it (it was not added).
func (r *extentReader) addHole(at, n int64) bool {
	if k := len(r.holes) - 1; k >= r.first && r.holes[k].End() == at {
		r.holes[k].Len += n
		return true
	}
	if len(r.holes)-r.first >= r.max {
		return false
	}
	r.holes = append(r.holes, backing.Range{Off: at, Len: n})
	return true
}

// finish clears and drops the holes shorter than minHole, unless one is
// the whole read.
func (r *extentReader) finish() []backing.Range {
	out := r.holes[:r.first]
	for _, h := range r.holes[r.first:] {
		if h.Len < r.minHole && h.Len != int64(len(r.p)) {
			clear(r.p[h.Off-r.off : h.End()-r.off])
			continue
		}
		out = append(out, h)
	}
	return out
}

// Write writes p to the device at off. With fua it returns only once the
// written data is durable on every device it touched.
func (m *Device) Write(p []byte, off int64, fua bool) error {
	l, err := m.admit(off, int64(len(p)))
	if err != nil {
		return err
	}
	defer m.exit()
	return m.writeAt(l.t, p, off, fua)
}

func (m *Device) writeAt(t *table.Table, p []byte, off int64, fua bool) error {
	if fua {
		if handled, err := m.writeFUA(t, p, off); handled {
			return err
		}
	}
	w := writerPool.Get().(*extentWriter)
	w.m, w.p, w.off, w.err = m, p, off, nil
	t.Map(off, int64(len(p)), w.yield)
	err := w.err
	if err == nil && fua {
		err = m.flush.Flush(w.touched)
	}
	clear(w.touched)
	*w = extentWriter{touched: w.touched[:0], yield: w.yield}
	writerPool.Put(w)
	return err
}

// extentWriter is one write's state as the table maps it, pooled (with its
// method value bound once, as extentReader's) so that a write allocates
// nothing of its own.
type extentWriter struct {
	m       *Device
	p       []byte
	off     int64
	err     error
	touched []backing.Device
	yield   func(table.Extent) bool // w.write
}

var writerPool = sync.Pool{New: func() any {
	w := new(extentWriter)
	w.yield = w.write
	return w
}}

func (w *extentWriter) write(e table.Extent) bool {
	switch e.Kind {
	case table.KindMapped:
		w.m.discard.Claim(e.Dev, e.Off, e.Len)
		_, w.err = e.Dev.WriteAt(w.p[e.VOff-w.off:e.VOff-w.off+e.Len], e.Off)
		w.touched = appendUnique(w.touched, e.Dev)
	case table.KindError:
		w.err = table.ErrTarget
	}
	return w.err == nil
}

// writeFUA makes a FUA write that lands on a single mapped extent durable
// by itself (flush.Engine.WriteFUA: RWF_DSYNC where the device can),
// instead of writing it and syncing the device. handled is false when the
// write spans several extents or touches a zero or error target; writeAt
// then writes normally and flushes the devices it touched.
func (m *Device) writeFUA(t *table.Table, p []byte, off int64) (handled bool, err error) {
	ext, ok := oneExtent(t, off, int64(len(p)))
	if !ok {
		return false, nil
	}
	m.discard.Claim(ext.Dev, ext.Off, ext.Len)
	return true, m.flush.WriteFUA(ext.Dev, p, ext.Off)
}

// oneExtent returns the extent [off, off+n) maps to if it is a single
// mapped one (not a zero or error target, not split across lines or
// stripes).
func oneExtent(t *table.Table, off, n int64) (ext table.Extent, ok bool) {
	f := finderPool.Get().(*extentFinder)
	t.Map(off, n, f.yield)
	ext, k := f.ext, f.k
	*f = extentFinder{yield: f.yield}
	finderPool.Put(f)
	return ext, k == 1 && ext.Kind == table.KindMapped
}

// extentFinder is oneExtent's state, pooled with its yield func bound
// once, so that a spliced read or a durable write allocates no closure.
type extentFinder struct {
	ext   table.Extent
	k     int                     // extents seen
	yield func(table.Extent) bool // f.take
}

var finderPool = sync.Pool{New: func() any {
	f := new(extentFinder)
	f.yield = f.take
	return f
}}

// take keeps the first extent and stops at the second.
func (f *extentFinder) take(e table.Extent) bool {
	f.ext = e
	f.k++
	return f.k == 1
}

// Splice moves [off, off+n) into a pipe (see backing.Splicer) when it lies
// on one mapped extent of a device that can splice it and holds no hole
// the device knows of; the caller sends the pipe's contents as the read's
// data. The first len(head) bytes of the range are read into head instead
// (a pipe's room is counted in pages, so a caller splices from a page
// boundary on), under the same table as the rest. ok false means nothing
// moved and the range is to be read (Read, ReadSparse), which also reports
// any error of the request itself. With ok, an error is a read error at
// failed, and the pipe may hold part of the range.
func (m *Device) Splice(pipe int, off, n int64, head []byte) (ok bool, failed int64, err error) {
	l, err := m.admit(off, n)
	if err != nil {
		return false, off, nil
	}
	defer m.exit()
	ext, ok := oneExtent(l.t, off, n)
	if !ok {
		return false, off, nil
	}
	h := int64(len(head))
	if h > 0 {
		if _, failed, err = readAt(l.t, head, off, MinHole, MaxHoles, nil, false); err != nil {
			return true, failed, err
		}
	}
	ok, err = backing.Splice(ext.Dev, pipe, ext.Off+h, int(n-h))
	return ok, off + h, err
}

// Flush makes every write completed before the call durable.
func (m *Device) Flush() error {
	l, err := m.enter()
	if err != nil {
		return err
	}
	defer m.exit()
	if m.PerSegmentFlush {
		var each []backing.Device
		for _, ln := range l.t.Lines {
			each = append(each, ln.Target.Devices()...)
		}
		return m.flush.SyncEach(each)
	}
	devs := m.devices(l)
	if lost := m.unsyncedDevices(); lost != nil {
		devs = append(slices.Clone(devs), lost...)
	}
	return m.flush.Flush(devs)
}

// Trim discards [off, off+n): zero targets drop it, error targets fail it.
func (m *Device) Trim(off, n int64, fua bool) error {
	l, err := m.admit(off, n)
	if err != nil {
		return err
	}
	defer m.exit()
	err = walk(l.t, off, n, func(exts []discard.Extent, more bool) error {
		if more {
			// Other trims could only join this piece by holding up the
			// rest of the request: issue it at once.
			return m.discard.DiscardNow(exts)
		}
		return m.discard.Discard(exts)
	})
	return m.fua(l, fua, err)
}

// WriteZeroes makes [off, off+n) read as zeros; see discard.Engine.Zero.
func (m *Device) WriteZeroes(off, n int64, mayPunch, fast, fua bool) error {
	l, err := m.admit(off, n)
	if err != nil {
		return err
	}
	defer m.exit()
	err = walk(l.t, off, n, func(exts []discard.Extent, _ bool) error {
		for _, e := range exts {
			m.discard.Claim(e.Dev, e.Off, e.Len)
		}
		return m.discard.Zero(exts, mayPunch, fast)
	})
	return m.fua(l, fua, err)
}

// fua makes a completed trim or zeroing durable. It flushes every device
// below rather than remembering which ones a long request touched: the
// flush engine skips devices that are clean.
func (m *Device) fua(l *live, fua bool, err error) error {
	if !fua || err != nil {
		return err
	}
	return m.flush.Flush(m.devices(l))
}

// Cache asks the backing devices to bring [off, off+n) into their caches
// (the page cache, for files): natively where a device can (readahead,
// which returns before the data is read, so an unreadable block shows only
// on a later read), otherwise by reading through a CacheBuffer and dropping
// the data, which fails where a read would. Error targets fail it either
// way.
func (m *Device) Cache(off, n int64) error {
	l, err := m.admit(off, n)
	if err != nil {
		return err
	}
	defer m.exit()
	var bp *[]byte
	defer func() {
		if bp != nil {
			bufPool.Put(bp)
		}
	}()
	return walk(l.t, off, n, func(exts []discard.Extent, _ bool) error {
		// Sorted and merged per device, as a zeroing would be: a piece
		// of a table whose segments alternate between two files is then
		// two calls, not a thousand.
		for _, dp := range discard.PlanZero(exts).Devices {
			for _, r := range dp.Calls {
				if bp == nil {
					bp = bufPool.Get().(*[]byte)
				}
				if err := backing.Cache(dp.Dev, r.Off, r.Len, *bp); err != nil {
					return err
				}
			}
		}
		return nil
	})
}

// CacheBuffer is the buffer Cache reads through on devices that cannot
// read ahead natively.
const CacheBuffer = 128 << 10

// Pools for walks and Cache's read-through buffer: steady trims and
// caches allocate nothing.
var (
	walkerPool = sync.Pool{New: func() any {
		w := &walker{exts: make([]discard.Extent, 0, WalkExtents)}
		w.yieldFn = w.yield // bound once: a method value escapes into the table
		return w
	}}
	bufPool = sync.Pool{New: func() any { b := make([]byte, CacheBuffer); return &b }}
)

// walk covers [off, off+n) of t with device extents (Table.Cover: any
// order, adjacent pieces joined), dropping zero-target parts and failing on
// error-target parts, and hands them to fn in pieces of at most
// WalkExtents; more says that another piece may follow. Pieces before an
// error target have been handed over when walk fails on it.
func walk(t *table.Table, off, n int64, fn func(exts []discard.Extent, more bool) error) error {
	w := walkerPool.Get().(*walker)
	w.exts, w.fn, w.err = w.exts[:0], fn, nil
	t.Cover(off, n, w.yieldFn)
	err := w.err
	if err == nil && len(w.exts) > 0 {
		err = fn(w.exts, false)
	}
	w.fn = nil
	walkerPool.Put(w)
	return err
}

// walker is one walk's state.
type walker struct {
	exts    []discard.Extent
	fn      func(exts []discard.Extent, more bool) error
	err     error
	yieldFn func(table.Extent) bool // w.yield
}

func (w *walker) yield(e table.Extent) bool {
	switch e.Kind {
	case table.KindMapped:
		w.exts = append(w.exts, discard.Extent{Dev: e.Dev, Off: e.Off, Len: e.Len})
		if len(w.exts) == WalkExtents {
			w.err = w.fn(w.exts, true)
			w.exts = w.exts[:0]
		}
	case table.KindError:
		w.err = table.ErrTarget
	}
	return w.err == nil
}

// Status flags of a block status extent (NBD base:allocation).
const (
	StateHole uint32 = 1 << 0
	StateZero uint32 = 1 << 1
)

// BlockExtent is one base:allocation extent: Len bytes with Flags.
type BlockExtent struct {
	Len   int64
	Flags uint32
}

// holeQuery bounds the range one Device.Holes call is asked about, so that
// a fragmented file cannot make one call return an unbounded list.
const holeQuery = 64 << 20

// BlockStatus describes the allocation of [off, off+n) as consecutive
// extents starting at off, appended to out: holes in backing files and
// zero targets are hole+zero, everything else is data. It stops at limit
// extents (0: no limit) and after WalkExtents table extents; the extents
// then cover a prefix of the range, which NBD allows (REQ_ONE asks for
// limit 1).
func (m *Device) BlockStatus(off, n int64, limit int, out []BlockExtent) ([]BlockExtent, error) {
	l, err := m.admit(off, n)
	if err != nil {
		return out, err
	}
	defer m.exit()
	return blockStatus(l.t, off, n, limit, out)
}

func blockStatus(t *table.Table, off, n int64, limit int, out []BlockExtent) ([]BlockExtent, error) {
	var err error
	full := false
	add := func(length int64, flags uint32) {
		if full {
			return
		}
		if k := len(out) - 1; k >= 0 && out[k].Flags == flags {
			out[k].Len += length
			return
		}
		if limit > 0 && len(out) == limit {
			full = true
			return
		}
		out = append(out, BlockExtent{Len: length, Flags: flags})
	}
	walked := 0
	t.Map(off, n, func(e table.Extent) bool {
		switch e.Kind {
		case table.KindZero:
			add(e.Len, StateHole|StateZero)
		case table.KindError:
			add(e.Len, 0)
		case table.KindMapped:
			end := e.Off + e.Len
			for q := e.Off; q < end && !full && err == nil; q += holeQuery {
				qEnd := min(end, q+holeQuery)
				var holes []backing.Range
				holes, err = e.Dev.Holes(q, qEnd-q)
				pos := q
				for _, h := range holes {
					if h.Off > pos {
						add(h.Off-pos, 0)
					}
					add(h.Len, StateHole|StateZero)
					pos = h.End()
				}
				if pos < qEnd {
					add(qEnd-pos, 0)
				}
			}
		}
		walked++
		return err == nil && !full && walked < WalkExtents
	})
	return out, err
}

func appendUnique(devs []backing.Device, d backing.Device) []backing.Device {
	for _, have := range devs {
		if have == d {
			return devs
		}
	}
	return append(devs, d)
}
