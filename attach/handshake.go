package attach

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"

	"github.com/pojntfx/go-nbd/pkg/protocol"
)

// Client side of the fixed-newstyle handshake, just enough to hand a socket
// to the kernel: the kernel then speaks the transmission phase itself, with
// simple replies only, so no structured replies or meta contexts are asked
// for. All integers are big-endian. The values come from go-nbd's protocol
// package, as the server's (nbdtarget/wire.go) do, so both ends of the
// project share one source for them.
const (
	nbdMagic      = protocol.NEGOTIATION_MAGIC_OLDSTYLE // "NBDMAGIC": u64, first thing the server sends
	ihaveOpt      = protocol.NEGOTIATION_MAGIC_OPTION   // "IHAVEOPT": u64, after it, and before every option
	optReplyMagic = protocol.NEGOTIATION_MAGIC_REPLY    // u64, starts every option reply

	flagFixedNewstyle = protocol.NEGOTIATION_HANDSHAKE_FLAG_FIXED_NEWSTYLE // handshake flag (u16) and client flag (u32)
	flagNoZeroes      = 1 << 1

	optExportName = 1                                    // data: name; reply: u64 size, u16 flags, [124 zero bytes]
	optAbort      = protocol.NEGOTIATION_ID_OPTION_ABORT // no data
	optGo         = protocol.NEGOTIATION_ID_OPTION_GO    // data: u32 len, name, u16 n, n * u16 info type

	repAck   = protocol.NEGOTIATION_TYPE_REPLY_ACK             // option done
	repInfo  = protocol.NEGOTIATION_TYPE_REPLY_INFO            // data: u16 info type, then type-specific fields
	repErr   = 1 << 31                                         // set in every error reply type
	errUnsup = protocol.NEGOTIATION_TYPE_REPLY_ERR_UNSUPPORTED // option not supported

	infoExport    = protocol.NEGOTIATION_TYPE_INFO_EXPORT    // u64 size, u16 transmission flags
	infoBlockSize = protocol.NEGOTIATION_TYPE_INFO_BLOCKSIZE // u32 minimum, u32 preferred, u32 maximum payload
)

// Transmission flags (u16) the kernel cares about.
const (
	FlagHasFlags     = 1 << 0
	FlagReadOnly     = 1 << 1
	FlagSendFlush    = 1 << 2
	FlagSendFUA      = 1 << 3
	FlagRotational   = 1 << 4
	FlagSendTrim     = 1 << 5
	FlagWriteZeroes  = 1 << 6
	FlagCanMultiConn = 1 << 8
)

// Errors a caller can act on.
var (
	ErrNotNBD      = errors.New("not an NBD server (bad magic)")
	ErrOldstyle    = errors.New("server does not speak fixed newstyle")
	ErrRefused     = errors.New("server refused the export")
	ErrBlockSize   = errors.New("block size must be a power of two in 512..4096")
	ErrMultiConn   = errors.New("several connections need CAN_MULTI_CONN")
	ErrNoSize      = errors.New("export smaller than one block")
	ErrProtocol    = errors.New("NBD protocol error")
	ErrNotAttached = errors.New("device is not attached")
)

// Export is what the handshake learned about an export.
type Export struct {
	Size  uint64
	Flags uint16 // transmission flags, as sent to the kernel
	// Block sizes from NBD_INFO_BLOCK_SIZE; zero when the server sent none.
	MinBlock, PrefBlock, MaxBlock uint32
}

// Handshake negotiates export name on rw (a freshly dialled connection) and
// leaves it at the start of the transmission phase. It prefers OPT_GO, which
// reports a refusal politely, and falls back to OPT_EXPORT_NAME for servers
// that do not know OPT_GO.
func Handshake(rw io.ReadWriter, name string) (Export, error) {
	var hdr [18]byte
	if _, err := io.ReadFull(rw, hdr[:]); err != nil {
		return Export{}, fmt.Errorf("handshake: %w", err)
	}
	if binary.BigEndian.Uint64(hdr[0:]) != nbdMagic {
		return Export{}, ErrNotNBD
	}
	if binary.BigEndian.Uint64(hdr[8:]) != ihaveOpt {
		return Export{}, ErrOldstyle
	}
	sflags := binary.BigEndian.Uint16(hdr[16:])
	if sflags&flagFixedNewstyle == 0 {
		return Export{}, ErrOldstyle
	}
	cflags := uint32(flagFixedNewstyle)
	noZeroes := sflags&flagNoZeroes != 0
	if noZeroes {
		cflags |= flagNoZeroes
	}
	if err := binary.Write(rw, binary.BigEndian, cflags); err != nil {
		return Export{}, fmt.Errorf("handshake: %w", err)
	}

	x, err := optGoExport(rw, name)
	if errors.Is(err, errGoUnsupported) {
		return exportName(rw, name, noZeroes)
	}
	return x, err
}

