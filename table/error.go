package table

import (
	"fmt"

	"github.com/nbdmapper/nbdmapper/backing"
)

// error
//
// newError builds a target that fails every I/O, like dm's error target.
// It takes no arguments.
func newError(_ Opener, _, _ Sector, args []string) (Target, error) {
	if len(args) != 0 {
		return nil, fmt.Errorf("%w: error takes none, got %d", ErrArgCount, len(args))
	}
	return errorTarget{}, nil
}

type errorTarget struct{}

func (errorTarget) Type() string              { return "error" }
func (errorTarget) Args() []string            { return nil }
func (errorTarget) Status() string            { return "" }
func (errorTarget) Devices() []backing.Device { return nil }

func (errorTarget) Map(off, n int64, yield func(Extent) bool) bool {
	return yield(Extent{Kind: KindError, VOff: off, Len: n})
}
