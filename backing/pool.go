package backing

import (
	"errors"
	"fmt"
	"os"
	"sync"

	"golang.org/x/sys/unix"
)

// Pool opens each distinct underlying device once. Tables ask it for devices
// by the name they were given (a path, major:minor, or a name one of its
// Schemes knows, such as an NBD URI); two names for the same file, block
// device or remote export return the same Device, so that every engine
// above sees one Device per disk.
type Pool struct {
	// ReadOnly opens devices for reading only.
	ReadOnly bool
	// Wrap, if set, wraps each device once when it is first opened (the
	// flush engine's dirty tracking, a fault injector in tests).
	Wrap func(Device) Device
	// Schemes open the device names that are not paths. Each is asked in
	// turn whether a name is its own; names none claims are paths. Set
	// them before the first Open. (cmd/nbdmapper installs package
	// remote's, for NBD URIs: backing itself knows no network.)
	Schemes []Scheme
	// NoHoleMap opens regular files without a HoleMap in front: reads then
	// read holes like data, and every block status asks the file system.
	// By default Open puts one in front of each regular file, under Wrap,
	// so that every change of the file goes through it. Devices given to
	// Add get none: the caller decides.
	NoHoleMap bool

	mu     sync.Mutex
	byID   map[ID]Device
	byName map[string]Device
	order  []Device
}

// Scheme opens devices that are named by something other than a path: an
// export of another NBD server, named by its URI. Identify must tell two
// names of one device apart without opening either, so that the Pool opens
// each device once however many names reach it.
type Scheme interface {
	// Identify says whether name is this scheme's and, if so, the ID of
	// the device it names. A name that is the scheme's but malformed is
	// an error.
	Identify(name string) (id ID, ok bool, err error)
	// Open opens the device name names, for reading only with readOnly.
	Open(name string, readOnly bool) (Device, error)
}

// Open returns the device name refers to, opening it on first use.
func (p *Pool) Open(name string) (Device, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if d, ok := p.byName[name]; ok {
		return d, nil
	}
	id, open, err := p.identify(name)
	if err != nil {
		return nil, err
	}
	d, ok := p.byID[id]
	if !ok {
		inner, err := open()
		if err != nil {
			return nil, err
		}
		d = inner
		if f, ok := inner.(*File); ok && !f.block && !p.NoHoleMap {
			d = NewHoleMap(f)
		}
		if p.Wrap != nil {
			d = p.Wrap(d)
		}
		p.add(id, d)
	}
	if p.byName == nil {
		p.byName = make(map[string]Device)
	}
	p.byName[name] = d
	return d, nil
}

// Add puts an already opened device (an in-memory or stacked device) into the
// pool under name, wrapping it like any other.
func (p *Pool) Add(name string, d Device) Device {
	p.mu.Lock()
	defer p.mu.Unlock()
	if have, ok := p.byID[d.ID()]; ok {
		return have
	}
	if p.Wrap != nil {
		d = p.Wrap(d)
	}
	p.add(d.ID(), d)
	if p.byName == nil {
		p.byName = make(map[string]Device)
	}
	p.byName[name] = d
	return d
}

// identify finds the ID of the device name names and how to open it: by
// the first Scheme that claims the name, or as a path.
func (p *Pool) identify(name string) (ID, func() (Device, error), error) {
	for _, s := range p.Schemes {
		id, ok, err := s.Identify(name)
		if err != nil {
			return ID{}, nil, err
		}
		if ok {
			return id, func() (Device, error) { return s.Open(name, p.ReadOnly) }, nil
		}
	}
	path, _ := resolve(name)
	id, err := statID(path)
	if err != nil {
		return ID{}, nil, err
	}
	return id, func() (Device, error) {
		f, err := OpenFile(path, p.ReadOnly)
		if err != nil {
			return nil, err
		}
		return f, nil
	}, nil
}

func (p *Pool) add(id ID, d Device) {
	if p.byID == nil {
		p.byID = make(map[ID]Device)
	}
	p.byID[id] = d
	p.order = append(p.order, d)
}

// Devices lists the distinct devices in the order they were opened.
func (p *Pool) Devices() []Device {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]Device(nil), p.order...)
}

// Sync syncs every device in the pool (used at shutdown).
func (p *Pool) Sync() error {
	var errs []error
	for _, d := range p.Devices() {
		if err := d.Sync(); err != nil {
			errs = append(errs, fmt.Errorf("sync %s: %w", d.Name(), err))
		}
	}
	return errors.Join(errs...)
}

// Close closes every device.
func (p *Pool) Close() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	var errs []error
	for _, d := range p.order {
		if err := d.Close(); err != nil {
			errs = append(errs, err)
		}
	}
	p.order, p.byID, p.byName = nil, nil, nil
	return errors.Join(errs...)
}

func statID(path string) (ID, error) {
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		return ID{}, &os.PathError{Op: "stat", Path: path, Err: err}
	}
	if st.Mode&unix.S_IFMT == unix.S_IFBLK {
		return ID{Block: true, Dev: st.Rdev}, nil
	}
	return ID{Dev: st.Dev, Ino: st.Ino}, nil
}
