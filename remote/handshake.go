package remote

import (
	"crypto/tls"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math/bits"
	"net"

	"github.com/nbdmapper/nbdmapper/wire"
)

// Handshake errors a caller can act on. attach, which hands a connection
// to the kernel, uses the same ones.
var (
	ErrNotNBD   = errors.New("not an NBD server (bad magic)")
	ErrOldstyle = errors.New("server does not speak fixed newstyle")
	ErrRefused  = errors.New("server refused the export")
	ErrProtocol = errors.New("NBD protocol error")
	ErrNoTLS    = errors.New("server does not offer TLS")
)

// Export is what the handshake learned about an export.
type Export struct {
	Size  uint64
	Flags uint16 // transmission flags
	// Block sizes from NBD_INFO_BLOCK_SIZE; zero when the server sent none.
	MinBlock, PrefBlock, MaxBlock uint32
	// Structured says structured replies were negotiated; Meta that the
	// base:allocation context was too, with context id MetaID.
	Structured, Meta bool
	MetaID           uint32
}

// HandshakeOptions say what to ask for.
type HandshakeOptions struct {
	Export string
	// Structured asks for structured replies and, with them, the
	// base:allocation metadata context (block status). The kernel speaks
	// simple replies only, so attach leaves it off.
	Structured bool
	// TLS, if set, upgrades the connection with NBD_OPT_STARTTLS first
	// and fails if the server refuses.
	TLS *tls.Config
}

// maxOptionReply bounds the option replies the handshake reads: no reply
// it asks for is longer than a name or message of proto.md's maximum.
const maxOptionReply = 64 << 10

// Handshake negotiates opts.Export on rw (a freshly dialled connection)
// and leaves it at the start of the transmission phase. It prefers OPT_GO,
// which reports a refusal politely, and falls back to OPT_EXPORT_NAME for
// servers that do not know OPT_GO. rw must not need TLS (see
// HandshakeConn).
func Handshake(rw io.ReadWriter, opts HandshakeOptions) (Export, error) {
	if opts.TLS != nil {
		return Export{}, errors.New("Handshake: TLS needs a net.Conn (HandshakeConn)")
	}
	_, x, err := handshake(rw, opts)
	return x, err
}

// HandshakeConn is Handshake on a network connection, which it upgrades to
// TLS when opts.TLS is set; the connection to use afterwards is returned.
func HandshakeConn(nc net.Conn, opts HandshakeOptions) (net.Conn, Export, error) {
	rw, x, err := handshake(nc, opts)
	if err != nil {
		return nil, x, err
	}
	if c, ok := rw.(net.Conn); ok {
		return c, x, nil
	}
	return nc, x, nil
}

// handshake is the fixed-newstyle negotiation, as a client:
//
//	S: NBDMAGIC IHAVEOPT u16 handshake flags
//	C: u32 client flags (FIXED_NEWSTYLE, NO_ZEROES if offered)
//	C: STARTTLS, S: ACK, TLS handshake            (with opts.TLS)
//	C: STRUCTURED_REPLY, S: ACK or ERR_UNSUP       (with opts.Structured)
//	C: SET_META_CONTEXT base:allocation, S: META_CONTEXT..., ACK
//	C: GO name [INFO_BLOCK_SIZE], S: INFO..., ACK  (EXPORT_NAME if no GO)
func handshake(rw io.ReadWriter, opts HandshakeOptions) (io.ReadWriter, Export, error) {
	var hdr [wire.GreetingSize]byte
	if _, err := io.ReadFull(rw, hdr[:]); err != nil {
		return nil, Export{}, fmt.Errorf("handshake: %w", err)
	}
	if binary.BigEndian.Uint64(hdr[0:]) != wire.MagicNBD {
		return nil, Export{}, ErrNotNBD
	}
	if binary.BigEndian.Uint64(hdr[8:]) != wire.MagicOpt {
		return nil, Export{}, ErrOldstyle
	}
	sflags := binary.BigEndian.Uint16(hdr[16:])
	if sflags&wire.FlagFixedNewstyle == 0 {
		return nil, Export{}, ErrOldstyle
	}
	cflags := wire.ClientFixedNewstyle
	noZeroes := sflags&wire.FlagNoZeroes != 0
	if noZeroes {
		cflags |= wire.ClientNoZeroes
	}
	if err := binary.Write(rw, binary.BigEndian, cflags); err != nil {
		return nil, Export{}, fmt.Errorf("handshake: %w", err)
	}
	h := &negotiator{rw: rw}
	if opts.TLS != nil {
		if err := h.startTLS(opts.TLS); err != nil {
			return nil, Export{}, err
		}
	}
	var x Export
	if opts.Structured {
		ok, err := h.simple(wire.OptStructuredReply)
		if err != nil {
			return nil, Export{}, err
		}
		x.Structured = ok
		if ok {
			if x.MetaID, x.Meta, err = h.setMeta(opts.Export); err != nil {
				return nil, Export{}, err
			}
		}
	}
	gx, err := h.goExport(opts.Export)
	if errors.Is(err, errGoUnsupported) {
		// Whatever was negotiated stands: EXPORT_NAME only ends options.
		gx, err = h.exportName(opts.Export, noZeroes)
	}
	if err != nil {
		return nil, Export{}, err
	}
	gx.Structured, gx.Meta, gx.MetaID = x.Structured, x.Meta, x.MetaID
	return h.rw, gx, nil
}

