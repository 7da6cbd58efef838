// Package wire is the NBD wire format, fixed newstyle, as specified in the
// NetworkBlockDevice repository's doc/proto.md: the numbers and byte layouts
// both ends of nbdmapper speak.
//
//	client -> nbdtarget (server side) ... remote, attach (client side) -> server
//
// It sits beside the data flow and imports nothing of this module, so the
// server (nbdtarget), the client of remote exports (remote) and the kernel
// attach tool (attach) share one definition without importing each other.
// The handshake headers come from go-nbd's protocol package, as do the
// magics and option numbers it has; the rest go-nbd does not define.
//
// Every integer on the wire is big-endian (network order).
package wire

import (
	"encoding/binary"

	"github.com/pojntfx/go-nbd/pkg/protocol"
)

// Magics.
const (
	MagicNBD        uint64 = protocol.NEGOTIATION_MAGIC_OLDSTYLE // "NBDMAGIC", first 8 bytes the server sends
	MagicOpt        uint64 = protocol.NEGOTIATION_MAGIC_OPTION   // "IHAVEOPT", server greeting and every client option
	MagicOptReply   uint64 = protocol.NEGOTIATION_MAGIC_REPLY    // 0x3e889045565a9, every option reply
	MagicRequest    uint32 = protocol.TRANSMISSION_MAGIC_REQUEST // 0x25609513, every transmission request
	MagicSimple     uint32 = protocol.TRANSMISSION_MAGIC_REPLY   // 0x67446698, simple reply
	MagicStructured uint32 = 0x668e33ef                          // structured reply chunk
)

// Handshake flags (server, u16) and client flags (u32).
const (
	FlagFixedNewstyle uint16 = protocol.NEGOTIATION_HANDSHAKE_FLAG_FIXED_NEWSTYLE
	FlagNoZeroes      uint16 = 1 << 1

	ClientFixedNewstyle uint32 = 1 << 0
	ClientNoZeroes      uint32 = 1 << 1
	ClientKnown                = ClientFixedNewstyle | ClientNoZeroes
)

// Options (client -> server, u32).
const (
	OptExportName      uint32 = 1                                    // data: name; reply: export info (no option reply possible)
	OptAbort           uint32 = protocol.NEGOTIATION_ID_OPTION_ABORT // no data; reply ACK, then close
	OptList            uint32 = protocol.NEGOTIATION_ID_OPTION_LIST  // no data; REP_SERVER per export, then ACK
	OptStartTLS        uint32 = 5                                    // no data; ACK, then a TLS handshake
	OptInfo            uint32 = protocol.NEGOTIATION_ID_OPTION_INFO  // data: InfoRequest; REP_INFO..., ACK; stays in options
	OptGo              uint32 = protocol.NEGOTIATION_ID_OPTION_GO    // as OptInfo, then transmission
	OptStructuredReply uint32 = 8                                    // no data; ACK
	OptListMetaContext uint32 = 9                                    // data: meta request; REP_META_CONTEXT..., ACK
	OptSetMetaContext  uint32 = 10                                   // data: meta request; REP_META_CONTEXT..., ACK
	OptExtendedHeaders uint32 = 11                                   // experimental
	MaxStringLen       uint32 = 4096                                 // names, queries and messages (proto.md "string")
	ExportNamePad             = 124                                  // zero bytes after EXPORT_NAME's reply unless NO_ZEROES
)

// Option reply types (server -> client, u32). Errors have bit 31 set.
const (
	RepAck         uint32 = protocol.NEGOTIATION_TYPE_REPLY_ACK    // no data
	RepServer      uint32 = protocol.NEGOTIATION_TYPE_REPLY_SERVER // u32 name length, name, description
	RepInfo        uint32 = protocol.NEGOTIATION_TYPE_REPLY_INFO   // u16 info type, info data
	RepMetaContext uint32 = 4                                      // u32 context id, name

	RepErr         uint32 = 1 << 31 // set in every error reply type
	RepErrUnsup    uint32 = protocol.NEGOTIATION_TYPE_REPLY_ERR_UNSUPPORTED
	RepErrPolicy   uint32 = 1<<31 + 2
	RepErrInvalid  uint32 = 1<<31 + 3
	RepErrPlatform uint32 = 1<<31 + 4
	RepErrTLSReqd  uint32 = 1<<31 + 5
	RepErrUnknown  uint32 = protocol.NEGOTIATION_TYPE_REPLY_ERR_UNKNOWN
	RepErrShutdown uint32 = 1<<31 + 7
	RepErrBlkReqd  uint32 = 1<<31 + 8
	RepErrTooBig   uint32 = 1<<31 + 9
)

