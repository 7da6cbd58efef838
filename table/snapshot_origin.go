package table

import (
	"fmt"

	"github.com/nbdmapper/nbdmapper/backing"
	"github.com/nbdmapper/nbdmapper/snapshot"
)

// snapshot-origin <dev>
//
// newSnapshotOrigin passes the line through to <dev>, except that writes
// (and discards and zeroing) first copy the chunks they change out to
// every snapshot of <dev>, loaded in this table or any other. As in dm the
// line's sectors are <dev>'s sectors: a line at sector S starts at <dev>'s
// sector S.
func newSnapshotOrigin(open Opener, start, length Sector, args []string) (Target, error) {
	if len(args) != 1 {
		return nil, fmt.Errorf("%w: want <dev>, got %d arguments", ErrArgCount, len(args))
	}
	dev, name, err := openArea(open, args[0], 0, start+length)
	if err != nil {
		return nil, err
	}
	o, err := snapshot.NewOrigin("snapshot-origin "+name, dev, (start + length).Bytes())
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrSnapshot, err)
	}
	return &originTarget{o: o, base: start.Bytes(), name: name}, nil
}

type originTarget struct {
	o    *snapshot.Origin
	base int64 // the line's start in bytes, as in snapshotTarget
	name string
}

func (t *originTarget) Type() string   { return "snapshot-origin" }
func (t *originTarget) Status() string { return "" }
func (t *originTarget) Args() []string { return []string{t.name} }

func (t *originTarget) Map(off, n int64, yield func(Extent) bool) bool {
	return yield(Extent{Kind: KindMapped, Dev: t.o, Off: t.base + off, VOff: off, Len: n})
}

// Devices is the origin device as opened (copy-outs are synced to the COW
// devices when committed, so only the origin needs a flush). A mapped
// origin is expanded per flush, as for snapshotTarget.
func (t *originTarget) Devices() []backing.Device { return t.o.Devices() }

// RequestMemory is the copy buffer a write's copy-outs hold (see
// snapshot.CopyMemory).
func (t *originTarget) RequestMemory() int64 { return snapshot.CopyMemory }

// Made is the snapshot-origin device the line maps to.
func (t *originTarget) Made() backing.Device { return t.o }

// Close frees the origin's snapshot group once nothing else uses it.
func (t *originTarget) Close() error { return t.o.Close() }
