package mapped

import (
	"errors"
	"slices"

	"github.com/nbdmapper/nbdmapper/backing"
	"github.com/nbdmapper/nbdmapper/discard"
	"github.com/nbdmapper/nbdmapper/table"
)

// A Device is also the backing device that another table names as
// /dev/mapper/NAME (table.ParseSet hands it out). Its reads and writes are
// the same requests as a client's, through the same admission (so a
// suspended device below holds the I/O of the devices above it, as in dm);
// Sync is a flush of the devices below, through the flush engine; Devices
// names them, so that flushes of the device above are deduplicated against
// the real devices rather than this one.
var _ backing.Device = (*Device)(nil)

func (m *Device) Name() string   { return table.MapperPrefix + m.name }
func (m *Device) ID() backing.ID { return m.id }
func (m *Device) Limits() backing.Limits {
	return backing.Limits{Granularity: table.SectorSize, RequestMemory: m.RequestMemory()}
}

// Below lists the devices the active table names, mapped devices among
// them, and the unsynced ones (see Devices), for table.Flatten.
func (m *Device) Below() []backing.Device {
	devs := m.active.Load().raw
	if lost := m.unsyncedDevices(); lost != nil {
		devs = append(slices.Clone(devs), lost...)
	}
	return devs
}

// Devices lists the real devices below the active table, and those of
// tables swapped out after their flush failed (see Device.unsynced): a
// device stacked on this one flushes them too, and fails as this one's
// Flush does.
func (m *Device) Devices() []backing.Device {
	devs := m.devices(m.active.Load())
	if lost := m.unsyncedDevices(); lost != nil {
		devs = append(slices.Clone(devs), lost...)
	}
	return devs
}

func (m *Device) ReadAt(p []byte, off int64) (int, error) {
	if _, err := m.Read(p, off); err != nil {
		return 0, err
	}
	return len(p), nil
}

func (m *Device) WriteAt(p []byte, off int64) (int, error) {
	if err := m.Write(p, off, false); err != nil {
		return 0, err
	}
	return len(p), nil
}

// Sync makes every write completed before it durable on the devices below.
func (m *Device) Sync() error { return m.Flush() }

// Discard is advisory: devices below that cannot discard are skipped.
func (m *Device) Discard(off, n int64) error {
	return m.eachBelow(off, n, func(e discard.Extent) error {
		if err := e.Dev.Discard(e.Off, e.Len); err != nil && !errors.Is(err, backing.ErrNotSupported) {
			return err
		}
		return nil
	})
}

// Zero zeroes natively where every device below can; otherwise it returns
// ErrNotSupported and the caller writes zeros through WriteAt.
func (m *Device) Zero(off, n int64, mayPunch bool) error {
	return m.eachBelow(off, n, func(e discard.Extent) error { return e.Dev.Zero(e.Off, e.Len, mayPunch) })
}

// eachBelow runs fn on the device extents under [off, off+n): the calls of
// the engine above, which planned them against this device, pass through.
func (m *Device) eachBelow(off, n int64, fn func(discard.Extent) error) error {
	l, err := m.admit(off, n)
	if err != nil {
		return err
	}
	defer m.exit()
	return walk(l.t, off, n, func(exts []discard.Extent, _ bool) error {
		for _, e := range exts {
			if err := fn(e); err != nil {
				return err
			}
		}
		return nil
	})
}

// Holes reports the holes below [off, off+n) and its zero-target lines, as
// far as BlockStatus looks; past that prefix it reports none, which a
// caller takes as data, the safe answer.
func (m *Device) Holes(off, n int64) ([]backing.Range, error) {
	exts, err := m.BlockStatus(off, n, 0, nil)
	var out []backing.Range
	pos := off
	for _, e := range exts {
		if e.Flags&StateHole != 0 {
			out = append(out, backing.Range{Off: pos, Len: e.Len})
		}
		pos += e.Len
	}
	return out, err
}

// Closed reports whether Close has been called, whether or not it
// succeeded: the device serves nothing after.
func (m *Device) Closed() bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.closed
}

// Close closes the active and any inactive table (a snapshot's
// registration with its origin, its claim on the COW device). The devices
// below belong to whoever opened them. A Suspend or Resume in progress
// finishes first, unless it is still waiting for requests in flight:
// that one, and any later, fails with ErrClosed. Requests held by a
// suspend fail with ErrClosed: no resume can release them now. Closing a
// closed device does nothing.
func (m *Device) Close() error {
	m.mu.Lock()
	if m.closed {
		m.mu.Unlock()
		return nil
	}
	m.closed = true
	m.changed.Broadcast() // a Suspend waiting for requests in flight gives up
	m.mu.Unlock()
	// Under cycle: a Resume would otherwise activate the table after it
	// was closed here (a merge starts on it, a store is taken over into
	// it and its COW claimed again), and a Suspend flush the devices
	// below after Close returned.
	m.cycle.Lock()
	defer m.cycle.Unlock()
	m.mu.Lock()
	inactive := m.inactive
	m.inactive = nil
	m.mu.Unlock()
	active := m.active.Load().t // no Resume swaps it now
	active.Deactivate()
	err := m.closeTable(active)
	if inactive != nil {
		err = errors.Join(err, m.closeTable(inactive))
	}
	m.discard.Forget(m) // as a device below another, now removed
	return err
}
