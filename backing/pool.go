package backing

import (
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"
	"sync"

	"golang.org/x/sys/unix"
)

// Pool opens each distinct underlying device once. Tables ask it for devices
// by the name they were given (a path, major:minor, or a name one of its
// Schemes knows, such as an NBD URI); two names for the same file, block
// device or remote export return the same Device, so that every engine
// above sees one Device per disk.
//
// A device stays open while anything holds it: each Open takes a
// reference, and each Release gives one back. The last Release syncs the
// device and closes it, as `dmsetup remove` lets go of the disks below, so
// that a server whose devices come and go (create, reload, remove, a
// --tables directory) holds only what its tables name: no descriptor, no
// connection to a remote, no hole map of a file no table uses any more.
//
//	create a  (linear f 0)      Open f   f: 1 reference, opened
//	create b  (linear f 8 ...)  Open f   f: 2
//	remove a                    Release  f: 1
//	remove b                    Release  f: 0, synced and closed
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
	// Forget, if set, is called with each device the last Release closed,
	// as Wrap returned it, so that state kept per device elsewhere (the
	// discard engine's) goes with it.
	Forget func(Device)

	mu     sync.Mutex
	byID   map[ID]*pooled
	byName map[string]*pooled
	byDev  map[Device]*pooled
	order  []*pooled
	closed bool // Close ran: Release has nothing left to close
}

// pooled is one open device and what holds it.
type pooled struct {
	dev   Device // as Wrap returned it
	id    ID
	names []string // the names byName has for it
	refs  int      // Opens (and Add) not yet released
}

// ErrNotPooled is returned by Release for a device the pool does not hold.
var ErrNotPooled = errors.New("device not held by the pool")

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

// Open returns the device name refers to, opening it on first use, and
// takes a reference to it, which Release gives back. Finding and opening
// a device (a stat on a hung mount, a remote's dial and handshake) runs
// without the pool's lock, so that other Opens and Releases go on
// meanwhile; two Opens of one new device may both open it, and the one
// that comes second closes its copy and takes the first's.
func (p *Pool) Open(name string) (Device, error) {
	if d := p.ref(name, nil); d != nil {
		return d, nil
	}
	id, open, err := p.identify(name)
	if err != nil {
		return nil, err
	}
	if d := p.ref(name, &id); d != nil {
		return d, nil
	}
	inner, err := open()
	if err != nil {
		return nil, err
	}
	p.mu.Lock()
	if e, ok := p.byID[id]; ok {
		e.refs++
		p.name(e, name)
		p.mu.Unlock()
		inner.Close()
		return e.dev, nil
	}
	defer p.mu.Unlock()
	d := inner
	if f, ok := inner.(*File); ok && !f.block && !p.NoHoleMap {
		d = NewHoleMap(f)
	}
	if p.Wrap != nil {
		d = p.Wrap(d)
	}
	e := p.add(id, d)
	e.refs++
	p.name(e, name)
	return e.dev, nil
}

// ref takes a reference to the device open under name, or, with id, to
// the device open as id (recording name for it), if there is one.
func (p *Pool) ref(name string, id *ID) Device {
	p.mu.Lock()
	defer p.mu.Unlock()
	e, ok := p.byName[name]
	if !ok && id != nil {
		e, ok = p.byID[*id]
	}
	if !ok {
		return nil
	}
	e.refs++
	p.name(e, name)
	return e.dev
}

// Add puts an already opened device (an in-memory or stacked device) into the
// pool under name, wrapping it like any other. The pool holds it until
// Close, whatever is released: Add's reference is never given back.
func (p *Pool) Add(name string, d Device) Device {
	p.mu.Lock()
	defer p.mu.Unlock()
	if have, ok := p.byID[d.ID()]; ok {
		return have.dev
	}
	if p.Wrap != nil {
		d = p.Wrap(d)
	}
	e := p.add(d.ID(), d)
	e.refs++
	p.name(e, name)
	return d
}

