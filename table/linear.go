package table

import (
	"fmt"
	"strconv"

	"github.com/nbdmapper/nbdmapper/backing"
)

// linear <dev> <offset>
//
// newLinear maps the line one to one onto <dev> from sector <offset>, as
// dm-linear does. The whole area must lie inside the device.
func newLinear(open Opener, _, length Sector, args []string) (Target, error) {
	if len(args) != 2 {
		return nil, fmt.Errorf("%w: want <dev> <offset>, got %d arguments", ErrArgCount, len(args))
	}
	off, err := parseSector("offset", args[1])
	if err != nil {
		return nil, err
	}
	dev, name, err := openArea(open, args[0], off, length)
	if err != nil {
		return nil, err
	}
	return &linear{devs: [1]backing.Device{dev}, name: name, off: off}, nil
}

type linear struct {
	devs [1]backing.Device // kept as an array so Devices need not allocate
	name string            // as the table gave it
	off  Sector
}

func (l *linear) Type() string   { return "linear" }
func (l *linear) Status() string { return "" }
func (l *linear) Args() []string {
	return []string{l.name, strconv.FormatUint(uint64(l.off), 10)}
}

func (l *linear) Map(off, n int64, yield func(Extent) bool) bool {
	return yield(Extent{Kind: KindMapped, Dev: l.devs[0], Off: l.off.Bytes() + off, VOff: off, Len: n})
}

func (l *linear) Devices() []backing.Device { return l.devs[:] }