var errGoUnsupported = errors.New("OPT_GO unsupported")

// negotiator sends options and reads their replies.
type negotiator struct {
	rw io.ReadWriter
}

func (h *negotiator) send(opt uint32, data []byte) error {
	_, err := h.rw.Write(wire.AppendOption(nil, opt, data))
	return err
}

// reply reads one option reply to opt: its type and data.
func (h *negotiator) reply(opt uint32) (uint32, []byte, error) {
	var rh [wire.OptionReplySize]byte
	if _, err := io.ReadFull(h.rw, rh[:]); err != nil {
		return 0, nil, fmt.Errorf("%s reply: %w", optName(opt), err)
	}
	if binary.BigEndian.Uint64(rh[0:]) != wire.MagicOptReply || binary.BigEndian.Uint32(rh[8:]) != opt {
		return 0, nil, fmt.Errorf("%s reply header: %w", optName(opt), ErrProtocol)
	}
	typ := binary.BigEndian.Uint32(rh[12:])
	n := binary.BigEndian.Uint32(rh[16:])
	if n > maxOptionReply {
		return 0, nil, fmt.Errorf("%s reply of %d bytes: %w", optName(opt), n, ErrProtocol)
	}
	body := make([]byte, n)
	if _, err := io.ReadFull(h.rw, body); err != nil {
		return 0, nil, fmt.Errorf("%s reply: %w", optName(opt), err)
	}
	return typ, body, nil
}

// simple sends a data-less option and reports whether the server ACKed
// it; an error reply means no.
func (h *negotiator) simple(opt uint32) (bool, error) {
	if err := h.send(opt, nil); err != nil {
		return false, fmt.Errorf("%s: %w", optName(opt), err)
	}
	typ, _, err := h.reply(opt)
	switch {
	case err != nil:
		return false, err
	case typ == wire.RepAck:
		return true, nil
	case typ&wire.RepErr != 0:
		return false, nil
	}
	return false, fmt.Errorf("%s: reply type %d: %w", optName(opt), typ, ErrProtocol)
}

// startTLS upgrades the connection. Nothing is sent after STARTTLS before
// the server's reply, so nothing can be injected into the TLS session.
func (h *negotiator) startTLS(cfg *tls.Config) error {
	nc, ok := h.rw.(net.Conn)
	if !ok {
		return errors.New("STARTTLS needs a net.Conn")
	}
	acked, err := h.simple(wire.OptStartTLS)
	if err != nil {
		return err
	}
	if !acked {
		return ErrNoTLS
	}
	tc := tls.Client(nc, cfg)
	if err := tc.Handshake(); err != nil {
		return fmt.Errorf("TLS handshake: %w", err)
	}
	h.rw = tc
	return nil
}

// setMeta selects base:allocation for export:
//
//	C: u32 name length | name | u32 number of queries | u32 length | query
//	S: META_CONTEXT (u32 id | name) per context selected, then ACK
func (h *negotiator) setMeta(export string) (id uint32, ok bool, err error) {
	data := binary.BigEndian.AppendUint32(nil, uint32(len(export)))
	data = append(data, export...)
	data = binary.BigEndian.AppendUint32(data, 1)
	data = binary.BigEndian.AppendUint32(data, uint32(len(wire.MetaBaseAllocation)))
	data = append(data, wire.MetaBaseAllocation...)
	if err := h.send(wire.OptSetMetaContext, data); err != nil {
		return 0, false, fmt.Errorf("SET_META_CONTEXT: %w", err)
	}
	for {
		typ, body, err := h.reply(wire.OptSetMetaContext)
		switch {
		case err != nil:
			return 0, false, err
		case typ == wire.RepAck:
			return id, ok, nil
		case typ == wire.RepMetaContext && len(body) >= 4:
			if string(body[4:]) == wire.MetaBaseAllocation {
				id, ok = binary.BigEndian.Uint32(body), true
			}
		case typ&wire.RepErr != 0:
			return 0, false, nil // no block status; the rest works
		default:
			return 0, false, fmt.Errorf("SET_META_CONTEXT: reply type %d: %w", typ, ErrProtocol)
		}
	}
}

