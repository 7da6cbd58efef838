package nbdtarget

import (
	"sync"

	"github.com/nbdmapper/nbdmapper/backing"
	"github.com/nbdmapper/nbdmapper/discard"
	"github.com/nbdmapper/nbdmapper/flush"
	"github.com/nbdmapper/nbdmapper/table"
)

// Export is one named virtual device: a table and the engines that carry its
// flushes and discards to the backing devices. Requests reaching its methods
// have been validated at the protocol edge (range, flags, read-only).
type Export struct {
	Name        string
	Description string
	Table       *table.Table
	ReadOnly    bool
	Flush       *flush.Engine
	Discard     *discard.Engine

	// PerSegmentFlush makes Flush sync every device once per table line that
	// uses it, as dm did before Linux 6.11. Benchmark baseline only.
	PerSegmentFlush bool

	// Access, if set, admits only TLS clients with a verified certificate
	// it names (see Access); others get ERR_POLICY and do not see the
	// export in LIST.
	Access *Access

	devsOnce sync.Once
	devs     []backing.Device
}

// Size is the export size in bytes.
func (x *Export) Size() int64 { return x.Table.Size() }

func (x *Export) devices() []backing.Device {
	x.devsOnce.Do(func() { x.devs = x.Table.Devices() })
	return x.devs
}

// ReadAt fills p from the virtual device at off.
func (x *Export) ReadAt(p []byte, off int64) error {
	_, err := x.readAt(p, off)
	return err
}

// readAt is ReadAt that also reports the virtual offset of the extent that
// failed, for the ERROR_OFFSET chunk of a structured reply.
func (x *Export) readAt(p []byte, off int64) (failed int64, err error) {
	r := readerPool.Get().(*extentReader)
	r.p, r.off = p, off
	x.Table.Map(off, int64(len(p)), r.yield)
	failed, err = r.failed, r.err
	*r = extentReader{yield: r.yield}
	readerPool.Put(r)
	return failed, err
}

// extentReader carries readAt's state through Table.Map. It is pooled with
// its yield func bound once, so a read allocates no closure.
type extentReader struct {
	p      []byte
	off    int64
	err    error
	failed int64
	yield  func(table.Extent) bool
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
		_, r.err = e.Dev.ReadAt(buf, e.Off)
	case table.KindZero:
		clear(buf)
	case table.KindError:
		r.err = table.ErrTarget
	}
	if r.err != nil {
		r.failed = e.VOff
	}
	return r.err == nil
}

// Cache asks the backing devices to bring [off, off+n) into their caches
// (the page cache, for files): natively where a device can (readahead,
// which returns before the data is read, so an unreadable block shows only
// on a later read), otherwise by reading through buf and dropping the data,
// which fails where a read would. Error targets fail it either way.
func (x *Export) Cache(off, n int64, buf []byte) error {
	return x.cache(off, n, buf, nil)
}

func (x *Export) cache(off, n int64, buf []byte, exts []discard.Extent) error {
	return x.walk(off, n, exts, func(exts []discard.Extent, _ bool) error {
		// Sorted and merged per device, as a zeroing would be: a piece
		// of a table whose segments alternate between two files is then
		// two calls, not a thousand.
		for _, dp := range discard.PlanZero(exts).Devices {
			for _, r := range dp.Calls {
				if err := backing.Cache(dp.Dev, r.Off, r.Len, buf); err != nil {
					return err
				}
			}
		}
		return nil
	})
}

// WriteAt writes p to the virtual device at off. With fua it returns only
// once the written data is durable on every device it touched.
func (x *Export) WriteAt(p []byte, off int64, fua bool) error {
	if fua {
		if handled, err := x.writeFUA(p, off); handled {
			return err
		}
	}
	var err error
	var touched []backing.Device
	x.Table.Map(off, int64(len(p)), func(e table.Extent) bool {
		switch e.Kind {
		case table.KindMapped:
			x.Discard.Claim(e.Dev, e.Off, e.Len)
			_, err = e.Dev.WriteAt(p[e.VOff-off:e.VOff-off+e.Len], e.Off)
			touched = appendUnique(touched, e.Dev)
		case table.KindError:
			err = table.ErrTarget
		}
		return err == nil
	})
	if err == nil && fua {
		err = x.Flush.Flush(touched)
	}
	return err
}

