//go:build nbdmapper_broken_snapshot

package snapshot

import (
	"fmt"
	"os"

	"github.com/nbdmapper/nbdmapper/backing"
)

// A deliberately broken build for the crash tests (docs/crash.md): the
// metadata area is written with the data chunks it points at still in a
// volatile cache, so a power cut may persist the metadata first, and a
// merge clears exceptions before the origin holds their chunks durably.
// Never ship it.
func init() {
	fmt.Fprintln(os.Stderr, "nbdmapper: BROKEN TEST BUILD (nbdmapper_broken_snapshot): COW metadata is not ordered after its data, nor after a merge's origin writes")
}

func syncBeforeMetadata(backing.Device) error { return nil }

func syncMerged(backing.Device) error { return nil }
