package backing

import (
	"math/bits"
	"sync"
)

// HoleMap is a device with a cache of its holes in front: the answers of
// the inner device's Holes (SEEK_HOLE/SEEK_DATA for a file), kept per 256
// KiB chunk as one bit per 4 KiB granule, so that a read can skip the holes
// it covers (ReadAtSparse) and a block status costs no system call for
// chunks asked about before. A Pool installs one in front of every regular
// file it opens, under every other wrapper, so that every segment, export
// and engine of the server shares it and every change of the file passes
// through it.
//
// Exactness. A stale hole over written data would be data loss; a stale
// "data" costs only a read. So a write clears the hole bits it covers
// before it is issued, and an answer of the device is kept only if no
// write to its chunk is in flight when it is kept and no change of the
// chunk completed since it was asked. Every chunk maps to a slot, and each
// slot counts the writes in flight to its chunks and a generation bumped
// whenever a write, discard or zeroing of one of them completes:
//
//	WriteAt, Zero before: clear the chunk's hole bits under the range, writing++
//	              after:  writing--, gen++ (Zero: forget the chunk, unknown)
//	Discard       after:  learn the granules it punched, or forget, gen++
//	query         read the slots' gens, ask the device (no lock held), then
//	              keep the answer only if gen is unchanged and writing == 0
//
// A query that ran while a write to its chunk was in flight, or that a
// write completed during, is used for the read that asked (the two were
// concurrent, so either answer is allowed) but not kept. A read that
// starts after a write was acknowledged finds the chunk as data, or
// unknown, or asks the device, which has the data by then.
//
// Discards. A discard or a zeroing that may punch, of a range the map
// knows to be holes only, changes nothing on the device and is answered
// without it (the file system would only walk its extents to find nothing
// to free); so a second trim of a range, fstrim's after a remount or a
// trim of holes a read or block status asked about before cost no system
// call (the first trim of a range the map does not know still punches). A
// discard that reached the device
// makes its whole granules holes in the map afterwards, if the device's
// discards leave zeros (Limits.DiscardZeroes) and no write or zeroing of
// the device was in flight at any time while it ran (changing and changes,
// one pair for the whole map: a punch racing a write to the same granule
// may land before or after it, and only the device knows which). Otherwise,
// and after a discard that failed or panicked, it forgets its chunks and
// the next read asks. A skipped discard or zeroing still counts as a change
// for the flush engine above (it dirties the device), so a flush after it
// syncs whatever punch made the hole.
//
// Memory. The slots are a direct-mapped table of at most 8192 entries
// (24 bytes each, 192 KiB, covering 2 GiB of a device without collisions),
// allocated at once. A chunk whose slot another chunk takes becomes unknown
// again (never a hole); so whatever the file's fragmentation and whatever
// clients read, the map holds the same bytes.
//
// Granularity. A granule is a hole only if all of it is (the last one may
// be shorter, ending at the device's end): holes smaller than 4 KiB, or
// not aligned to it, read as data, which is always safe.
type HoleMap struct {
	Device

	size int64
	mask int64 // len(slots) - 1

	learn bool // the device's discards leave holes (Limits.DiscardZeroes)

	mu       sync.Mutex
	slots    []holeSlot
	changing int    // writes and zeroings in flight, on any chunk
	changes  uint64 // writes and zeroings begun or ended
	st       HoleMapStats
}

var _ Device = (*HoleMap)(nil)

// holeSlot is one entry of the direct-mapped table. writing and gen count
// for every chunk that maps to the slot, known or not, so that a query for
// any of them sees changes to any of them (a collision costs at most a
// refused answer).
type holeSlot struct {
	chunk   int64  // index of the chunk known here, plus 1; 0: none
	holes   uint64 // bit i: granule i of the chunk is a hole
	gen     uint32 // changes of the slot's chunks completed
	writing uint32 // writes to the slot's chunks in flight
}