// Release gives back a reference Open took to d. The last one syncs d
// (through Wrap's device, which may know it is clean), closes it, and
// hands it to Forget; the pool then opens its name afresh. A sync that
// fails is reported, and d is closed all the same: nothing holds it now
// to sync it again. Releasing after Close does nothing.
func (p *Pool) Release(d Device) error {
	p.mu.Lock()
	e := p.byDev[d]
	if e == nil {
		closed := p.closed
		p.mu.Unlock()
		if closed {
			return nil
		}
		return fmt.Errorf("release %s: %w", d.Name(), ErrNotPooled)
	}
	if e.refs--; e.refs > 0 {
		p.mu.Unlock()
		return nil
	}
	delete(p.byID, e.id)
	delete(p.byDev, e.dev)
	for _, n := range e.names {
		delete(p.byName, n)
	}
	p.order = slices.DeleteFunc(p.order, func(o *pooled) bool { return o == e })
	p.mu.Unlock()

	var errs []error
	if err := d.Sync(); err != nil {
		errs = append(errs, fmt.Errorf("sync %s: %w", d.Name(), err))
	}
	if err := d.Close(); err != nil {
		errs = append(errs, fmt.Errorf("close %s: %w", d.Name(), err))
	}
	if p.Forget != nil {
		p.Forget(d)
	}
	return errors.Join(errs...)
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

// add records d, opened as id, with no references yet. p.mu must be held.
func (p *Pool) add(id ID, d Device) *pooled {
	if p.byID == nil {
		p.byID = make(map[ID]*pooled)
		p.byDev = make(map[Device]*pooled)
	}
	e := &pooled{dev: d, id: id}
	p.byID[id] = e
	p.byDev[d] = e
	p.order = append(p.order, e)
	p.closed = false
	return e
}

// name records that name reaches e. p.mu must be held.
func (p *Pool) name(e *pooled, name string) {
	if p.byName == nil {
		p.byName = make(map[string]*pooled)
	}
	if _, ok := p.byName[name]; !ok {
		p.byName[name] = e
		e.names = append(e.names, name)
	}
}

// Devices lists the open devices in the order they were opened.
func (p *Pool) Devices() []Device {
	p.mu.Lock()
	defer p.mu.Unlock()
	out := make([]Device, len(p.order))
	for i, e := range p.order {
		out[i] = e.dev
	}
	return out
}

// Sync syncs every device in the pool at once (at shutdown), so that a
// device whose sync hangs holds up no other's. It returns once every sync
// has, or once ctx is done: its error then names the devices whose syncs
// have not returned, which go on in the background.
func (p *Pool) Sync(ctx context.Context) error {
	devs := p.Devices()
	errs := make([]error, len(devs))
	done := make(chan int, len(devs))
	for i, d := range devs {
		go func() {
			if err := d.Sync(); err != nil {
				errs[i] = fmt.Errorf("sync %s: %w", d.Name(), err)
			}
			done <- i
		}()
	}
	returned := make([]bool, len(devs))
	for range devs {
		select {
		case i := <-done:
			returned[i] = true
		case <-ctx.Done():
			var late []string
			var failed []error // of those that returned: the others still write theirs
			for i, d := range devs {
				if returned[i] {
					failed = append(failed, errs[i])
				} else {
					late = append(late, d.Name())
				}
			}
			return errors.Join(append(failed, fmt.Errorf("syncs of %s not returned: %w", strings.Join(late, ", "), ctx.Err()))...)
		}
	}
	return errors.Join(errs...)
}

// Close closes every device, however many references are out.
func (p *Pool) Close() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	var errs []error
	for _, e := range p.order {
		if err := e.dev.Close(); err != nil {
			errs = append(errs, err)
		}
	}
	p.order, p.byID, p.byName, p.byDev = nil, nil, nil, nil
	p.closed = true
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
