package nbdtarget

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"

	"github.com/nbdmapper/nbdmapper/wire"
)

// Handshake errors: each ends only the connection it happened on.
var (
	errClientFlags = errors.New("unknown client flags")
	errOptMagic    = errors.New("bad option magic")
	errAbort       = errors.New("client aborted the handshake")
	errNoExport    = errors.New("EXPORT_NAME for an unknown export")
)

// transmissionFlags are the flags advertised for an export: exactly what
// the transmission phase implements. DF needs structured replies.
func transmissionFlags(readOnly, structured bool) uint16 {
	f := wire.TfHasFlags | wire.TfSendFlush | wire.TfSendFUA | wire.TfSendCache | wire.TfCanMultiConn
	if readOnly {
		f |= wire.TfReadOnly
	} else {
		f |= wire.TfSendTrim | wire.TfSendWriteZeroes | wire.TfSendFastZero
	}
	if structured {
		f |= wire.TfSendDF
	}
	return f
}

// handshake runs the fixed-newstyle negotiation and returns the export the
// client chose with GO or EXPORT_NAME. Any error means: close the connection.
//
//	S: greeting (NBDMAGIC, IHAVEOPT, FIXED_NEWSTYLE|NO_ZEROES)
//	C: client flags
//	C: option, S: reply(ies)   ... repeated
//	C: GO (S: INFO..., ACK) or EXPORT_NAME (S: size, flags[, 124 zeros])
func (c *conn) handshake() (*Export, error) {
	g := wire.Greeting{OldstyleMagic: wire.MagicNBD, OptionMagic: wire.MagicOpt, HandshakeFlags: wire.FlagFixedNewstyle | wire.FlagNoZeroes}
	if err := binary.Write(c.bw, binary.BigEndian, g); err != nil {
		return nil, err
	}
	if err := c.bw.Flush(); err != nil {
		return nil, err
	}
	var cflags uint32
	if err := binary.Read(c.br, binary.BigEndian, &cflags); err != nil {
		return nil, err
	}
	if cflags&^wire.ClientKnown != 0 {
		return nil, fmt.Errorf("%w %#x", errClientFlags, cflags)
	}
	c.noZeroes = cflags&wire.ClientNoZeroes != 0

	for {
		var h wire.OptionHeader
		if err := binary.Read(c.br, binary.BigEndian, &h); err != nil {
			return nil, err
		}
		if h.OptionMagic != wire.MagicOpt {
			return nil, fmt.Errorf("%w %#x", errOptMagic, h.OptionMagic)
		}
		if h.Length > maxOptionLen {
			if h.ID == wire.OptExportName {
				return nil, fmt.Errorf("EXPORT_NAME of %d bytes", h.Length)
			}
			// Skip it without holding it in memory, and stay in sync.
			if _, err := io.CopyN(io.Discard, c.br, int64(h.Length)); err != nil {
				return nil, err
			}
			if err := c.optReply(h.ID, wire.RepErrTooBig, []byte("option data too long")); err != nil {
				return nil, err
			}
			continue
		}
		data := make([]byte, h.Length)
		if _, err := io.ReadFull(c.br, data); err != nil {
			return nil, err
		}
		x, err := c.option(h.ID, data)
		if err != nil || x != nil {
			if x != nil {
				c.ro = c.readOnly(x)
			}
			return x, err
		}
	}
}

