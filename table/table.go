package table

import (
	"errors"
	"fmt"
	"sort"
	"strings"

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
	// Map calls emit for each extent covering [off, off+n), in ascending
	// virtual order. VOff in emitted extents is relative to the line start;
	// Table.Map rebases it.
	Map(off, n int64, emit func(Extent))
	// Devices lists the distinct backing devices this target reads or writes.
	Devices() []backing.Device
}

// Line is one table line: Length sectors at Start, served by Target.
type Line struct {
	Start, Length Sector
	Target        Target
}

// Table is a parsed, validated table: lines in order, contiguous from 0.
type Table struct {
	File  string // where it was read from, for messages
	Lines []Line
	size  int64
}

// New builds a table from contiguous lines. Parse calls it; tests may too.
func New(file string, lines []Line) (*Table, error) {
	var next Sector
	for i, l := range lines {
		if l.Start != next {
			return nil, fmt.Errorf("line %d: %w", i+1, ErrGap)
		}
		if l.Length == 0 {
			return nil, fmt.Errorf("line %d: %w", i+1, ErrZeroLength)
		}
		next = l.Start + l.Length
	}
	if len(lines) == 0 {
		return nil, ErrEmpty
	}
	return &Table{File: file, Lines: lines, size: next.Bytes()}, nil
}

// Size is the virtual device size in bytes.
func (t *Table) Size() int64 { return t.size }

// Map calls emit for each extent covering the virtual range [off, off+n), in
// ascending order. The range must lie inside the table (validated at the
// protocol edge). Finding the first line is a binary search.
func (t *Table) Map(off, n int64, emit func(Extent)) {
	end := off + n
	i := sort.Search(len(t.Lines), func(i int) bool {
		l := t.Lines[i]
		return (l.Start + l.Length).Bytes() > off
	})
	for ; i < len(t.Lines) && off < end; i++ {
		l := t.Lines[i]
		start, stop := l.Start.Bytes(), (l.Start + l.Length).Bytes()
		chunk := min(end, stop) - off
		l.Target.Map(off-start, chunk, func(e Extent) {
			e.VOff += start
			emit(e)
		})
		off += chunk
	}
}

// Extents returns Map's extents as a slice.
func (t *Table) Extents(off, n int64) []Extent {
	var out []Extent
	t.Map(off, n, func(e Extent) { out = append(out, e) })
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

// String prints the table as `dmsetup table` would, devices as given.
func (t *Table) String() string {
	var b strings.Builder
	for _, l := range t.Lines {
		fmt.Fprintf(&b, "%d %d %s", l.Start, l.Length, l.Target.Type())
		for _, a := range l.Target.Args() {
			b.WriteByte(' ')
			b.WriteString(a)
		}
		b.WriteByte('\n')
	}
	return b.String()
}
