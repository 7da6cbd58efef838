package mapped

import (
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nbdmapper/nbdmapper/backing"
	"github.com/nbdmapper/nbdmapper/discard"
	"github.com/nbdmapper/nbdmapper/flush"
	"github.com/nbdmapper/nbdmapper/table"
)

// ErrBeyondEnd fails a request whose range lies past the end of the active
// table: the device shrank after the request was validated.
var ErrBeyondEnd = errors.New("beyond the end of the device")

// ErrClosed fails a Suspend or Resume of a closed device.
var ErrClosed = errors.New("device closed")

// Device is a mapped device. Its methods are safe for concurrent use.
type Device struct {
	name    string // as dmsetup names it; other tables refer to /dev/mapper/<name>
	id      backing.ID
	flush   *flush.Engine
	discard *discard.Engine

	// PerSegmentFlush makes Flush sync every device once per table line
	// that uses it, as dm did before Linux 6.11. Benchmark baseline only.
	PerSegmentFlush bool

	active atomic.Pointer[live]

	// I/O admission: every request adds itself to inFlight, then checks
	// holding; Suspend sets holding, then waits for inFlight to drain.
	inFlight atomic.Int64
	holding  atomic.Bool

	cycle sync.Mutex // serialises Suspend, Resume and Close

	mu        sync.Mutex
	changed   sync.Cond // inFlight drained, or holding cleared
	closed    bool
	suspended bool
	since     time.Time // when the current suspend began
	// flushFailed: the current suspend's flush failed (see unsynced).
	flushFailed bool
	inactive    *table.Table // loaded by Load, activated by Resume
	st          counters     // under mu, except held
	held        atomic.Int64

	// unsynced are the devices of tables swapped out after the suspend's
	// flush of them failed: acknowledged writes on them may be lost, so
	// every later Flush asks them again, and the flush engine's failed
	// sync fails it, as it would have had they stayed in the table.
	unsynced atomic.Pointer[[]backing.Device]
}

// live is an active table and what is derived from it once.
type live struct {
	t       *table.Table
	raw     []backing.Device // the table's devices, mapped devices among them
	devs    []backing.Device // the real devices below, each once
	stacked bool             // some are mapped devices: flatten per flush
	// mem is the most one request holds in the table's targets and its
	// devices beyond its own buffer (their RequestMemory, summed over the
	// layers a request crosses); below are the mapped devices it is
	// stacked on, whose own share is asked per request, as their tables
	// may change.
	mem   int64
	below []*Device
}

// requestMemory is implemented by targets that hold memory for a request
// beyond its buffer: the snapshot targets' copy buffers.
type requestMemory interface {
	RequestMemory() int64
}

type counters struct {
	suspends, resumes, reloads uint64
	suspended                  time.Duration
}

// Mapped devices get IDs no file, block device, backing.Mem or snapshot
// device has.
const mappedDev = ^uint64(0) - 2

var mappedIno atomic.Uint64

// New makes the mapped device NAME with table t active. Its flushes and
// discards go through f and d, which every device of a server shares.
func New(name string, t *table.Table, f *flush.Engine, d *discard.Engine) *Device {
	m := &Device{name: name, id: backing.ID{Dev: mappedDev, Ino: mappedIno.Add(1)}, flush: f, discard: d}
	m.changed.L = &m.mu
	m.active.Store(newLive(t))
	t.Activate() // created and resumed, as dmsetup create does
	return m
}

func newLive(t *table.Table) *live {
	devs := t.Devices()
	l := &live{t: t, raw: devs, devs: table.Flatten(devs)}
	var targets, devices int64
	for _, ln := range t.Lines {
		if r, ok := ln.Target.(requestMemory); ok {
			targets = max(targets, r.RequestMemory())
		}
	}
	for _, d := range devs {
		if md, ok := d.(*Device); ok {
			l.stacked = true
			l.below = append(l.below, md)
			continue
		}
		devices = max(devices, d.Limits().RequestMemory)
	}
	l.mem = targets + devices
	return l
}

// RequestMemory is the most memory one request holds below the device
// beyond its own buffer: a snapshot's copy buffer, a remote's head and
// tail blocks, at every layer of a stack. The server charges it to its
// memory budget with the request. It follows reloads, here and below.
func (m *Device) RequestMemory() int64 {
	l := m.active.Load()
	var below int64
	for _, d := range l.below {
		below = max(below, d.RequestMemory())
	}
	return l.mem + below
}