var errGoUnsupported = errors.New("OPT_GO unsupported")

func sendOption(w io.Writer, opt uint32, data []byte) error {
	b := make([]byte, 16+len(data))
	binary.BigEndian.PutUint64(b[0:], ihaveOpt)
	binary.BigEndian.PutUint32(b[8:], opt)
	binary.BigEndian.PutUint32(b[12:], uint32(len(data)))
	copy(b[16:], data)
	_, err := w.Write(b)
	return err
}

// optGoExport sends OPT_GO asking for the block size info and reads the
// replies up to the final ACK.
func optGoExport(rw io.ReadWriter, name string) (Export, error) {
	data := make([]byte, 0, 4+len(name)+4)
	data = binary.BigEndian.AppendUint32(data, uint32(len(name)))
	data = append(data, name...)
	data = binary.BigEndian.AppendUint16(data, 1)
	data = binary.BigEndian.AppendUint16(data, infoBlockSize)
	if err := sendOption(rw, optGo, data); err != nil {
		return Export{}, fmt.Errorf("OPT_GO: %w", err)
	}
	var x Export
	haveExport := false
	for {
		var rh [20]byte // u64 magic, u32 option, u32 type, u32 length
		if _, err := io.ReadFull(rw, rh[:]); err != nil {
			return Export{}, fmt.Errorf("OPT_GO reply: %w", err)
		}
		if binary.BigEndian.Uint64(rh[0:]) != optReplyMagic || binary.BigEndian.Uint32(rh[8:]) != optGo {
			return Export{}, fmt.Errorf("OPT_GO reply header: %w", ErrProtocol)
		}
		typ := binary.BigEndian.Uint32(rh[12:])
		n := binary.BigEndian.Uint32(rh[16:])
		if n > 64<<10 {
			return Export{}, fmt.Errorf("OPT_GO reply of %d bytes: %w", n, ErrProtocol)
		}
		body := make([]byte, n)
		if _, err := io.ReadFull(rw, body); err != nil {
			return Export{}, fmt.Errorf("OPT_GO reply: %w", err)
		}
		switch {
		case typ == repAck:
			if !haveExport {
				return Export{}, fmt.Errorf("OPT_GO: ACK without NBD_INFO_EXPORT: %w", ErrProtocol)
			}
			return x, nil
		case typ == repInfo && len(body) >= 2:
			switch binary.BigEndian.Uint16(body) {
			case infoExport:
				if len(body) != 12 {
					return Export{}, fmt.Errorf("NBD_INFO_EXPORT of %d bytes: %w", len(body), ErrProtocol)
				}
				x.Size = binary.BigEndian.Uint64(body[2:])
				x.Flags = binary.BigEndian.Uint16(body[10:])
				haveExport = true
			case infoBlockSize:
				if len(body) != 14 {
					return Export{}, fmt.Errorf("NBD_INFO_BLOCK_SIZE of %d bytes: %w", len(body), ErrProtocol)
				}
				x.MinBlock = binary.BigEndian.Uint32(body[2:])
				x.PrefBlock = binary.BigEndian.Uint32(body[6:])
				x.MaxBlock = binary.BigEndian.Uint32(body[10:])
			}
		case typ == errUnsup:
			return Export{}, errGoUnsupported
		case typ&repErr != 0:
			return Export{}, fmt.Errorf("export %q: %w: error %d: %s", name, ErrRefused, typ&^repErr, body)
		}
	}
}

// exportName is the old way in: no error reply is possible, a refusal is a
// closed connection.
func exportName(rw io.ReadWriter, name string, noZeroes bool) (Export, error) {
	if err := sendOption(rw, optExportName, []byte(name)); err != nil {
		return Export{}, fmt.Errorf("OPT_EXPORT_NAME: %w", err)
	}
	n := 10
	if !noZeroes {
		n += 124
	}
	b := make([]byte, n)
	if _, err := io.ReadFull(rw, b); err != nil {
		return Export{}, fmt.Errorf("export %q: %w: %w", name, ErrRefused, err)
	}
	return Export{Size: binary.BigEndian.Uint64(b), Flags: binary.BigEndian.Uint16(b[8:])}, nil
}
