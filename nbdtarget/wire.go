package nbdtarget

// The NBD wire format, fixed newstyle, as specified in the NetworkBlockDevice
// repository's doc/proto.md. Every integer is big-endian (network order).
// This is the only file that knows byte layouts; the handshake and
// transmission code encode and decode through the helpers at the bottom.

import (
	"encoding/binary"

	"github.com/pojntfx/go-nbd/pkg/protocol"

	"github.com/nbdmapper/nbdmapper/mapped"
)

// Magics.
const (
	magicNBD        uint64 = protocol.NEGOTIATION_MAGIC_OLDSTYLE // "NBDMAGIC", first 8 bytes the server sends
	magicOpt        uint64 = protocol.NEGOTIATION_MAGIC_OPTION   // "IHAVEOPT", server greeting and every client option
	magicOptReply   uint64 = protocol.NEGOTIATION_MAGIC_REPLY    // 0x3e889045565a9, every option reply
	magicRequest    uint32 = 0x25609513                          // every transmission request
	magicSimple     uint32 = 0x67446698                          // simple reply
	magicStructured uint32 = 0x668e33ef                          // structured reply chunk
)

// Handshake flags (server, u16) and client flags (u32).
const (
	flagFixedNewstyle uint16 = 1 << 0
	flagNoZeroes      uint16 = 1 << 1

	clientFixedNewstyle uint32 = 1 << 0
	clientNoZeroes      uint32 = 1 << 1
	clientKnown                = clientFixedNewstyle | clientNoZeroes
)

// Options (client -> server, u32).
const (
	optExportName      uint32 = 1  // data: name; reply: export info (no option reply possible)
	optAbort           uint32 = 2  // no data; reply ACK, then close
	optList            uint32 = 3  // no data; REP_SERVER per export, then ACK
	optStartTLS        uint32 = 5  // no data; ACK, then a TLS handshake (tls.go)
	optInfo            uint32 = 6  // data: infoRequest; REP_INFO..., ACK; stays in options
	optGo              uint32 = 7  // as optInfo, then transmission
	optStructuredReply uint32 = 8  // no data; ACK
	optListMetaContext uint32 = 9  // data: metaRequest; REP_META_CONTEXT..., ACK
	optSetMetaContext  uint32 = 10 // data: metaRequest; REP_META_CONTEXT..., ACK
	optExtendedHeaders uint32 = 11 // experimental, not supported: ERR_UNSUP
	maxOptionLen       uint32 = 64 << 10
	maxStringLen       uint32 = 4096 // names, queries and messages (proto.md "string")
	exportNamePad             = 124  // zero bytes after EXPORT_NAME's reply unless NO_ZEROES
	errorMessageMax           = 256  // longest message we put in an error chunk
)

// Option reply types (server -> client, u32). Errors have bit 31 set.
const (
	repAck         uint32 = 1 // no data
	repServer      uint32 = 2 // u32 name length, name, description
	repInfo        uint32 = 3 // u16 info type, info data
	repMetaContext uint32 = 4 // u32 context id, name

	repErrUnsup    uint32 = 1<<31 + 1
	repErrPolicy   uint32 = 1<<31 + 2
	repErrInvalid  uint32 = 1<<31 + 3
	repErrPlatform uint32 = 1<<31 + 4
	repErrTLSReqd  uint32 = 1<<31 + 5
	repErrUnknown  uint32 = 1<<31 + 6
	repErrShutdown uint32 = 1<<31 + 7
	repErrBlkReqd  uint32 = 1<<31 + 8
	repErrTooBig   uint32 = 1<<31 + 9
)

// Info types inside REP_INFO (u16).
const (
	infoExport      uint16 = 0 // u64 size, u16 transmission flags (always sent)
	infoName        uint16 = 1 // name string
	infoDescription uint16 = 2 // description string
	infoBlockSize   uint16 = 3 // u32 minimum, u32 preferred, u32 maximum payload
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
	tfHasFlags        uint16 = 1 << 0
	tfReadOnly        uint16 = 1 << 1
	tfSendFlush       uint16 = 1 << 2
	tfSendFUA         uint16 = 1 << 3
	tfRotational      uint16 = 1 << 4
	tfSendTrim        uint16 = 1 << 5
	tfSendWriteZeroes uint16 = 1 << 6
	tfSendDF          uint16 = 1 << 7
	tfCanMultiConn    uint16 = 1 << 8
	tfSendResize      uint16 = 1 << 9
	tfSendCache       uint16 = 1 << 10
	tfSendFastZero    uint16 = 1 << 11
)

// Commands (u16 type in a request).
const (
	cmdRead        uint16 = 0
	cmdWrite       uint16 = 1 // the only command followed by a payload
	cmdDisc        uint16 = 2
	cmdFlush       uint16 = 3
	cmdTrim        uint16 = 4
	cmdCache       uint16 = 5
	cmdWriteZeroes uint16 = 6
	cmdBlockStatus uint16 = 7
	numCmds               = 8
)

