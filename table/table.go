package table

import (
	"errors"
	"fmt"
	"strconv"

	"github.com/nbdmapper/nbdmapper/backing"
)

// SectorSize is the unit of every number in a table.
const SectorSize = 512

// Sector is a count or offset in 512-byte sectors, as tables are written.
type Sector uint64

// Bytes converts sectors to bytes. It is the one sector/byte boundary.
func (s Sector) Bytes() int64 { return int64(s) * SectorSize }

// Kind says what an Extent is backed by.
type Kind uint8

const (
	// KindMapped extents live on Dev at Off.
	KindMapped Kind = iota
	// KindZero extents read as zeros and drop writes and discards (zero target).
	KindZero
	// KindError extents fail every I/O (error target).
	KindError
)

func (k Kind) String() string {
	switch k {
	case KindMapped:
		return "mapped"
	case KindZero:
		return "zero"
	case KindError:
		return "error"
	}
	return fmt.Sprintf("kind(%d)", uint8(k))
}

// Extent is one contiguous piece of a virtual byte range after mapping:
// Len bytes at virtual offset VOff, stored on Dev at Off (KindMapped only).
type Extent struct {
	Kind Kind
	Dev  backing.Device
	Off  int64 // device byte offset (KindMapped only)
	VOff int64 // virtual byte offset on the table's device
	Len  int64
}

// ErrTarget is the error for I/O that lands on an error target.
var ErrTarget = errors.New("I/O on an error target")

// Target maps one table line's part of the virtual device. Offsets given to
// Map are relative to the start of the line, in bytes, and always inside it.
//
// Targets are constructed by name from the registry in registry.go; one target
// type per file, like dm's target_type.
type Target interface {
	// Type is the target name as written in tables: "linear", "striped", ...
	Type() string
	// Args are the canonical arguments as `dmsetup table` would print them,
	// with devices as the table gave them.
	Args() []string
	// Status is the target's `dmsetup status` text (may be empty).
	Status() string
	// Map calls yield for each extent covering [off, off+n), in ascending
	// virtual order, and stops early, returning false, when yield does.
	// VOff in the extents is relative to the line start; Table.Map rebases
	// it.
	Map(off, n int64, yield func(Extent) bool) bool
	// Devices lists the distinct backing devices this target reads or
	// writes. The slice belongs to the target: callers must not modify it.
	Devices() []backing.Device
}

// Line is one table line: Length sectors at Start, served by Target.
type Line struct {
	Start, Length Sector
	Target        Target
}

// Table is a parsed, validated table: lines in order, contiguous from 0.
// Build it with Parse or New; Lines is read-only afterwards (Map searches an
// index built from it).
type Table struct {
	File  string // where it was read from, for messages
	Lines []Line
	size  int64
	ends  []int64 // ends[i] is the byte just past Lines[i], for Map's search
	// held are the devices Parse opened for the table through release,
	// given back by Close.
	held    []backing.Device
	release Opener
}

// New builds a table from contiguous lines. Parse validates as it reads;
// New is for code that builds lines itself. Errors are *Error with the
// 1-based index of the offending line.
func New(file string, lines []Line) (*Table, error) {
	if len(lines) == 0 {
		return nil, &Error{File: file, Err: ErrEmpty}
	}
	if len(lines) > MaxTargets {
		return nil, &Error{File: file, Line: MaxTargets + 1, Err: ErrTooMany}
	}
	var next Sector
	for i, l := range lines {
		if l.Length == 0 {
			return nil, &Error{File: file, Line: i + 1, Err: ErrZeroLength}
		}
		if l.Start != next {
			return nil, &Error{File: file, Line: i + 1, Err: ErrGap}
		}
		if l.Length > maxSector-l.Start {
			return nil, &Error{File: file, Line: i + 1, Err: ErrNumber}
		}
		next = l.Start + l.Length
	}
	return newTable(file, lines), nil
}

// newTable wraps validated lines. The line ends get their own dense array
// because Map's binary search touches one per step: 8 bytes per line
// instead of a 32-byte Line keeps four times as many of them in cache.
func newTable(file string, lines []Line) *Table {
	ends := make([]int64, len(lines))
	for i, l := range lines {
		ends[i] = (l.Start + l.Length).Bytes()
	}
	return &Table{File: file, Lines: lines, ends: ends, size: ends[len(ends)-1]}
}

// Size is the virtual device size in bytes.
func (t *Table) Size() int64 { return t.size }

