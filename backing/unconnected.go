package backing

import (
	"errors"
	"fmt"
	"math"
)

// ErrUnconnected fails I/O on a device that stands in for one a table
// names but that was not opened: a remote export or an RBD image while the
// table is only checked (nbdmapper check without --connect).
var ErrUnconnected = errors.New("not connected: the table was only checked")

// Unconnected returns a stand-in for the device name with identity id,
// of which nothing is known but its name: its size is as large as a
// table may need, and every I/O fails with ErrUnconnected.
func Unconnected(name string, id ID) Device { return &unconnected{name: name, id: id} }

type unconnected struct {
	name string
	id   ID
}

var _ Device = (*unconnected)(nil)

func (u *unconnected) err() error { return fmt.Errorf("%s: %w", u.name, ErrUnconnected) }

func (u *unconnected) Name() string                        { return u.name }
func (u *unconnected) ID() ID                              { return u.id }
func (u *unconnected) Size() int64                         { return math.MaxInt64 / 512 * 512 }
func (u *unconnected) ReadAt([]byte, int64) (int, error)   { return 0, u.err() }
func (u *unconnected) WriteAt([]byte, int64) (int, error)  { return 0, u.err() }
func (u *unconnected) Sync() error                         { return u.err() }
func (u *unconnected) Discard(int64, int64) error          { return u.err() }
func (u *unconnected) Zero(int64, int64, bool) error       { return u.err() }
func (u *unconnected) Holes(int64, int64) ([]Range, error) { return nil, u.err() }
func (u *unconnected) Limits() Limits                      { return Limits{Granularity: 1} }
func (u *unconnected) Close() error                        { return nil }