// Command flags (u16 flags in a request).
const (
	cfFUA      uint16 = 1 << 0 // valid on every command once SEND_FUA is advertised
	cfNoHole   uint16 = 1 << 1 // WRITE_ZEROES
	cfDF       uint16 = 1 << 2 // READ, with structured replies
	cfReqOne   uint16 = 1 << 3 // BLOCK_STATUS
	cfFastZero uint16 = 1 << 4 // WRITE_ZEROES
)

// Structured reply flags and chunk types.
const (
	replyFlagDone uint16 = 1 << 0

	chunkNone        uint16 = 0         // no payload, DONE set
	chunkOffsetData  uint16 = 1         // u64 offset, data
	chunkOffsetHole  uint16 = 2         // u64 offset, u32 hole length
	chunkBlockStatus uint16 = 5         // u32 context id, {u32 length, u32 flags}...
	chunkError       uint16 = 1<<15 + 1 // u32 errno, u16 message length, message
	chunkErrorOffset uint16 = 1<<15 + 2 // u32 errno, u16 message length, message, u64 offset
)

// Metadata contexts. base:allocation is the only one; its id is ours to pick.
const (
	metaBaseAllocation        = "base:allocation"
	metaBaseID         uint32 = 1
	maxExtents                = 1 << 14 // descriptors in one BLOCK_STATUS reply; fewer is allowed
)

// NBD error values (u32 in replies). They are the Linux errno numbers.
const (
	EPERM     uint32 = 1
	EIO       uint32 = 5
	ENOMEM    uint32 = 12
	EINVAL    uint32 = 22
	ENOSPC    uint32 = 28
	EOVERFLOW uint32 = 75
	ENOTSUP   uint32 = 95
	ESHUTDOWN uint32 = 108
)

// Handshake headers, from go-nbd's protocol package.
//
// greeting (server, 18 bytes):     u64 NBDMAGIC | u64 IHAVEOPT | u16 handshake flags
// option header (client, 16 bytes): u64 IHAVEOPT | u32 option | u32 data length
// option reply (server, 20 bytes):  u64 0x3e889045565a9 | u32 option | u32 reply type | u32 data length
type (
	greeting     = protocol.NegotiationNewstyleHeader
	optionHeader = protocol.NegotiationOptionHeader
	optionReply  = protocol.NegotiationReplyHeader
)

// Transmission message sizes.
//
// request (client, 28 bytes):
//
//	0      4      6      8             16            24     28
//	| magic| flags| type | handle (u64)| offset (u64)| len  | [len bytes payload for WRITE]
//
// simple reply (server, 16 bytes):
//
//	0      4      8             16
//	| magic| errno| handle (u64)| [data for a successful READ]
//
// structured reply chunk header (server, 20 bytes):
//
//	0      4      6      8             16     20
//	| magic| flags| type | handle (u64)| len  | [len bytes payload]
const (
	requestSize     = 28
	simpleReplySize = 16
	chunkHeaderSize = 20
)

// request is a decoded request header.
type request struct {
	Flags  uint16
	Type   uint16
	Handle uint64
	Offset uint64
	Length uint32
}

// decodeRequest parses a 28-byte request header. ok is false if the magic
// is wrong: the stream is then unusable and the connection must close.
func decodeRequest(b []byte) (r request, ok bool) {
	_ = b[requestSize-1]
	if binary.BigEndian.Uint32(b[0:4]) != magicRequest {
		return r, false
	}
	return request{
		Flags:  binary.BigEndian.Uint16(b[4:6]),
		Type:   binary.BigEndian.Uint16(b[6:8]),
		Handle: binary.BigEndian.Uint64(b[8:16]),
		Offset: binary.BigEndian.Uint64(b[16:24]),
		Length: binary.BigEndian.Uint32(b[24:28]),
	}, true
}

// encodeRequest is decodeRequest's inverse (tests and fuzzing).
func encodeRequest(b []byte, r request) []byte {
	b = binary.BigEndian.AppendUint32(b, magicRequest)
	b = binary.BigEndian.AppendUint16(b, r.Flags)
	b = binary.BigEndian.AppendUint16(b, r.Type)
	b = binary.BigEndian.AppendUint64(b, r.Handle)
	b = binary.BigEndian.AppendUint64(b, r.Offset)
	return binary.BigEndian.AppendUint32(b, r.Length)
}

func appendSimpleReply(b []byte, handle uint64, errno uint32) []byte {
	b = binary.BigEndian.AppendUint32(b, magicSimple)
	b = binary.BigEndian.AppendUint32(b, errno)
	return binary.BigEndian.AppendUint64(b, handle)
}

func appendChunkHeader(b []byte, handle uint64, flags, typ uint16, length uint32) []byte {
	b = binary.BigEndian.AppendUint32(b, magicStructured)
	b = binary.BigEndian.AppendUint16(b, flags)
	b = binary.BigEndian.AppendUint16(b, typ)
	b = binary.BigEndian.AppendUint64(b, handle)
	return binary.BigEndian.AppendUint32(b, length)
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