const (
	holeGranule  = 4096
	holeGranules = 64 // per chunk: one uint64 of bits
	holeChunk    = holeGranule * holeGranules
	holeSlotsMax = 8192
	holeQueryMax = 16 // chunks per Holes call on the device (4 MiB)
	allHoles     = ^uint64(0)
)

// HoleQueryMemory bounds what one question to the inner device holds: its
// answer for at most holeQueryMax chunks (4 MiB), at most one range per 1
// KiB (holes and data alternating in 512-byte blocks), 16 bytes each.
const HoleQueryMemory = holeQueryMax * holeChunk / 1024 * 16

// HoleMapStats counts what a HoleMap did.
type HoleMapStats struct {
	Hits     uint64 // chunks answered from the map
	Misses   uint64 // chunks the device was asked about
	Queries  uint64 // Holes calls on the device
	Refused  uint64 // chunk answers not kept: a write was in flight or a change completed meanwhile
	Forgot   uint64 // known chunks forgotten after a discard or zeroing
	Skipped  uint64 // discards and zeroings of known holes, not sent to the device
	Learned  uint64 // chunks whose holes a completed discard added to the map
	Ahead    uint64 // chunks kept as data past a question's range (dataAhead)
	Evicted  uint64 // known chunks replaced by another chunk's answer
	Errors   uint64 // Holes calls that failed (the chunks then read as data)
	Slots    int    // capacity in chunks
	Known    int    // chunks known now
	Bytes    int64  // memory of the table
	Granule  int64  // hole resolution in bytes
	ChunkLen int64  // bytes of device per slot
}

// NewHoleMap puts a hole map in front of d. Every change of d must go
// through the HoleMap from then on.
func NewHoleMap(d Device) *HoleMap {
	size := d.Size()
	chunks := max((size+holeChunk-1)/holeChunk, 1)
	n := int64(1)
	for n < chunks && n < holeSlotsMax {
		n <<= 1
	}
	return &HoleMap{Device: d, size: size, mask: n - 1, slots: make([]holeSlot, n), learn: d.Limits().DiscardZeroes}
}

// Unwrap returns the inner device, for operations that do not change it.
func (h *HoleMap) Unwrap() Device { return h.Device }

// HoleMapOf returns the HoleMap d is, or wraps (through Wrapper), or nil.
func HoleMapOf(d Device) *HoleMap {
	for d != nil {
		if h, ok := d.(*HoleMap); ok {
			return h
		}
		w, ok := d.(Wrapper)
		if !ok {
			return nil
		}
		d = w.Unwrap()
	}
	return nil
}

// Stats returns the map's counters and occupancy.
func (h *HoleMap) Stats() HoleMapStats {
	h.mu.Lock()
	defer h.mu.Unlock()
	st := h.st
	for i := range h.slots {
		if h.slots[i].chunk != 0 {
			st.Known++
		}
	}
	st.Slots = len(h.slots)
	st.Bytes = int64(len(h.slots)) * 24
	st.Granule, st.ChunkLen = holeGranule, holeChunk
	return st
}

func (h *HoleMap) WriteAt(p []byte, off int64) (int, error) {
	h.begin(off, int64(len(p)))
	defer h.end(off, int64(len(p)))
	return h.Device.WriteAt(p, off)
}

// WriteAtDSync is the inner device's durable write (see flush.DSyncWriter),
// marked like WriteAt; ErrNotSupported, having written nothing, where the
// inner device has none.
func (h *HoleMap) WriteAtDSync(p []byte, off int64) (int, error) {
	w, ok := h.Device.(interface {
		WriteAtDSync(p []byte, off int64) (int, error)
	})
	if !ok {
		return 0, ErrNotSupported
	}
	h.begin(off, int64(len(p)))
	defer h.end(off, int64(len(p)))
	return w.WriteAtDSync(p, off)
}

