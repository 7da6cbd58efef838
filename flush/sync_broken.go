//go:build nbdmapper_broken_flush

package flush

import (
	"fmt"
	"os"

	"github.com/nbdmapper/nbdmapper/backing"
)

// A deliberately broken build for the crash tests (docs/crash.md): FLUSH
// is acknowledged without syncing anything. Never ship it.
func init() {
	fmt.Fprintln(os.Stderr, "nbdmapper: BROKEN TEST BUILD (nbdmapper_broken_flush): flushes do not sync")
}

func syncDevice(backing.Device) error { return nil }