// FlushAll makes every write completed before the call durable.
func (x *Export) FlushAll() error {
	if x.PerSegmentFlush {
		var each []backing.Device
		for _, l := range x.Table.Lines {
			each = append(each, l.Target.Devices()...)
		}
		return x.Flush.SyncEach(each)
	}
	return x.Flush.Flush(x.devices())
}

// WalkExtents bounds the device extents that a trim, zeroing or cache
// request holds at once, whatever its length: Trim, WriteZeroes and Cache
// walk their range in pieces of at most this many extents, and BlockStatus
// answers for at most this many (a prefix of the range, as NBD allows).
const WalkExtents = 1024

// Trim discards [off, off+n): zero targets drop it, error targets fail it.
func (x *Export) Trim(off, n int64, fua bool) error { return x.trim(off, n, fua, nil) }

// WriteZeroes makes [off, off+n) read as zeros; see discard.Engine.Zero.
func (x *Export) WriteZeroes(off, n int64, mayPunch, fast, fua bool) error {
	return x.writeZeroes(off, n, mayPunch, fast, fua, nil)
}

// trim is Trim with scratch space for the walk (see walk).
func (x *Export) trim(off, n int64, fua bool, exts []discard.Extent) error {
	err := x.walk(off, n, exts, func(exts []discard.Extent, more bool) error {
		if more {
			// Other trims could only join this piece by holding up the
			// rest of the request: issue it at once.
			return x.Discard.DiscardNow(exts)
		}
		return x.Discard.Discard(exts)
	})
	return x.fua(fua, err)
}

func (x *Export) writeZeroes(off, n int64, mayPunch, fast, fua bool, exts []discard.Extent) error {
	err := x.walk(off, n, exts, func(exts []discard.Extent, _ bool) error {
		for _, e := range exts {
			x.Discard.Claim(e.Dev, e.Off, e.Len)
		}
		return x.Discard.Zero(exts, mayPunch, fast)
	})
	return x.fua(fua, err)
}

// fua makes a completed trim or zeroing durable. It flushes every device of
// the export rather than remembering which ones a long request touched:
// the flush engine skips devices that are clean.
func (x *Export) fua(fua bool, err error) error {
	if !fua || err != nil {
		return err
	}
	return x.Flush.Flush(x.devices())
}

// walk covers [off, off+n) with device extents (Table.Cover: any order,
// adjacent pieces joined), dropping zero-target parts and failing on
// error-target parts, and hands them to fn in pieces of at most
// WalkExtents, reusing exts's storage (which may be nil); more says that
// another piece may follow. Pieces before an error target have been handed
// over when walk fails on it.
func (x *Export) walk(off, n int64, exts []discard.Extent, fn func(exts []discard.Extent, more bool) error) error {
	if cap(exts) < WalkExtents {
		exts = make([]discard.Extent, 0, WalkExtents)
	}
	exts = exts[:0]
	var err error
	x.Table.Cover(off, n, func(e table.Extent) bool {
		switch e.Kind {
		case table.KindMapped:
			exts = append(exts, discard.Extent{Dev: e.Dev, Off: e.Off, Len: e.Len})
			if len(exts) == WalkExtents {
				err = fn(exts, true)
				exts = exts[:0]
			}
		case table.KindError:
			err = table.ErrTarget
		}
		return err == nil
	})
	if err == nil && len(exts) > 0 {
		err = fn(exts, false)
	}
	return err
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

// BlockStatus describes allocation of [off, off+n) as consecutive extents
// starting at off. Holes in backing files are hole+zero; zero targets are
// hole+zero; everything else is data.
func (x *Export) BlockStatus(off, n int64) ([]BlockExtent, error) {
	return x.blockStatus(off, n, 0, nil)
}

// holeQuery bounds the range one Device.Holes call is asked about, so that
// a fragmented file cannot make one call return an unbounded list.
const holeQuery = 64 << 20

// blockStatus is BlockStatus appending to out and stopping at limit extents
// (0: no limit). It also stops after WalkExtents table extents. The
// extents then cover a prefix of the range, which NBD allows; REQ_ONE asks
// for limit 1.
func (x *Export) blockStatus(off, n int64, limit int, out []BlockExtent) ([]BlockExtent, error) {
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
	x.Table.Map(off, n, func(e table.Extent) bool {
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