// Discard punches [off, off+n) unless the map knows it is all holes, and
// learns what the punch did (see the type's comment).
func (h *HoleMap) Discard(off, n int64) error {
	h.mu.Lock()
	if h.skips(off, n) {
		h.mu.Unlock()
		return nil
	}
	quiet, changes := h.changing == 0, h.changes
	h.mu.Unlock()
	punched := false // stays false if the device fails or panics
	defer func() {
		h.mu.Lock()
		h.punched(off, n, punched && h.learn && quiet && h.changes == changes)
		h.mu.Unlock()
	}()
	err := h.Device.Discard(off, n)
	punched = err == nil
	return err
}

// Zero zeroes [off, off+n), which needs nothing where the map knows holes
// and the caller lets them stay holes (mayPunch).
func (h *HoleMap) Zero(off, n int64, mayPunch bool) error {
	if mayPunch {
		h.mu.Lock()
		skip := h.skips(off, n)
		h.mu.Unlock()
		if skip {
			return nil
		}
	}
	h.begin(off, n)
	defer func() {
		h.mu.Lock()
		h.ended(off, n)
		h.punched(off, n, false)
		h.mu.Unlock()
	}()
	return h.Device.Zero(off, n, mayPunch)
}

// skips reports whether the map knows every granule that [off, off+n)
// touches as a hole, so that a discard or punching zeroing of it needs no
// device call, and counts it as skipped then. h.mu must be held.
func (h *HoleMap) skips(off, n int64) bool {
	end := off + n
	if n <= 0 || off < 0 || end > h.size || (end-1)/holeChunk-off/holeChunk >= int64(len(h.slots)) {
		return false // more chunks than slots cannot all be known
	}
	for c := off / holeChunk; c*holeChunk < end; c++ {
		s := &h.slots[c&h.mask]
		lo, hi := max(off, c*holeChunk)-c*holeChunk, min(end, (c+1)*holeChunk)-c*holeChunk
		if s.chunk != c+1 || s.holes&granuleMask(lo, hi) != granuleMask(lo, hi) {
			return false
		}
	}
	h.st.Skipped++
	return true
}

// eachSlot calls fn once for every slot a chunk of [off, off+n) maps to,
// with the part of the range inside the chunk the slot knows, if that
// chunk is one of them (lo == hi otherwise). h.mu must be held.
func (h *HoleMap) eachSlot(off, n int64, fn func(s *holeSlot, c, lo, hi int64)) {
	if n <= 0 {
		return
	}
	end := off + n
	c0, c1 := off/holeChunk, (end-1)/holeChunk
	inRange := func(s *holeSlot) (c, lo, hi int64) {
		c = s.chunk - 1
		if s.chunk == 0 || c < c0 || c > c1 {
			return c, 0, 0
		}
		return c, max(off, c*holeChunk), min(end, (c+1)*holeChunk)
	}
	if c1-c0 >= h.mask { // as many chunks as slots, or more: every slot once
		for i := range h.slots {
			s := &h.slots[i]
			c, lo, hi := inRange(s)
			fn(s, c, lo, hi)
		}
		return
	}
	for c := c0; c <= c1; c++ { // fewer chunks than slots: distinct slots
		s := &h.slots[c&h.mask]
		_, lo, hi := inRange(s)
		fn(s, c, lo, hi)
	}
}

// begin marks [off, off+n) as data and a write (or zeroing) of it as in
// flight, before it is issued.
func (h *HoleMap) begin(off, n int64) {
	h.mu.Lock()
	h.eachSlot(off, n, func(s *holeSlot, c, lo, hi int64) {
		if lo < hi {
			s.holes &^= granuleMask(lo-c*holeChunk, hi-c*holeChunk)
		}
		s.writing++
	})
	h.changing++
	h.changes++
	h.mu.Unlock()
}

// end records that the write begin announced completed (or failed, or
// panicked: part of it may have landed).
func (h *HoleMap) end(off, n int64) {
	h.mu.Lock()
	h.ended(off, n)
	h.mu.Unlock()
}