// Info types inside REP_INFO (u16).
const (
	InfoExport      uint16 = protocol.NEGOTIATION_TYPE_INFO_EXPORT      // u64 size, u16 transmission flags (always sent)
	InfoName        uint16 = protocol.NEGOTIATION_TYPE_INFO_NAME        // name string
	InfoDescription uint16 = protocol.NEGOTIATION_TYPE_INFO_DESCRIPTION // description string
	InfoBlockSize   uint16 = protocol.NEGOTIATION_TYPE_INFO_BLOCKSIZE   // u32 minimum, u32 preferred, u32 maximum payload
)

// Transmission flags (server, u16), per export.
const (
	TfHasFlags        uint16 = protocol.NEGOTIATION_REPLY_FLAGS_HAS_FLAGS
	TfReadOnly        uint16 = 1 << 1
	TfSendFlush       uint16 = 1 << 2
	TfSendFUA         uint16 = 1 << 3
	TfRotational      uint16 = 1 << 4
	TfSendTrim        uint16 = 1 << 5
	TfSendWriteZeroes uint16 = 1 << 6
	TfSendDF          uint16 = 1 << 7
	TfCanMultiConn    uint16 = protocol.NEGOTIATION_REPLY_FLAGS_CAN_MULTI_CONN
	TfSendResize      uint16 = 1 << 9
	TfSendCache       uint16 = 1 << 10
	TfSendFastZero    uint16 = 1 << 11
)

// Commands (u16 type in a request).
const (
	CmdRead        uint16 = protocol.TRANSMISSION_TYPE_REQUEST_READ
	CmdWrite       uint16 = protocol.TRANSMISSION_TYPE_REQUEST_WRITE // the only command followed by a payload
	CmdDisc        uint16 = protocol.TRANSMISSION_TYPE_REQUEST_DISC
	CmdFlush       uint16 = 3
	CmdTrim        uint16 = 4
	CmdCache       uint16 = 5
	CmdWriteZeroes uint16 = 6
	CmdBlockStatus uint16 = 7
	NumCmds               = 8
)

// CmdNames name the commands in logs, stats and metrics labels.
var CmdNames = [NumCmds]string{
	CmdRead:        "read",
	CmdWrite:       "write",
	CmdDisc:        "disc",
	CmdFlush:       "flush",
	CmdTrim:        "trim",
	CmdCache:       "cache",
	CmdWriteZeroes: "write_zeroes",
	CmdBlockStatus: "block_status",
}

// Command flags (u16 flags in a request).
const (
	CfFUA      uint16 = 1 << 0 // valid on every command once SEND_FUA is advertised
	CfNoHole   uint16 = 1 << 1 // WRITE_ZEROES
	CfDF       uint16 = 1 << 2 // READ, with structured replies
	CfReqOne   uint16 = 1 << 3 // BLOCK_STATUS
	CfFastZero uint16 = 1 << 4 // WRITE_ZEROES
)

// Structured reply flags and chunk types.
const (
	ReplyFlagDone uint16 = 1 << 0

	ChunkNone        uint16 = 0         // no payload, DONE set
	ChunkOffsetData  uint16 = 1         // u64 offset, data
	ChunkOffsetHole  uint16 = 2         // u64 offset, u32 hole length
	ChunkBlockStatus uint16 = 5         // u32 context id, {u32 length, u32 flags}...
	ChunkError       uint16 = 1<<15 + 1 // u32 errno, u16 message length, message
	ChunkErrorOffset uint16 = 1<<15 + 2 // u32 errno, u16 message length, message, u64 offset
	ChunkErrorBit    uint16 = 1 << 15   // set in every error chunk type
)

// Metadata contexts: base:allocation, whose extent flags are below.
const (
	MetaBaseAllocation        = "base:allocation"
	StateHole          uint32 = 1 << 0 // unallocated
	StateZero          uint32 = 1 << 1 // reads as zeros
)

// NBD error values (u32 in replies). They are the Linux errno numbers.
const (
	EPERM     uint32 = protocol.TRANSMISSION_ERROR_EPERM
	EIO       uint32 = 5
	ENOMEM    uint32 = 12
	EINVAL    uint32 = protocol.TRANSMISSION_ERROR_EINVAL
	ENOSPC    uint32 = 28
	EOVERFLOW uint32 = 75
	ENOTSUP   uint32 = 95
	ESHUTDOWN uint32 = 108
)

// Block sizes: what proto.md says a client may assume of a server that
// advertises none, and the payload every server should take.
const (
	DefaultMinBlock  = 1
	DefaultPrefBlock = 4096
	MaxMinBlock      = 64 << 10 // the largest minimum block size proto.md allows
	InteropPayload   = 32 << 20 // a client wanting interoperability keeps READ and WRITE to this
)