// DeviceName is the device's name without /dev/mapper/.
func (m *Device) DeviceName() string { return m.name }

// Table is the active table.
func (m *Device) Table() *table.Table { return m.active.Load().t }

// Size is the active table's size in bytes.
func (m *Device) Size() int64 { return m.active.Load().t.Size() }

// enter admits one request and returns the table it runs on; exit must
// follow. While the device is suspended the request waits here; if the
// device is closed meanwhile (serve's shutdown, which no resume will
// follow) it fails with ErrClosed and exit must not follow.
func (m *Device) enter() (*live, error) {
	for {
		m.inFlight.Add(1)
		if !m.holding.Load() {
			return m.active.Load(), nil
		}
		m.exit()
		m.held.Add(1)
		m.mu.Lock()
		for m.holding.Load() && !m.closed {
			m.changed.Wait()
		}
		closed := m.closed
		m.mu.Unlock()
		if closed {
			return nil, ErrClosed
		}
	}
}

// exit ends a request admitted by enter, waking a Suspend that waits for
// the last one.
func (m *Device) exit() {
	if m.inFlight.Add(-1) == 0 && m.holding.Load() {
		m.mu.Lock()
		m.changed.Broadcast()
		m.mu.Unlock()
	}
}

// admit is enter plus the range check every request makes against the
// table it got: the protocol edge validated [off, off+n) against the size
// it saw then, and a reload may have shrunk the device since.
func (m *Device) admit(off, n int64) (*live, error) {
	l, err := m.enter()
	if err != nil {
		return nil, err
	}
	if size := l.t.Size(); off < 0 || n < 0 || off > size || n > size-off {
		m.exit()
		return nil, fmt.Errorf("%w: [%d, %d) of %d bytes", ErrBeyondEnd, off, off+n, size)
	}
	return l, nil
}

// Load holds t as the inactive table, to become active at the next
// Resume; a table loaded before and not yet activated is closed. t must
// have been validated completely (table.Parse does). A closed device
// closes t at once.
func (m *Device) Load(t *table.Table) {
	m.mu.Lock()
	old := m.inactive
	if m.closed {
		// Close has taken the inactive table already: held, t would
		// keep its snapshot registered and its COW claimed for good.
		old = t
	} else {
		m.inactive = t
		m.st.reloads++
	}
	m.mu.Unlock()
	if old != nil {
		m.closeTable(old)
	}
}

// ClearInactive drops a loaded table (dmsetup clear).
func (m *Device) ClearInactive() {
	m.mu.Lock()
	old := m.inactive
	m.inactive = nil
	m.mu.Unlock()
	if old != nil {
		m.closeTable(old)
	}
}

// Suspend stops admitting requests, waits for those in flight, and
// flushes every device below, as dm's suspend does; new requests wait
// until Resume. Suspending a suspended device does nothing, unless the
// flush of its suspend failed: then it flushes again. Background
// work of the table's targets (a snapshot-merge's merge) stops first, as
// in dm's presuspend, after the step in progress.
func (m *Device) Suspend() error {
	m.cycle.Lock()
	defer m.cycle.Unlock()
	return m.suspend()
}

func (m *Device) suspend() error {
	m.mu.Lock()
	if m.closed {
		m.mu.Unlock()
		return ErrClosed
	}
	if m.suspended {
		retry := m.flushFailed
		m.mu.Unlock()
		if retry {
			// Suspended, but the writes before it are not durable:
			// the caller asks again whether they are.
			return m.flushSuspended()
		}
		return nil
	}
	m.mu.Unlock()
	m.active.Load().t.Deactivate()
	m.mu.Lock()
	m.holding.Store(true)
	for m.inFlight.Load() > 0 && !m.closed {
		m.changed.Wait()
	}
	if m.closed {
		// Requests in flight may never end (held by a suspended device
		// below): Close, which waits for this suspend, must not too.
		m.mu.Unlock()
		return ErrClosed
	}
	m.suspended = true
	m.since = time.Now()
	m.st.suspends++
	m.mu.Unlock()
	return m.flushSuspended()
}

