package table

import (
	"errors"
	"fmt"
	"io"
	"os"
	"slices"
	"strings"
	"sync/atomic"

	"github.com/nbdmapper/nbdmapper/backing"
)

// Stacking: one daemon serves several devices, and a table may name
// another device of the same daemon as a backing device, the way a dm table
// names /dev/mapper/NAME:
//
//	base.table   0 2097152 linear disk.img 0 ...        (1024 lines)
//	snap.table   0 2097152 snapshot /dev/mapper/base cow.img P 8
//	orig.table   0 2097152 snapshot-origin /dev/mapper/base
//
// ParseSet loads such a set in dependency order: parsing snap.table opens
// /dev/mapper/base, which parses base.table first (once), wraps the
// resulting table in a Device and hands that out. A name under
// /dev/mapper/ that is not in the set is an error (use major:minor or
// /dev/dm-N for a kernel dm device), and so is a cycle.

// MapperPrefix starts a device name that refers to another device of the set.
const MapperPrefix = "/dev/mapper/"

var (
	ErrUnknownDevice = errors.New("no such device in this set")
	ErrCycle         = errors.New("device cycle")
	ErrDuplicateName = errors.New("duplicate device name")
)

// Def names one device of a set and where its table comes from.
type Def struct {
	Name string    // the device's name; other tables refer to /dev/mapper/<Name>
	File string    // the table file, also used in error messages
	Text io.Reader // the table text; nil means read File
}

// ParseSet parses the tables of a set of named devices, each once, in
// dependency order, and returns them in the order of defs. Device names
// other than /dev/mapper/<name> go to open (a *backing.Pool).
func ParseSet(defs []Def, open Opener) ([]*Table, error) {
	s := &setOpener{open: open, byName: make(map[string]*setEntry)}
	for _, d := range defs {
		if d.Name == "" || strings.ContainsAny(d.Name, "/ \t") {
			return nil, &Error{File: d.File, Err: fmt.Errorf("%w: bad device name %q", ErrUnknownDevice, d.Name)}
		}
		if s.byName[d.Name] != nil {
			return nil, &Error{File: d.File, Err: fmt.Errorf("%w %q", ErrDuplicateName, d.Name)}
		}
		e := &setEntry{def: d}
		s.byName[d.Name] = e
		s.names = append(s.names, d.Name)
	}
	tables := make([]*Table, len(defs))
	for i, d := range defs {
		e := s.byName[d.Name]
		if err := s.load(e); err != nil {
			return nil, err
		}
		tables[i] = e.t
	}
	return tables, nil
}

type setOpener struct {
	open    Opener
	byName  map[string]*setEntry
	names   []string
	loading []string // the chain being parsed, for cycle messages
}

type setEntry struct {
	def     Def
	loading bool
	done    bool
	t       *Table
	dev     *Device
	err     error
}

func (s *setOpener) load(e *setEntry) error {
	if e.done {
		return e.err
	}
	if e.loading {
		chain := append(slices.Clone(s.loading[slices.Index(s.loading, e.def.Name):]), e.def.Name)
		return fmt.Errorf("%w: %s", ErrCycle, strings.Join(chain, " -> "))
	}
	e.loading = true
	s.loading = append(s.loading, e.def.Name)
	e.t, e.err = s.parse(e.def)
	s.loading = s.loading[:len(s.loading)-1]
	e.loading, e.done = false, true
	if e.err == nil {
		e.dev = NewDevice(e.def.Name, e.t)
	}
	return e.err
}

func (s *setOpener) parse(d Def) (*Table, error) {
	r := d.Text
	if r == nil {
		f, err := os.Open(d.File)
		if err != nil {
			return nil, &Error{File: d.File, Err: err}
		}
		defer f.Close()
		r = f
	}
	return Parse(d.File, r, s)
}

// Open resolves /dev/mapper/<name> against the set, parsing that device's
// table first if needed; other names go to the wrapped Opener.
func (s *setOpener) Open(name string) (backing.Device, error) {
	dm, ok := strings.CutPrefix(name, MapperPrefix)
	if !ok {
		return openDev(s.open, name)
	}
	e := s.byName[dm]
	if e == nil {
		return nil, fmt.Errorf("%w: %q (devices: %s)", ErrUnknownDevice, dm, strings.Join(s.names, ", "))
	}
	if err := s.load(e); err != nil {
		if errors.Is(err, ErrCycle) {
			return nil, err
		}
		return nil, fmt.Errorf("device %s: %w", dm, err)
	}
	return e.dev, nil
}

// Device makes a Table usable as a backing.Device, so that another table
// can stack on it: reads and writes go through its extents, Sync syncs the
// devices below, and Devices names them so that flushes are deduplicated
// against the real devices rather than this wrapper.
type Device struct {
	name string
	id   backing.ID
	t    *Table
	devs []backing.Device
}

var _ backing.Device = (*Device)(nil)

// Table devices get IDs no file, block device, backing.Mem or snapshot
// device has.
const tableDev = ^uint64(0) - 2

var tableIno atomic.Uint64

// NewDevice wraps t as the device /dev/mapper/<name>.
func NewDevice(name string, t *Table) *Device {
	return &Device{
		name: MapperPrefix + name,
		id:   backing.ID{Dev: tableDev, Ino: tableIno.Add(1)},
		t:    t,
		devs: flatten(t.Devices()),
	}
}

