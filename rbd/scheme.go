package rbd

import (
	"errors"
	"time"

	"github.com/nbdmapper/nbdmapper/backing"
)

// DefaultTimeout bounds each request to a cluster, librados' own retries
// included, as remote.DefaultTimeout does a remote export's.
const DefaultTimeout = 30 * time.Second

// ErrNoCeph is returned by Open in a binary built without `-tags ceph`.
// Ceph 16 (Debian 12's) also needs go-ceph's tag for it, pacific.
var ErrNoCeph = errors.New("built without ceph support; build with -tags ceph (-tags ceph,pacific for Ceph 16 as in Debian 12; needs cgo, librbd-dev and librados-dev)")

// Options are the settings of every image a Scheme opens.
type Options struct {
	// Timeout bounds each request, librados' retries included, and
	// connecting; then the request fails (EIO to the client). 0 is
	// DefaultTimeout.
	Timeout time.Duration
}

// Scheme opens rbd: names for a backing.Pool (backing.Scheme), which asks
// it before it takes a name for a path; cmd/nbdmapper installs one. Its
// identity for an image is the name's normal form (Name.String).
type Scheme struct {
	Options Options
	// Unconnected makes Open return devices that do not connect, for
	// checking a table's syntax: their size is the largest a table can
	// map, and every I/O fails. Without ceph support Open fails all the
	// same, so that a check says so before a serve does.
	Unconnected bool
}

var _ backing.Scheme = (*Scheme)(nil)

// Identify claims every name that starts with "rbd:"; a malformed one is
// an error naming what is wrong.
func (s *Scheme) Identify(name string) (backing.ID, bool, error) {
	if !IsName(name) {
		return backing.ID{}, false, nil
	}
	n, err := ParseName(name)
	if err != nil {
		return backing.ID{}, true, err
	}
	return backing.ID{URI: n.String()}, true, nil
}

// Open opens the image name names, read-only with readOnly or when name
// names a snapshot.
func (s *Scheme) Open(name string, readOnly bool) (backing.Device, error) {
	n, err := ParseName(name)
	if err != nil {
		return nil, err
	}
	if !Supported {
		return nil, ErrNoCeph
	}
	if s.Unconnected {
		return backing.Unconnected(name, backing.ID{URI: n.String()}), nil
	}
	opt := s.Options
	if opt.Timeout <= 0 {
		opt.Timeout = DefaultTimeout
	}
	return open(name, n, readOnly || n.Snap != "", opt)
}