// flushSuspended is the flush of a suspend, recording whether it failed.
func (m *Device) flushSuspended() error {
	err := m.flush.Flush(m.devices(m.active.Load()))
	m.mu.Lock()
	m.flushFailed = err != nil
	m.mu.Unlock()
	return err
}

// Resume makes the inactive table active, if one is loaded, and releases
// the requests held while suspended. Resuming a device that is not
// suspended with a table loaded suspends it first, as dm does. It reports
// whether the table changed. The active table's targets are activated
// before held requests go on: a snapshot taking another's store over does
// so here, and a merge starts or resumes.
func (m *Device) Resume() (swapped bool, err error) {
	m.cycle.Lock()
	defer m.cycle.Unlock()
	// A table is swapped only on a suspended device. Load takes no part in
	// the suspend cycle, so one may come while this suspends: check again
	// under the lock that the swap below holds.
	m.mu.Lock()
	if m.closed {
		m.mu.Unlock()
		return false, ErrClosed
	}
	for !m.suspended && m.inactive != nil {
		m.mu.Unlock()
		if err := m.suspend(); err != nil {
			return false, err
		}
		m.mu.Lock()
	}
	var old *table.Table
	if m.inactive != nil {
		gone := m.active.Swap(newLive(m.inactive))
		old = gone.t
		m.inactive = nil
		if m.flushFailed {
			keep := append(slices.Clone(m.unsyncedDevices()), m.devices(gone)...)
			m.unsynced.Store(&keep)
			m.flushFailed = false
		}
	}
	resuming := m.suspended
	m.mu.Unlock()
	if resuming {
		m.active.Load().t.Activate()
	}
	m.mu.Lock()
	if m.suspended {
		m.st.suspended += time.Since(m.since)
		m.st.resumes++
	}
	m.suspended = false
	m.holding.Store(false)
	m.changed.Broadcast()
	m.mu.Unlock()
	if old != nil {
		// Nothing runs on it any more: everything in flight drained at
		// suspend, and new requests see the new table.
		if err := m.closeTable(old); err != nil {
			return true, fmt.Errorf("closing the old table: %w", err)
		}
	}
	return old != nil, nil
}

// Info is a snapshot of a device's lifecycle state, as `dmsetup info`
// reports it.
type Info struct {
	Name          string
	Size          int64
	Suspended     bool
	InactiveTable bool  // a table is loaded and not yet active
	InFlight      int64 // requests running on the active table
	Suspends      uint64
	Resumes       uint64
	Reloads       uint64
	Held          int64         // requests that waited for a resume, ever
	SuspendedTime time.Duration // total time suspended, the current suspend included
}

// Info reports the device's state.
func (m *Device) Info() Info {
	m.mu.Lock()
	defer m.mu.Unlock()
	in := Info{
		Name:          m.name,
		Size:          m.active.Load().t.Size(),
		Suspended:     m.suspended,
		InactiveTable: m.inactive != nil,
		InFlight:      m.inFlight.Load(),
		Suspends:      m.st.suspends,
		Resumes:       m.st.resumes,
		Reloads:       m.st.reloads,
		Held:          m.held.Load(),
		SuspendedTime: m.st.suspended,
	}
	if m.suspended {
		in.SuspendedTime += time.Since(m.since)
	}
	return in
}

// InactiveTable is the table loaded and not yet active, or nil.
func (m *Device) InactiveTable() *table.Table {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.inactive
}

// closeTable closes t, and makes the discard engine forget the devices
// t's targets made (a snapshot's): nothing reaches them after, and a
// table reloaded again and again would otherwise leave each one there.
func (m *Device) closeTable(t *table.Table) error {
	made := t.Made()
	err := t.Close()
	for _, d := range made {
		m.discard.Forget(d)
	}
	return err
}

// unsyncedDevices is what unsynced holds.
func (m *Device) unsyncedDevices() []backing.Device {
	if p := m.unsynced.Load(); p != nil {
		return *p
	}
	return nil
}

// devices are the real devices below l, for a flush: precomputed, unless
// some are mapped devices, whose tables may have changed since.
func (m *Device) devices(l *live) []backing.Device {
	if l.stacked {
		return table.Flatten(l.raw)
	}
	return l.devs
}
