package attach

import (
	"errors"
	"io"

	"github.com/nbdmapper/nbdmapper/remote"
)

// The client side of the handshake is package remote's, which the remote
// backing devices use too; attach asks it for no structured replies or
// meta contexts, since the kernel speaks the transmission phase itself
// with simple replies only. The wire numbers (transmission flags among
// them) are package wire's, which the server (nbdtarget) shares.

// Errors a caller can act on. The handshake's are package remote's.
var (
	ErrNotNBD      = remote.ErrNotNBD
	ErrOldstyle    = remote.ErrOldstyle
	ErrRefused     = remote.ErrRefused
	ErrProtocol    = remote.ErrProtocol
	ErrBlockSize   = errors.New("block size must be a power of two in 512..4096")
	ErrMultiConn   = errors.New("several connections need CAN_MULTI_CONN")
	ErrNoSize      = errors.New("export smaller than one block")
	ErrNotAttached = errors.New("device is not attached")
)

// Export is what the handshake learned about an export.
type Export = remote.Export

// Handshake negotiates export name on rw (a freshly dialled connection) and
// leaves it at the start of the transmission phase, with simple replies:
// OPT_GO asking for the block sizes, or OPT_EXPORT_NAME for servers that do
// not know OPT_GO.
func Handshake(rw io.ReadWriter, name string) (Export, error) {
	return remote.Handshake(rw, remote.HandshakeOptions{Export: name})
}
