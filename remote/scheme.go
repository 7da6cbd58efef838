package remote

import (
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nbdmapper/nbdmapper/backing"
)

// Scheme opens NBD URIs for a backing.Pool (backing.Scheme), which asks it
// before it takes a name for a path: cmd/nbdmapper installs one, so that
// backing needs no network and this package is the only one that dials.
// Its identity for an export is the URI's normal form, so the Pool opens
// each remote export once however many lines, tables and spellings name
// it.
type Scheme struct {
	Options Options
	// Unconnected makes Open return devices that do not connect, for
	// checking a table's syntax: their size is the largest a table can
	// map, and every I/O fails.
	Unconnected bool

	mu      sync.Mutex
	devs    []*Device
	observe atomic.Pointer[func(device, op string, d time.Duration)]
}

var _ backing.Scheme = (*Scheme)(nil)

// Identify claims every name written as an NBD URI (IsURI); a malformed
// one is an error naming what is wrong.
func (s *Scheme) Identify(name string) (backing.ID, bool, error) {
	if !IsURI(name) {
		return backing.ID{}, false, nil
	}
	u, err := ParseURI(name)
	if err != nil {
		return backing.ID{}, true, err
	}
	return backing.ID{URI: u.String()}, true, nil
}

// Open connects to the export name names (see Open).
func (s *Scheme) Open(name string, readOnly bool) (backing.Device, error) {
	u, err := ParseURI(name)
	if err != nil {
		return nil, err
	}
	if s.Unconnected {
		return backing.Unconnected(name, backing.ID{URI: u.String()}), nil
	}
	d, err := Open(name, u, readOnly, s.Options)
	if err != nil {
		return nil, err
	}
	d.observe.Store(s.observe.Load())
	s.mu.Lock()
	s.devs = append(s.prune(), d)
	s.mu.Unlock()
	return d, nil
}

// prune drops the devices closed since (a backing.Pool closes a device no
// table names any more), so that the list holds the open ones only. s.mu
// must be held.
func (s *Scheme) prune() []*Device {
	s.devs = slices.DeleteFunc(s.devs, (*Device).isClosed)
	return s.devs
}

// Observe sets a function called after every request's last reply with
// the device's name, the op and the round trip (the metrics package fills
// a histogram from it). It may be set at any time.
func (s *Scheme) Observe(fn func(device, op string, d time.Duration)) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.observe.Store(&fn)
	for _, d := range s.devs {
		d.observe.Store(&fn)
	}
}

// Devices lists the remote devices open, in order of opening.
func (s *Scheme) Devices() []*Device {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.prune())
}

// Stats returns every open device's counters, in order of opening.
func (s *Scheme) Stats() []Stats {
	devs := s.Devices()
	out := make([]Stats, len(devs))
	for i, d := range devs {
		out[i] = d.Stats()
	}
	return out
}
