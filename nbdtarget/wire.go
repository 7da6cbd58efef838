package nbdtarget

// The NBD wire format, as the server uses it. The numbers and header layouts
// are package wire's, shared with the client side (remote, attach); this is
// the only file of the server that knows byte layouts, and the handshake and
// transmission code encode and decode through the helpers here.

import (
	"encoding/binary"

	"github.com/nbdmapper/nbdmapper/mapped"
	"github.com/nbdmapper/nbdmapper/wire"
)

// Magics.
const (
	magicNBD        = wire.MagicNBD        // "NBDMAGIC", first 8 bytes the server sends
	magicOpt        = wire.MagicOpt        // "IHAVEOPT", server greeting and every client option
	magicOptReply   = wire.MagicOptReply   // 0x3e889045565a9, every option reply
	magicRequest    = wire.MagicRequest    // every transmission request
	magicSimple     = wire.MagicSimple     // simple reply
	magicStructured = wire.MagicStructured // structured reply chunk
)

// Handshake flags (server, u16) and client flags (u32).
const (
	flagFixedNewstyle = wire.FlagFixedNewstyle
	flagNoZeroes      = wire.FlagNoZeroes

	clientFixedNewstyle = wire.ClientFixedNewstyle
	clientNoZeroes      = wire.ClientNoZeroes
	clientKnown         = wire.ClientKnown
)

// Options (client -> server, u32).
const (
	optExportName             = wire.OptExportName      // data: name; reply: export info (no option reply possible)
	optAbort                  = wire.OptAbort           // no data; reply ACK, then close
	optList                   = wire.OptList            // no data; REP_SERVER per export, then ACK
	optStartTLS               = wire.OptStartTLS        // no data; ACK, then a TLS handshake (tls.go)
	optInfo                   = wire.OptInfo            // data: infoRequest; REP_INFO..., ACK; stays in options
	optGo                     = wire.OptGo              // as optInfo, then transmission
	optStructuredReply        = wire.OptStructuredReply // no data; ACK
	optListMetaContext        = wire.OptListMetaContext // data: metaRequest; REP_META_CONTEXT..., ACK
	optSetMetaContext         = wire.OptSetMetaContext  // data: metaRequest; REP_META_CONTEXT..., ACK
	optExtendedHeaders        = wire.OptExtendedHeaders // experimental, not supported: ERR_UNSUP
	maxOptionLen       uint32 = 64 << 10
	maxStringLen              = wire.MaxStringLen  // names, queries and messages (proto.md "string")
	exportNamePad             = wire.ExportNamePad // zero bytes after EXPORT_NAME's reply unless NO_ZEROES
	errorMessageMax           = 256                // longest message we put in an error chunk
)

// Option reply types (server -> client, u32). Errors have bit 31 set.
const (
	repAck         = wire.RepAck         // no data
	repServer      = wire.RepServer      // u32 name length, name, description
	repInfo        = wire.RepInfo        // u16 info type, info data
	repMetaContext = wire.RepMetaContext // u32 context id, name

	repErrUnsup    = wire.RepErrUnsup
	repErrPolicy   = wire.RepErrPolicy
	repErrInvalid  = wire.RepErrInvalid
	repErrPlatform = wire.RepErrPlatform
	repErrTLSReqd  = wire.RepErrTLSReqd
	repErrUnknown  = wire.RepErrUnknown
	repErrShutdown = wire.RepErrShutdown
	repErrBlkReqd  = wire.RepErrBlkReqd
	repErrTooBig   = wire.RepErrTooBig
)

// Info types inside REP_INFO (u16).
const (
	infoExport      = wire.InfoExport      // u64 size, u16 transmission flags (always sent)
	infoName        = wire.InfoName        // name string
	infoDescription = wire.InfoDescription // description string
	infoBlockSize   = wire.InfoBlockSize   // u32 minimum, u32 preferred, u32 maximum payload
)

// Block sizes advertised in INFO_BLOCK_SIZE. Any alignment is served (the
// table maps bytes), so the minimum is 1. MaxPayload is the maximum
// advertised to clients that ask for block sizes, and the longest READ or
// WRITE held in memory whole; longer ones (from clients that did not ask)
// are streamed in pieces.
const (
	MinBlockSize       = 1
	PreferredBlockSize = 4096
	MaxPayload         = 32 << 20
)

// Transmission flags (server, u16), per export.
const (
	tfHasFlags        = wire.TfHasFlags
	tfReadOnly        = wire.TfReadOnly
	tfSendFlush       = wire.TfSendFlush
	tfSendFUA         = wire.TfSendFUA
	tfRotational      = wire.TfRotational
	tfSendTrim        = wire.TfSendTrim
	tfSendWriteZeroes = wire.TfSendWriteZeroes
	tfSendDF          = wire.TfSendDF
	tfCanMultiConn    = wire.TfCanMultiConn
	tfSendResize      = wire.TfSendResize
	tfSendCache       = wire.TfSendCache
	tfSendFastZero    = wire.TfSendFastZero
)

// Commands (u16 type in a request).
const (
	cmdRead        = wire.CmdRead
	cmdWrite       = wire.CmdWrite // the only command followed by a payload
	cmdDisc        = wire.CmdDisc
	cmdFlush       = wire.CmdFlush
	cmdTrim        = wire.CmdTrim
	cmdCache       = wire.CmdCache
	cmdWriteZeroes = wire.CmdWriteZeroes
	cmdBlockStatus = wire.CmdBlockStatus
	numCmds        = wire.NumCmds
)

