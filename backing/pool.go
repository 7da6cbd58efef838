package backing

import (
	"errors"
	"fmt"
	"os"
	"sync"

	"golang.org/x/sys/unix"
)

// Pool opens each distinct underlying device once. Tables ask it for devices
// by the name they were given (a path or major:minor); two names for the same
// file or block device return the same Device, so that every engine above
// sees one Device per disk.
type Pool struct {
	// ReadOnly opens devices for reading only.
	ReadOnly bool
	// Wrap, if set, wraps each device once when it is first opened (the
	// flush engine's dirty tracking, a fault injector in tests).
	Wrap func(Device) Device
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

// Open returns the device name refers to, opening it on first use.
func (p *Pool) Open(name string) (Device, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if d, ok := p.byName[name]; ok {
		return d, nil
	}
	path, _ := resolve(name)
	id, err := statID(path)
	if err != nil {
		return nil, err
	}
	d, ok := p.byID[id]
	if !ok {
		f, err := OpenFile(path, p.ReadOnly)
		if err != nil {
			return nil, err
		}
		d = f
		if !f.block && !p.NoHoleMap {
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