// Handshake headers, from go-nbd's protocol package.
//
// greeting (server, 18 bytes):      u64 NBDMAGIC | u64 IHAVEOPT | u16 handshake flags
// option header (client, 16 bytes): u64 IHAVEOPT | u32 option | u32 data length
// option reply (server, 20 bytes):  u64 0x3e889045565a9 | u32 option | u32 reply type | u32 data length
type (
	Greeting     = protocol.NegotiationNewstyleHeader
	OptionHeader = protocol.NegotiationOptionHeader
	OptionReply  = protocol.NegotiationReplyHeader
)

// Handshake message sizes.
const (
	GreetingSize     = 18
	OptionHeaderSize = 16
	OptionReplySize  = 20
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
	RequestSize     = 28
	SimpleReplySize = 16
	ChunkHeaderSize = 20
)

// Request is a decoded request header.
type Request struct {
	Flags  uint16
	Type   uint16
	Handle uint64
	Offset uint64
	Length uint32
}

// DecodeRequest parses a 28-byte request header. ok is false if the magic
// is wrong: the stream is then unusable and the connection must close.
func DecodeRequest(b []byte) (r Request, ok bool) {
	_ = b[RequestSize-1]
	if binary.BigEndian.Uint32(b[0:4]) != MagicRequest {
		return r, false
	}
	return Request{
		Flags:  binary.BigEndian.Uint16(b[4:6]),
		Type:   binary.BigEndian.Uint16(b[6:8]),
		Handle: binary.BigEndian.Uint64(b[8:16]),
		Offset: binary.BigEndian.Uint64(b[16:24]),
		Length: binary.BigEndian.Uint32(b[24:28]),
	}, true
}

// AppendRequest appends r's 28-byte header to b.
func AppendRequest(b []byte, r Request) []byte {
	b = binary.BigEndian.AppendUint32(b, MagicRequest)
	b = binary.BigEndian.AppendUint16(b, r.Flags)
	b = binary.BigEndian.AppendUint16(b, r.Type)
	b = binary.BigEndian.AppendUint64(b, r.Handle)
	b = binary.BigEndian.AppendUint64(b, r.Offset)
	return binary.BigEndian.AppendUint32(b, r.Length)
}

// AppendOption appends an option header and its data to b.
func AppendOption(b []byte, opt uint32, data []byte) []byte {
	b = binary.BigEndian.AppendUint64(b, MagicOpt)
	b = binary.BigEndian.AppendUint32(b, opt)
	b = binary.BigEndian.AppendUint32(b, uint32(len(data)))
	return append(b, data...)
}

// Reply is a decoded reply header: a simple reply, or a structured reply
// chunk's header.
type Reply struct {
	Structured bool
	Handle     uint64
	Errno      uint32 // simple replies
	Flags      uint16 // chunks
	Type       uint16 // chunks
	Length     uint32 // chunks: payload bytes that follow
}

// Done says whether this is the last reply to its request.
func (r Reply) Done() bool { return !r.Structured || r.Flags&ReplyFlagDone != 0 }

// DecodeReplyMagic reads the first 4 bytes of a reply and says how long its
// header is (SimpleReplySize or ChunkHeaderSize), or 0 for a bad magic.
func DecodeReplyMagic(b []byte) int {
	switch binary.BigEndian.Uint32(b[0:4]) {
	case MagicSimple:
		return SimpleReplySize
	case MagicStructured:
		return ChunkHeaderSize
	}
	return 0
}

// DecodeReply parses a whole reply header (simple or chunk) whose length
// DecodeReplyMagic returned.
func DecodeReply(b []byte) Reply {
	if binary.BigEndian.Uint32(b[0:4]) == MagicSimple {
		return Reply{Errno: binary.BigEndian.Uint32(b[4:8]), Handle: binary.BigEndian.Uint64(b[8:16])}
	}
	return Reply{
		Structured: true,
		Flags:      binary.BigEndian.Uint16(b[4:6]),
		Type:       binary.BigEndian.Uint16(b[6:8]),
		Handle:     binary.BigEndian.Uint64(b[8:16]),
		Length:     binary.BigEndian.Uint32(b[16:20]),
	}
}

// AppendSimpleReply appends a simple reply header to b.
func AppendSimpleReply(b []byte, handle uint64, errno uint32) []byte {
	b = binary.BigEndian.AppendUint32(b, MagicSimple)
	b = binary.BigEndian.AppendUint32(b, errno)
	return binary.BigEndian.AppendUint64(b, handle)
}

// AppendChunkHeader appends a structured reply chunk header to b.
func AppendChunkHeader(b []byte, handle uint64, flags, typ uint16, length uint32) []byte {
	b = binary.BigEndian.AppendUint32(b, MagicStructured)
	b = binary.BigEndian.AppendUint16(b, flags)
	b = binary.BigEndian.AppendUint16(b, typ)
	b = binary.BigEndian.AppendUint64(b, handle)
	return binary.BigEndian.AppendUint32(b, length)
}