// Command flags (u16 flags in a request).
const (
	cfFUA      = wire.CfFUA      // valid on every command once SEND_FUA is advertised
	cfNoHole   = wire.CfNoHole   // WRITE_ZEROES
	cfDF       = wire.CfDF       // READ, with structured replies
	cfReqOne   = wire.CfReqOne   // BLOCK_STATUS
	cfFastZero = wire.CfFastZero // WRITE_ZEROES
)

// Structured reply flags and chunk types.
const (
	replyFlagDone = wire.ReplyFlagDone

	chunkNone        = wire.ChunkNone        // no payload, DONE set
	chunkOffsetData  = wire.ChunkOffsetData  // u64 offset, data
	chunkOffsetHole  = wire.ChunkOffsetHole  // u64 offset, u32 hole length
	chunkBlockStatus = wire.ChunkBlockStatus // u32 context id, {u32 length, u32 flags}...
	chunkError       = wire.ChunkError       // u32 errno, u16 message length, message
	chunkErrorOffset = wire.ChunkErrorOffset // u32 errno, u16 message length, message, u64 offset
)

// Metadata contexts. base:allocation is the only one; its id is ours to pick.
const (
	metaBaseAllocation        = wire.MetaBaseAllocation
	metaBaseID         uint32 = 1
	maxExtents                = 1 << 14 // descriptors in one BLOCK_STATUS reply; fewer is allowed
)

// NBD error values (u32 in replies). They are the Linux errno numbers.
const (
	EPERM     = wire.EPERM
	EIO       = wire.EIO
	ENOMEM    = wire.ENOMEM
	EINVAL    = wire.EINVAL
	ENOSPC    = wire.ENOSPC
	EOVERFLOW = wire.EOVERFLOW
	ENOTSUP   = wire.ENOTSUP
	ESHUTDOWN = wire.ESHUTDOWN
)

// Handshake headers and transmission message sizes: package wire has the
// byte layouts.
type (
	greeting     = wire.Greeting
	optionHeader = wire.OptionHeader
	optionReply  = wire.OptionReply
)

const (
	requestSize     = wire.RequestSize
	simpleReplySize = wire.SimpleReplySize
	chunkHeaderSize = wire.ChunkHeaderSize
)

// request is a decoded request header.
type request = wire.Request

// decodeRequest parses a 28-byte request header. ok is false if the magic
// is wrong: the stream is then unusable and the connection must close.
func decodeRequest(b []byte) (r request, ok bool) { return wire.DecodeRequest(b) }

// encodeRequest is decodeRequest's inverse (tests and fuzzing).
func encodeRequest(b []byte, r request) []byte { return wire.AppendRequest(b, r) }

func appendSimpleReply(b []byte, handle uint64, errno uint32) []byte {
	return wire.AppendSimpleReply(b, handle, errno)
}

func appendChunkHeader(b []byte, handle uint64, flags, typ uint16, length uint32) []byte {
	return wire.AppendChunkHeader(b, handle, flags, typ, length)
}

// appendErrorChunk appends a complete, final ERROR chunk (or ERROR_OFFSET
// when withOffset): u32 errno | u16 msg length | msg | [u64 offset].
func appendErrorChunk(b []byte, handle uint64, errno uint32, msg string, withOffset bool, off uint64) []byte {
	if len(msg) > errorMessageMax {
		msg = msg[:errorMessageMax]
	}
	typ, n := chunkError, 6+len(msg)
	if withOffset {
		typ, n = chunkErrorOffset, n+8
	}
	b = appendChunkHeader(b, handle, replyFlagDone, typ, uint32(n))
	b = binary.BigEndian.AppendUint32(b, errno)
	b = binary.BigEndian.AppendUint16(b, uint16(len(msg)))
	b = append(b, msg...)
	if withOffset {
		b = binary.BigEndian.AppendUint64(b, off)
	}
	return b
}

// appendBlockStatusChunk appends a final BLOCK_STATUS chunk for one context:
// u32 context id | {u32 length, u32 flags}...
func appendBlockStatusChunk(b []byte, handle uint64, id uint32, exts []mapped.BlockExtent) []byte {
	b = appendChunkHeader(b, handle, replyFlagDone, chunkBlockStatus, uint32(4+8*len(exts)))
	b = binary.BigEndian.AppendUint32(b, id)
	for _, e := range exts {
		b = binary.BigEndian.AppendUint32(b, uint32(e.Len))
		b = binary.BigEndian.AppendUint32(b, e.Flags)
	}
	return b
}

// appendDataChunkHeader appends an OFFSET_DATA chunk's header and offset,
// for n bytes of data that follow it: u64 offset | data.
func appendDataChunkHeader(b []byte, handle uint64, flags uint16, off uint64, n uint32) []byte {
	b = appendChunkHeader(b, handle, flags, chunkOffsetData, 8+n)
	return binary.BigEndian.AppendUint64(b, off)
}

// appendHoleChunk appends a complete OFFSET_HOLE chunk: u64 offset | u32
// hole size (non-zero).
func appendHoleChunk(b []byte, handle uint64, flags uint16, off uint64, n uint32) []byte {
	b = appendChunkHeader(b, handle, flags, chunkOffsetHole, 12)
	b = binary.BigEndian.AppendUint64(b, off)
	return binary.BigEndian.AppendUint32(b, n)
}

// maxReadChunkHeader is the longest header a read reply's chunk carries
// before its data: a hole chunk's.
const maxReadChunkHeader = chunkHeaderSize + 12