func (d *Device) Name() string           { return d.name }
func (d *Device) ID() backing.ID         { return d.id }
func (d *Device) Size() int64            { return d.t.Size() }
func (d *Device) Table() *Table          { return d.t }
func (d *Device) Limits() backing.Limits { return backing.Limits{Granularity: SectorSize} }
func (d *Device) Close() error           { return nil } // the Opener owns the devices below

// Devices lists the real devices below the table.
func (d *Device) Devices() []backing.Device { return d.devs }

func (d *Device) check(off, n int64) error {
	if off < 0 || n < 0 || off > d.t.Size() || n > d.t.Size()-off {
		return fmt.Errorf("%s: range [%d, %d) outside %d bytes", d.name, off, off+n, d.t.Size())
	}
	return nil
}

// each runs fn for every extent of [off, off+n), stopping at the first
// error; error-target extents fail with ErrTarget.
func (d *Device) each(off, n int64, fn func(e Extent) error) error {
	if err := d.check(off, n); err != nil {
		return err
	}
	var err error
	d.t.Map(off, n, func(e Extent) bool {
		if e.Kind == KindError {
			err = ErrTarget
		} else {
			err = fn(e)
		}
		return err == nil
	})
	return err
}

func (d *Device) ReadAt(p []byte, off int64) (int, error) {
	err := d.each(off, int64(len(p)), func(e Extent) error {
		buf := p[e.VOff-off : e.VOff-off+e.Len]
		if e.Kind == KindZero {
			clear(buf)
			return nil
		}
		_, err := e.Dev.ReadAt(buf, e.Off)
		return err
	})
	if err != nil {
		return 0, err
	}
	return len(p), nil
}

func (d *Device) WriteAt(p []byte, off int64) (int, error) {
	err := d.each(off, int64(len(p)), func(e Extent) error {
		if e.Kind == KindZero {
			return nil
		}
		_, err := e.Dev.WriteAt(p[e.VOff-off:e.VOff-off+e.Len], e.Off)
		return err
	})
	if err != nil {
		return 0, err
	}
	return len(p), nil
}

// Sync syncs every device below, each once.
func (d *Device) Sync() error {
	var errs []error
	for _, dev := range d.devs {
		if err := dev.Sync(); err != nil {
			errs = append(errs, fmt.Errorf("sync %s: %w", dev.Name(), err))
		}
	}
	return errors.Join(errs...)
}

// Discard is advisory: devices that cannot discard are skipped.
func (d *Device) Discard(off, n int64) error {
	return d.each(off, n, func(e Extent) error {
		if e.Kind == KindZero {
			return nil
		}
		if err := e.Dev.Discard(e.Off, e.Len); err != nil && !errors.Is(err, backing.ErrNotSupported) {
			return err
		}
		return nil
	})
}

// Zero zeroes natively where every device below can; otherwise it returns
// ErrNotSupported and the caller writes zeros through WriteAt.
func (d *Device) Zero(off, n int64, mayPunch bool) error {
	return d.each(off, n, func(e Extent) error {
		if e.Kind == KindZero {
			return nil
		}
		return e.Dev.Zero(e.Off, e.Len, mayPunch)
	})
}

// Holes reports the holes of the devices below, and zero-target lines.
func (d *Device) Holes(off, n int64) ([]backing.Range, error) {
	var out []backing.Range
	add := func(r backing.Range) {
		if k := len(out) - 1; k >= 0 && out[k].End() == r.Off {
			out[k].Len += r.Len
			return
		}
		out = append(out, r)
	}
	err := d.each(off, n, func(e Extent) error {
		if e.Kind == KindZero {
			add(backing.Range{Off: e.VOff, Len: e.Len})
			return nil
		}
		holes, err := e.Dev.Holes(e.Off, e.Len)
		for _, h := range holes {
			add(backing.Range{Off: e.VOff + h.Off - e.Off, Len: h.Len})
		}
		return err
	})
	return out, err
}

// stacked is a device built on other devices (a table Device, a snapshot).
type stacked interface {
	Devices() []backing.Device
}

// flatten replaces stacked devices by the real devices below them,
// recursively, keeping the first occurrence of each.
func flatten(devs []backing.Device) []backing.Device {
	var out []backing.Device
	var walk func([]backing.Device)
	walk = func(ds []backing.Device) {
		for _, d := range ds {
			if s, ok := d.(stacked); ok {
				walk(s.Devices())
				continue
			}
			if !slices.Contains(out, d) {
				out = append(out, d)
			}
		}
	}
	walk(devs)
	return out
}

// Status prints the table's status lines as `dmsetup status` does:
// `<start> <length> <target> <status>` (the status may be empty, as for
// linear, leaving a trailing space like dmsetup).
func (t *Table) Status() string {
	var b strings.Builder
	for _, l := range t.Lines {
		fmt.Fprintf(&b, "%d %d %s %s\n", l.Start, l.Length, l.Target.Type(), l.Target.Status())
	}
	return b.String()
}

// Close releases what the table's targets hold beyond their devices
// (a snapshot's registration with its origin and its claim on the COW
// device). The devices themselves belong to the Opener.
func (t *Table) Close() error {
	var errs []error
	for _, l := range t.Lines {
		if c, ok := l.Target.(io.Closer); ok {
			errs = append(errs, c.Close())
		}
	}
	return errors.Join(errs...)
}
