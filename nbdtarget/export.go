package nbdtarget

import (
	"sync/atomic"

	"github.com/nbdmapper/nbdmapper/mapped"
)

// Export is one named virtual device as clients see it: a mapped device
// and what the protocol needs to know about it. Requests reaching the
// device have been validated at the protocol edge (range, flags,
// read-only).
type Export struct {
	Name        string
	Description string // sent in LIST and INFO only if set: nothing of the host
	Dev         *mapped.Device
	ReadOnly    bool

	// Access, if set, admits only TLS clients with a verified certificate
	// it names (see Access); others get ERR_POLICY and do not see the
	// export in LIST.
	Access *Access

	st      exportStats
	removed atomic.Bool // RemoveExport took it out: connections to it end
}

// Size is the export size in bytes, as of now: a reload may change it.
func (x *Export) Size() int64 { return x.Dev.Size() }