// ended is end with h.mu held.
func (h *HoleMap) ended(off, n int64) {
	h.eachSlot(off, n, func(s *holeSlot, _, _, _ int64) {
		s.writing--
		s.gen++
	})
	h.changing--
	h.changes++
}

// punched records a completed discard or zeroing of [off, off+n): with
// learn, the granules it covers whole become holes in the chunks the map
// knows, and chunks it covers whole become known; otherwise the chunks
// known are forgotten, so that the next read asks the device again. h.mu
// must be held.
func (h *HoleMap) punched(off, n int64, learn bool) {
	end := off + n
	h.eachSlot(off, n, func(s *holeSlot, c, lo, hi int64) {
		s.gen++
		switch {
		case !learn:
			if lo < hi {
				s.chunk = 0
				h.st.Forgot++
			}
		case lo < hi: // a known chunk
			if bits := h.punchedBits(c, off, end); bits&^s.holes != 0 {
				s.holes |= bits
				h.st.Learned++
			}
		case off <= c*holeChunk && min(h.size, (c+1)*holeChunk) <= end: // c unknown, covered whole
			if s.chunk != 0 {
				h.st.Evicted++
			}
			s.chunk, s.holes = c+1, h.punchedBits(c, off, end)
			h.st.Learned++
		}
	})
}

// punchedBits has the hole bits of chunk c's granules that [off, end)
// covers whole (the device's short last granule too, if it reaches it).
func (h *HoleMap) punchedBits(c, off, end int64) uint64 {
	var bits [1]uint64
	lo, hi := c*holeChunk, min(h.size, (c+1)*holeChunk)
	setHoleBits(bits[:], []Range{{Off: off, Len: end - off}}, lo, hi, hi == h.size)
	return bits[0]
}

// granuleMask has the bits of the granules that [lo, hi) touches, offsets
// inside one chunk, 0 <= lo < hi <= holeChunk.
func granuleMask(lo, hi int64) uint64 {
	g0, g1 := uint(lo/holeGranule), uint((hi-1)/holeGranule)
	return (allHoles >> (holeGranules - 1 - g1)) &^ (1<<g0 - 1)
}

// window fills bits[:k] with the hole bits of chunks c0 .. c0+k-1 (k <=
// holeQueryMax, all inside the device), from the map where it knows them,
// else by asking the device once for the unknown ones (as one range from
// the first to the last). A failed query leaves its chunks as data and is
// returned.
func (h *HoleMap) window(c0 int64, k int, bits *[holeQueryMax]uint64) error {
	var unknown uint32
	var gens [holeQueryMax]uint32
	h.mu.Lock()
	for i := range k {
		c := c0 + int64(i)
		s := &h.slots[c&h.mask]
		if s.chunk == c+1 {
			bits[i] = s.holes
			h.st.Hits++
			continue
		}
		bits[i] = 0
		unknown |= 1 << i
		gens[i] = s.gen
		h.st.Misses++
	}
	if unknown != 0 {
		h.st.Queries++
	}
	h.mu.Unlock()
	if unknown == 0 {
		return nil
	}
	first, last := bits32First(unknown), bits32Last(unknown)
	lo, hi := (c0+int64(first))*holeChunk, min(h.size, (c0+int64(last)+1)*holeChunk)
	holes, known, err := h.holesTo(lo, hi-lo)
	if err != nil {
		h.mu.Lock()
		h.st.Errors++
		h.mu.Unlock()
		return err
	}
	var got [holeQueryMax]uint64
	setHoleBits(got[first:last+1], holes, lo, hi, hi == h.size)
	h.mu.Lock()
	for i := first; i <= last; i++ {
		if unknown&(1<<i) == 0 {
			continue
		}
		bits[i] = got[i]
		c := c0 + int64(i)
		s := &h.slots[c&h.mask]
		if s.gen != gens[i] || s.writing != 0 {
			h.st.Refused++
			continue
		}
		if s.chunk != 0 && s.chunk != c+1 {
			h.st.Evicted++
		}
		s.chunk, s.holes = c+1, got[i]
	}
	h.dataAhead(hi, known)
	h.mu.Unlock()
	return nil
}