// goExport sends OPT_GO asking for the block size info and reads the
// replies up to the final ACK.
func (h *negotiator) goExport(name string) (Export, error) {
	data := make([]byte, 0, 4+len(name)+4)
	data = binary.BigEndian.AppendUint32(data, uint32(len(name)))
	data = append(data, name...)
	data = binary.BigEndian.AppendUint16(data, 1)
	data = binary.BigEndian.AppendUint16(data, wire.InfoBlockSize)
	if err := h.send(wire.OptGo, data); err != nil {
		return Export{}, fmt.Errorf("OPT_GO: %w", err)
	}
	var x Export
	haveExport := false
	for {
		typ, body, err := h.reply(wire.OptGo)
		if err != nil {
			return Export{}, err
		}
		switch {
		case typ == wire.RepAck:
			if !haveExport {
				return Export{}, fmt.Errorf("OPT_GO: ACK without NBD_INFO_EXPORT: %w", ErrProtocol)
			}
			return x, nil
		case typ == wire.RepInfo && len(body) >= 2:
			switch binary.BigEndian.Uint16(body) {
			case wire.InfoExport:
				if len(body) != 12 {
					return Export{}, fmt.Errorf("NBD_INFO_EXPORT of %d bytes: %w", len(body), ErrProtocol)
				}
				x.Size = binary.BigEndian.Uint64(body[2:])
				x.Flags = binary.BigEndian.Uint16(body[10:])
				haveExport = true
			case wire.InfoBlockSize:
				if len(body) != 14 {
					return Export{}, fmt.Errorf("NBD_INFO_BLOCK_SIZE of %d bytes: %w", len(body), ErrProtocol)
				}
				x.MinBlock = binary.BigEndian.Uint32(body[2:])
				x.PrefBlock = binary.BigEndian.Uint32(body[6:])
				x.MaxBlock = binary.BigEndian.Uint32(body[10:])
				if err := checkBlockSizes(x); err != nil {
					return Export{}, err
				}
			}
		case typ == wire.RepErrUnsup:
			return Export{}, errGoUnsupported
		case typ == wire.RepErrTLSReqd:
			return Export{}, fmt.Errorf("export %q: %w: the server requires TLS (use nbds://)", name, ErrRefused)
		case typ&wire.RepErr != 0:
			return Export{}, fmt.Errorf("export %q: %w: error %d: %s", name, ErrRefused, typ&^wire.RepErr, printable(body))
		}
	}
}

// checkBlockSizes refuses block sizes proto.md does not allow: a minimum
// that is not a power of two up to 64 KiB, a maximum below it.
func checkBlockSizes(x Export) error {
	if x.MinBlock == 0 || x.MinBlock > wire.MaxMinBlock || bits.OnesCount32(x.MinBlock) != 1 || x.MaxBlock < x.MinBlock {
		return fmt.Errorf("NBD_INFO_BLOCK_SIZE min %d, preferred %d, max %d: %w", x.MinBlock, x.PrefBlock, x.MaxBlock, ErrProtocol)
	}
	return nil
}

// exportName is the old way in: no error reply is possible, a refusal is a
// closed connection.
func (h *negotiator) exportName(name string, noZeroes bool) (Export, error) {
	if err := h.send(wire.OptExportName, []byte(name)); err != nil {
		return Export{}, fmt.Errorf("OPT_EXPORT_NAME: %w", err)
	}
	n := 10
	if !noZeroes {
		n += wire.ExportNamePad
	}
	b := make([]byte, n)
	if _, err := io.ReadFull(h.rw, b); err != nil {
		return Export{}, fmt.Errorf("export %q: %w: %w", name, ErrRefused, err)
	}
	return Export{Size: binary.BigEndian.Uint64(b), Flags: binary.BigEndian.Uint16(b[8:])}, nil
}

func optName(opt uint32) string {
	switch opt {
	case wire.OptGo:
		return "OPT_GO"
	case wire.OptStartTLS:
		return "STARTTLS"
	case wire.OptStructuredReply:
		return "STRUCTURED_REPLY"
	case wire.OptSetMetaContext:
		return "SET_META_CONTEXT"
	}
	return fmt.Sprintf("option %d", opt)
}

// printable is a server's message, cut short and with control bytes
// replaced, for an error text.
func printable(b []byte) string {
	if len(b) > 256 {
		b = b[:256]
	}
	out := []rune(string(b))
	for i, r := range out {
		if r < ' ' || r == 0x7f {
			out[i] = '?'
		}
	}
	return string(out)
}