// option handles one option. It returns the chosen export when the
// handshake is over, an error when the connection must close, or neither.
func (c *conn) option(id uint32, data []byte) (*Export, error) {
	if ok, err := c.tlsGate(id); !ok {
		return nil, err
	}
	switch id {
	case wire.OptExportName:
		// No error reply is possible for EXPORT_NAME.
		x := c.srv.lookup(string(data))
		if x == nil {
			return nil, fmt.Errorf("%w %q", errNoExport, data)
		}
		if c.access(x) < accessReadOnly {
			return nil, fmt.Errorf("%w %q", errNotAllowed, data)
		}
		c.metaExport = nil // EXPORT_NAME cannot select meta contexts usefully
		b := binary.BigEndian.AppendUint64(nil, uint64(x.Size()))
		b = binary.BigEndian.AppendUint16(b, transmissionFlags(c.readOnly(x), c.structured))
		if !c.noZeroes {
			b = append(b, make([]byte, wire.ExportNamePad)...)
		}
		if !c.join(x) {
			return nil, fmt.Errorf("%w %q (removed)", errNoExport, data)
		}
		if _, err := c.bw.Write(b); err != nil {
			return nil, err
		}
		return x, c.bw.Flush()

	case wire.OptAbort:
		// The client may not wait for this ACK; ignore a failed write.
		c.optReply(id, wire.RepAck, nil)
		return nil, errAbort

	case wire.OptList:
		if len(data) != 0 {
			return nil, c.optReply(id, wire.RepErrInvalid, []byte("LIST takes no data"))
		}
		for _, x := range c.srv.ExportList() {
			if c.access(x) < accessReadOnly {
				continue // not for this client: not listed
			}
			b := binary.BigEndian.AppendUint32(nil, uint32(len(x.Name)))
			b = append(b, x.Name...)
			b = append(b, x.Description...)
			if err := c.optReply(id, wire.RepServer, b); err != nil {
				return nil, err
			}
		}
		return nil, c.optReply(id, wire.RepAck, nil)

	case wire.OptInfo, wire.OptGo:
		return c.optInfo(id, data)

	case wire.OptStartTLS:
		return nil, c.startTLS(data)

	case wire.OptStructuredReply:
		if len(data) != 0 {
			return nil, c.optReply(id, wire.RepErrInvalid, []byte("STRUCTURED_REPLY takes no data"))
		}
		c.structured = true
		return nil, c.optReply(id, wire.RepAck, nil)

	case wire.OptListMetaContext, wire.OptSetMetaContext:
		return nil, c.optMeta(id, data)
	}
	return nil, c.optReply(id, wire.RepErrUnsup, []byte("option not supported"))
}

// optInfo handles INFO and GO:
//
//	C: u32 name length | name | u16 number of info requests | u16 info type...
//	S: REP_INFO(EXPORT), then for what was asked: [REP_INFO(BLOCK_SIZE)],
//	   [REP_INFO(NAME)], [REP_INFO(DESCRIPTION)] (only if the operator set
//	   one); then ACK
func (c *conn) optInfo(id uint32, data []byte) (*Export, error) {
	d := optData{b: data}
	name := d.str(d.u32())
	n := d.u16()
	reqs := make([]uint16, 0, min(int(n), len(d.b)/2))
	for range n {
		r := d.u16()
		if d.bad {
			break
		}
		reqs = append(reqs, r)
	}
	if !d.done() {
		return nil, c.optReply(id, wire.RepErrInvalid, []byte("malformed INFO/GO request"))
	}
	x, rep, msg := c.export(name)
	if x == nil {
		return nil, c.optReply(id, rep, []byte(msg))
	}
	b := binary.BigEndian.AppendUint16(nil, wire.InfoExport)
	b = binary.BigEndian.AppendUint64(b, uint64(x.Size()))
	b = binary.BigEndian.AppendUint16(b, transmissionFlags(c.readOnly(x), c.structured))
	if err := c.optReply(id, wire.RepInfo, b); err != nil {
		return nil, err
	}
	sentName, sentDesc, sentBlock := false, false, false
	for _, r := range reqs {
		switch {
		case r == wire.InfoBlockSize && !sentBlock:
			// Only to clients that ask: asking promises to keep within
			// the limits, and the others may send READ and WRITE of any
			// length, which are served piece by piece.
			sentBlock = true
			b = binary.BigEndian.AppendUint16(b[:0], wire.InfoBlockSize)
			b = binary.BigEndian.AppendUint32(b, MinBlockSize)
			b = binary.BigEndian.AppendUint32(b, PreferredBlockSize)
			b = binary.BigEndian.AppendUint32(b, MaxPayload)
		case r == wire.InfoName && !sentName:
			sentName = true
			b = binary.BigEndian.AppendUint16(b[:0], wire.InfoName)
			b = append(b, x.Name...)
		case r == wire.InfoDescription && !sentDesc && x.Description != "":
			sentDesc = true
			b = binary.BigEndian.AppendUint16(b[:0], wire.InfoDescription)
			b = append(b, x.Description...)
		default:
			continue
		}
		if err := c.optReply(id, wire.RepInfo, b); err != nil {
			return nil, err
		}
	}
	if id == wire.OptGo && !c.join(x) {
		return nil, c.optReply(id, wire.RepErrUnknown, []byte("export removed"))
	}
	if err := c.optReply(id, wire.RepAck, nil); err != nil {
		return nil, err
	}
	if id == wire.OptInfo {
		return nil, nil
	}
	if c.metaExport != x {
		// Contexts were selected for another export: they do not apply.
		c.meta, c.metaExport = false, nil
	}
	return x, nil
}