// holesTo asks the device for the holes of [off, off+n) and, where it can
// tell (File.HolesTo), how far past the range data runs without a hole.
func (h *HoleMap) holesTo(off, n int64) (holes []Range, known int64, err error) {
	if d, ok := h.Device.(interface {
		HolesTo(off, n int64) ([]Range, int64, error)
	}); ok {
		return d.HolesTo(off, n)
	}
	holes, err = h.Device.Holes(off, n)
	return holes, off + n, err
}

// dataAhead keeps, as all data, the chunks in [from, to) that a question
// found no hole in past its range, in slots that know no chunk: at most
// one pass over the slots. On tmpfs SEEK_HOLE walks every page up to the
// next hole, so without it each 4 KiB read of a written image's chunk not
// yet known walked the rest of the file (docs/decisions/hole-maps.md has
// the figures). "Data" is the answer that is never unsafe: a read
// of it reads the device, a discard of it reaches the device, and a change
// since the question only makes it stale the safe way, so neither the
// generations nor writes in flight matter here. h.mu must be held.
func (h *HoleMap) dataAhead(from, to int64) {
	first := (from + holeChunk - 1) / holeChunk // the first chunk that starts in [from, to)
	for c := first; c < first+int64(len(h.slots)) && c*holeChunk < h.size && min(h.size, (c+1)*holeChunk) <= to; c++ {
		if s := &h.slots[c&h.mask]; s.chunk == 0 {
			s.chunk, s.holes = c+1, 0
			h.st.Ahead++
		}
	}
}

func bits32First(x uint32) int { return bits.TrailingZeros32(x) }
func bits32Last(x uint32) int  { return 31 - bits.LeadingZeros32(x) }

// setHoleBits sets, in bits (one word per chunk from lo, chunk-aligned, to
// hi), the granules that holes (ascending, inside [lo, hi)) cover whole.
// With eof, hi is the device's end and a hole reaching it covers the last,
// possibly short, granule.
func setHoleBits(bits []uint64, holes []Range, lo, hi int64, eof bool) {
	for _, r := range holes {
		a, b := max(r.Off, lo)-lo, min(r.End(), hi)-lo
		if a >= b {
			continue
		}
		g0 := (a + holeGranule - 1) / holeGranule
		g1 := b / holeGranule // first granule not covered whole
		if eof && r.End() >= hi {
			g1 = (b + holeGranule - 1) / holeGranule
		}
		for g := g0; g < g1; {
			w, in := g/holeGranules, g%holeGranules
			n := min(g1-g, holeGranules-in)
			bits[w] |= (allHoles >> (holeGranules - n)) << in
			g += n
		}
	}
}

// runs calls fn for the consecutive runs of hole and data in [off, end),
// ascending, each run as long as it goes within the range (a run may be
// cut in two where a window of holeQueryMax chunks ends). A failed query
// makes its chunks data and is returned after the walk.
func (h *HoleMap) runs(off, end int64, fn func(lo, hi int64, hole bool)) error {
	var firstErr error
	var bits [holeQueryMax]uint64
	for c := off / holeChunk; c*holeChunk < end; c += holeQueryMax {
		k := int(min(holeQueryMax, (end-1)/holeChunk-c+1))
		if err := h.window(c, k, &bits); err != nil && firstErr == nil {
			firstErr = err
		}
		base := c * holeChunk
		lo, hi := max(off, base), min(end, base+int64(k)*holeChunk)
		for pos := lo; pos < hi; {
			g := int((pos - base) / holeGranule)
			hole := bits[g/holeGranules]&(1<<(g%holeGranules)) != 0
			next := base + int64(nextChange(bits[:k], g, k*holeGranules, hole))*holeGranule
			stop := min(hi, next)
			fn(pos, stop, hole)
			pos = stop
		}
	}
	return firstErr
}

