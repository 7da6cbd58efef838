package table

import (
	"fmt"

	"github.com/nbdmapper/nbdmapper/backing"
)

// zero
//
// newZero builds a target that reads as zeros and drops writes and
// discards, like dm-zero. It takes no arguments.
func newZero(_ Opener, _, _ Sector, args []string) (Target, error) {
	if len(args) != 0 {
		return nil, fmt.Errorf("%w: zero takes none, got %d", ErrArgCount, len(args))
	}
	return zeroTarget{}, nil
}

type zeroTarget struct{}

func (zeroTarget) Type() string              { return "zero" }
func (zeroTarget) Args() []string            { return nil }
func (zeroTarget) Status() string            { return "" }
func (zeroTarget) Devices() []backing.Device { return nil }

func (zeroTarget) Map(off, n int64, yield func(Extent) bool) bool {
	return yield(Extent{Kind: KindZero, VOff: off, Len: n})
}