// Map calls yield for each extent covering the virtual range [off, off+n),
// in ascending order, and stops as soon as yield returns false (Map then
// returns false). The range must lie inside the table (validated at the
// protocol edge). The first line is found by binary search over line ends;
// a range that ends exactly on a line boundary does not touch the next line:
//
//	lines      [0 ........ 8)[8 ........ 16)    (sectors)
//	Map(0, 8 sectors)  -> line 0 only
//	Map(8 sectors, 1)  -> line 1 only
//	Map(7 sectors, 2 sectors) -> line 0 [7,8), then line 1 [8,9)
func (t *Table) Map(off, n int64, yield func(Extent) bool) bool {
	return t.walk(off, n, yield, Target.Map)
}

// Cover is Map for requests that treat every byte alike (trim, zeroing,
// caching): it calls yield with extents that together cover [off, off+n)
// once, but a target may send them in any order and join pieces that are
// adjacent on their device though not in the virtual range. A striped line
// then costs one extent per stripe instead of one per chunk:
//
//	striped, 2 stripes, chunk 1 sector; Map(0, 8 sectors):
//	  a0 b0 a1 b1 a2 b2 a3 b3   (8 extents)
//	Cover(0, 8 sectors):
//	  a[0,4) b[0,4)             (2 extents)
//
// VOff is exact only for extents of zero and error targets.
func (t *Table) Cover(off, n int64, yield func(Extent) bool) bool {
	return t.walk(off, n, yield, func(tg Target, off, n int64, yield func(Extent) bool) bool {
		if c, ok := tg.(coverer); ok {
			return c.Cover(off, n, yield)
		}
		return tg.Map(off, n, yield)
	})
}

// coverer is implemented by targets with a cheaper Cover than their Map.
type coverer interface {
	Cover(off, n int64, yield func(Extent) bool) bool
}

func (t *Table) walk(off, n int64, yield func(Extent) bool, mapLine func(Target, int64, int64, func(Extent) bool) bool) bool {
	end := off + n
	// First line whose end lies past off.
	lo, hi := 0, len(t.ends)
	for lo < hi {
		m := int(uint(lo+hi) >> 1)
		if t.ends[m] > off {
			hi = m
		} else {
			lo = m + 1
		}
	}
	// A target's extents are relative to its line. The first line starts
	// at 0 and needs no rebasing; the others share one rebaser per call,
	// made when first needed (it escapes into the target: two allocations).
	var rb *rebaser
	var rebase func(Extent) bool
	for i := lo; i < len(t.Lines) && off < end; i++ {
		l := &t.Lines[i]
		base := l.Start.Bytes()
		k := min(end, (l.Start+l.Length).Bytes()) - off
		y := yield
		if base != 0 {
			if rb == nil {
				rb = &rebaser{yield: yield}
				rebase = rb.rebase
			}
			rb.base, y = base, rebase
		}
		if !mapLine(l.Target, off-base, k, y) {
			return false
		}
		off += k
	}
	return true
}

// rebaser turns a line's extents into the table's.
type rebaser struct {
	base  int64
	yield func(Extent) bool
}

func (r *rebaser) rebase(e Extent) bool {
	e.VOff += r.base
	return r.yield(e)
}

// Extents returns Map's extents as a slice.
func (t *Table) Extents(off, n int64) []Extent {
	var out []Extent
	t.Map(off, n, func(e Extent) bool { out = append(out, e); return true })
	return out
}

// Devices lists the distinct backing devices of every line, in order of first use.
func (t *Table) Devices() []backing.Device {
	seen := make(map[backing.Device]bool)
	var out []backing.Device
	for _, l := range t.Lines {
		for _, d := range l.Target.Devices() {
			if !seen[d] {
				seen[d] = true
				out = append(out, d)
			}
		}
	}
	return out
}

// String prints the table as `dmsetup table` would: one line per target,
// devices as given, numbers in plain decimal. Parse(String()) gives back an
// equal table.
func (t *Table) String() string {
	var b []byte
	for _, l := range t.Lines {
		b = strconv.AppendUint(b, uint64(l.Start), 10)
		b = append(b, ' ')
		b = strconv.AppendUint(b, uint64(l.Length), 10)
		b = append(b, ' ')
		b = append(b, l.Target.Type()...)
		for _, a := range l.Target.Args() {
			b = append(b, ' ')
			b = append(b, a...)
		}
		b = append(b, '\n')
	}
	return string(b)
}