// nextChange returns the first granule at or after g and before lim whose
// hole bit is not hole, or lim.
func nextChange(bs []uint64, g, lim int, hole bool) int {
	for g < lim {
		w := bs[g/holeGranules]
		if hole {
			w = ^w
		}
		if w >>= uint(g % holeGranules); w != 0 {
			return min(lim, g+bits.TrailingZeros64(w))
		}
		g = (g/holeGranules + 1) * holeGranules
	}
	return lim
}

// Holes answers from the map, asking the device about chunks it does not
// know; holes are whole granules (the last one may end at the device's
// end), clipped to [off, off+n).
func (h *HoleMap) Holes(off, n int64) ([]Range, error) {
	if err := checkRange(h.size, off, n); err != nil {
		return nil, err
	}
	var out []Range
	err := h.runs(off, off+n, func(lo, hi int64, hole bool) {
		if !hole {
			return
		}
		if k := len(out) - 1; k >= 0 && out[k].End() == lo {
			out[k].Len += hi - lo
			return
		}
		out = append(out, Range{Off: lo, Len: hi - lo})
	})
	if err != nil {
		return nil, err
	}
	return out, nil
}

// ReadAtSparse reads [off, off+len(p)) leaving its holes unread (see
// SparseReader). Each data piece between the holes it reports is one read
// of the inner device. A hole query that fails makes the range read as
// data.
func (h *HoleMap) ReadAtSparse(p []byte, off, minHole int64, maxHoles int, holes []Range) ([]Range, error) {
	end := off + int64(len(p))
	if err := checkRange(h.size, off, int64(len(p))); err != nil || len(p) == 0 {
		return holes, err
	}
	s := sparseRead{p: p, off: off, end: end, minHole: minHole, room: maxHoles, holes: holes, dataAt: -1, holeAt: -1, dev: h.Device}
	h.runs(off, end, s.run)
	return s.finish()
}

// sparseRead turns a walk of hole and data runs into the holes a sparse
// read reports and the reads of the data between them: a hole shorter than
// minHole (unless it is all of p), or past the room for holes, joins the
// data around it, which is then read with one call.
type sparseRead struct {
	p             []byte
	off, end      int64
	minHole       int64
	room          int
	holes         []Range
	dataAt        int64 // start of the data not read yet, or -1
	holeAt, holeN int64 // the hole being extended, or -1
	err           error
	dev           Device
}

func (s *sparseRead) run(lo, hi int64, hole bool) {
	if hole {
		if s.holeAt < 0 {
			s.holeAt = lo
		}
		s.holeN = hi - s.holeAt
		return
	}
	s.endHole()
	if s.dataAt < 0 {
		s.dataAt = lo
	}
}

// endHole decides about the hole being extended, now that it ended.
func (s *sparseRead) endHole() {
	if s.holeAt < 0 {
		return
	}
	at, n := s.holeAt, s.holeN
	s.holeAt = -1
	whole := at == s.off && n == s.end-s.off
	if s.room == 0 || (n < s.minHole && !whole) {
		if s.dataAt < 0 {
			s.dataAt = at // read as data with what follows
		}
		return
	}
	s.readData(at)
	s.holes = append(s.holes, Range{Off: at, Len: n})
	s.room--
}

// readData reads the pending data up to to.
func (s *sparseRead) readData(to int64) {
	if s.dataAt < 0 {
		return
	}
	if s.err == nil {
		_, s.err = s.dev.ReadAt(s.p[s.dataAt-s.off:to-s.off], s.dataAt)
	}
	s.dataAt = -1
}

func (s *sparseRead) finish() ([]Range, error) {
	s.endHole()
	s.readData(s.end)
	return s.holes, s.err
}