// optMeta handles LIST_META_CONTEXT and SET_META_CONTEXT:
//
//	C: u32 name length | name | u32 number of queries | {u32 length | query}...
//	S: REP_META_CONTEXT(u32 id | "base:allocation")..., ACK
//
// base:allocation is the only context. LIST with no queries lists it, and
// so does the namespace query "base:"; SET selects it only by its full name.
func (c *conn) optMeta(id uint32, data []byte) error {
	set := id == wire.OptSetMetaContext
	if set {
		c.meta, c.metaExport = false, nil
	}
	if !c.structured {
		return c.optReply(id, wire.RepErrInvalid, []byte("structured replies not negotiated"))
	}
	d := optData{b: data}
	name := d.str(d.u32())
	n := d.u32()
	match := false
	for range n {
		q := d.str(d.u32())
		if d.bad {
			break
		}
		switch {
		case q == wire.MetaBaseAllocation:
			match = true
		case q == "base:" && !set:
			match = true
		}
	}
	if !d.done() {
		return c.optReply(id, wire.RepErrInvalid, []byte("malformed meta context request"))
	}
	x, rep, msg := c.export(name)
	if x == nil {
		return c.optReply(id, rep, []byte(msg))
	}
	if n == 0 && !set {
		match = true
	}
	if match {
		ctxID := uint32(0) // reserved in LIST replies
		if set {
			ctxID = metaBaseID
			c.meta, c.metaExport = true, x
		}
		b := binary.BigEndian.AppendUint32(nil, ctxID)
		b = append(b, wire.MetaBaseAllocation...)
		if err := c.optReply(id, wire.RepMetaContext, b); err != nil {
			return err
		}
	}
	return c.optReply(id, wire.RepAck, nil)
}

// optReply sends one option reply and flushes it.
func (c *conn) optReply(id, typ uint32, data []byte) error {
	h := wire.OptionReply{ReplyMagic: wire.MagicOptReply, ID: id, Type: typ, Length: uint32(len(data))}
	if err := binary.Write(c.bw, binary.BigEndian, h); err != nil {
		return err
	}
	if _, err := c.bw.Write(data); err != nil {
		return err
	}
	return c.bw.Flush()
}

// optData decodes option data; any read past the end sets bad.
type optData struct {
	b   []byte
	bad bool
}

func (d *optData) u16() uint16 {
	if len(d.b) < 2 {
		d.bad, d.b = true, nil
		return 0
	}
	v := binary.BigEndian.Uint16(d.b)
	d.b = d.b[2:]
	return v
}

func (d *optData) u32() uint32 {
	if len(d.b) < 4 {
		d.bad, d.b = true, nil
		return 0
	}
	v := binary.BigEndian.Uint32(d.b)
	d.b = d.b[4:]
	return v
}

func (d *optData) str(n uint32) string {
	if d.bad || uint64(n) > uint64(len(d.b)) || n > wire.MaxStringLen {
		d.bad, d.b = true, nil
		return ""
	}
	s := string(d.b[:n])
	d.b = d.b[n:]
	return s
}

// done reports whether the data was consumed exactly.
func (d *optData) done() bool { return !d.bad && len(d.b) == 0 }
