package table

import (
	"errors"
	"fmt"
	"io"
	"os"
	"slices"
	"strings"

	"github.com/nbdmapper/nbdmapper/backing"
)

// Stacking order: one daemon serves several devices, and a table may name
// another device of the same daemon as a backing device, the way a dm table
// names /dev/mapper/NAME:
//
//	base.table   0 2097152 linear disk.img 0 ...        (1024 lines)
//	snap.table   0 2097152 snapshot /dev/mapper/base cow.img P 8
//	orig.table   0 2097152 snapshot-origin /dev/mapper/base
//
// ParseSet loads such a set in dependency order: parsing snap.table opens
// /dev/mapper/base, which parses base.table first (once), makes the
// resulting table a device (package mapped's) and hands that out. A name under
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
// dependency order, makes each table a device with wrap (a mapped device),
// and returns the devices in the order of defs. A table that names
// /dev/mapper/<name> gets the very device wrap made for <name>; other
// device names go to open (a *backing.Pool).
func ParseSet[D backing.Device](defs []Def, open Opener, wrap func(name string, t *Table) D) ([]D, error) {
	s := &setOpener{open: open, byName: make(map[string]*setEntry)}
	s.wrap = func(name string, t *Table) backing.Device { return wrap(name, t) }
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
	devs := make([]D, len(defs))
	for i, d := range defs {
		e := s.byName[d.Name]
		if err := s.load(e); err != nil {
			s.closeLoaded()
			return nil, err
		}
		devs[i] = e.dev.(D)
	}
	return devs, nil
}

type setOpener struct {
	open    Opener
	wrap    func(name string, t *Table) backing.Device
	byName  map[string]*setEntry
	names   []string
	loading []string // the chain being parsed, for cycle messages
}

type setEntry struct {
	def     Def
	loading bool
	done    bool
	t       *Table
	dev     backing.Device
	err     error
}

// closeLoaded closes the tables parsed before a failure, as Parse closes
// the lines it built before a failing one.
func (s *setOpener) closeLoaded() {
	for _, e := range s.byName {
		if e.t != nil {
			e.t.Close()
		}
	}
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
		e.dev = s.wrap(e.def.Name, e.t)
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

// Release gives a device back to the wrapped Opener, unless it is one of
// the set's own.
func (s *setOpener) Release(d backing.Device) error {
	for _, e := range s.byName {
		if e.dev == d {
			return nil
		}
	}
	return release(s.open, []backing.Device{d})
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

// stacked is a device built on other devices (a mapped device, a snapshot).
type stacked interface {
	Devices() []backing.Device
}

// layered is a stacked device that can name the devices directly below it
// (a mapped device: its table's devices, mapped devices among them), so
// that Flatten walks each device of a stack once rather than once per
// path to it.
type layered interface {
	Below() []backing.Device
}

// Flatten replaces stacked devices (those with a Devices method: mapped
// devices, snapshots) by the real devices below them, recursively, keeping
// the first occurrence of each: the devices a flush must reach. Each
// stacked device is expanded once, so that a stack of diamonds (a device
// on two that are both on the same two, and so on) costs its size, not
// its number of paths.
func Flatten(devs []backing.Device) []backing.Device {
	var out []backing.Device
	seen := make(map[backing.Device]bool)
	var walk func([]backing.Device)
	walk = func(ds []backing.Device) {
		for _, d := range ds {
			if seen[d] {
				continue
			}
			seen[d] = true
			if l, ok := d.(layered); ok {
				walk(l.Below())
				continue
			}
			if s, ok := d.(stacked); ok {
				walk(s.Devices())
				continue
			}
			out = append(out, d)
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

// activator is implemented by targets that work while their table is
// active, in the background or on other tables' behalf: a snapshot-merge
// line's merge, a snapshot taking over another's store.
type activator interface {
	Activate()
	Deactivate()
}

// Activate tells the targets that the table has become active (dm's
// resume): a merge starts, a handover happens. Deactivate tells them it is
// being suspended (dm's presuspend): a merge stops after its step in
// progress.
func (t *Table) Activate() {
	for _, l := range t.Lines {
		if a, ok := l.Target.(activator); ok {
			a.Activate()
		}
	}
}

func (t *Table) Deactivate() {
	for _, l := range t.Lines {
		if a, ok := l.Target.(activator); ok {
			a.Deactivate()
		}
	}
}

// maker is implemented by targets that make a device of their own rather
// than only open them: a snapshot, a snapshot-origin.
type maker interface {
	Made() backing.Device
}

// Made lists the devices the table's targets made (a snapshot's, a
// snapshot-origin's), which the table's extents name and which are gone
// once it is closed: whoever keeps state per device (the discard engine)
// forgets them then.
func (t *Table) Made() []backing.Device {
	var out []backing.Device
	for _, l := range t.Lines {
		if m, ok := l.Target.(maker); ok {
			out = append(out, m.Made())
		}
	}
	return out
}

// Close releases what the table's targets hold beyond their devices
// (a snapshot's registration with its origin and its claim on the COW
// device), and then the devices Parse opened for it, if its Opener is a
// Releaser: the last table to let go of a device closes it. Nothing may
// run on the table after, and Close is called once.
func (t *Table) Close() error {
	err := closeTargets(t.Lines)
	held := t.held
	t.held = nil
	return errors.Join(err, release(t.release, held))
}

func closeTargets(lines []Line) error {
	var errs []error
	for _, l := range lines {
		if c, ok := l.Target.(io.Closer); ok {
			errs = append(errs, c.Close())
		}
	}
	return errors.Join(errs...)
}
