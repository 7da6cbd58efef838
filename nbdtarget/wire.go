package nbdtarget

// The NBD wire format, as the server uses it. The numbers and header layouts
// are package wire's, shared with the client side (remote, attach), and the
// server names them as wire.X; this file holds the server's own limits and
// the encoders of the reply chunks that carry its data.

import (
	"encoding/binary"

	"github.com/nbdmapper/nbdmapper/mapped"
	"github.com/nbdmapper/nbdmapper/wire"
)

// Limits of the server's own, beside package wire's numbers.
const (
	maxOptionLen    uint32 = 64 << 10
	errorMessageMax        = 256 // longest message we put in an error chunk
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

// Metadata contexts. base:allocation is the only one; its id is ours to pick.
const (
	metaBaseID uint32 = 1
	maxExtents        = 1 << 14 // descriptors in one BLOCK_STATUS reply; fewer is allowed
)

// appendErrorChunk appends a complete, final ERROR chunk (or ERROR_OFFSET
// when withOffset): u32 errno | u16 msg length | msg | [u64 offset].
func appendErrorChunk(b []byte, handle uint64, errno uint32, msg string, withOffset bool, off uint64) []byte {
	if len(msg) > errorMessageMax {
		msg = msg[:errorMessageMax]
	}
	typ, n := wire.ChunkError, 6+len(msg)
	if withOffset {
		typ, n = wire.ChunkErrorOffset, n+8
	}
	b = wire.AppendChunkHeader(b, handle, wire.ReplyFlagDone, typ, uint32(n))
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
	b = wire.AppendChunkHeader(b, handle, wire.ReplyFlagDone, wire.ChunkBlockStatus, uint32(4+8*len(exts)))
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
	b = wire.AppendChunkHeader(b, handle, flags, wire.ChunkOffsetData, 8+n)
	return binary.BigEndian.AppendUint64(b, off)
}

// appendHoleChunk appends a complete OFFSET_HOLE chunk: u64 offset | u32
// hole size (non-zero).
func appendHoleChunk(b []byte, handle uint64, flags uint16, off uint64, n uint32) []byte {
	b = wire.AppendChunkHeader(b, handle, flags, wire.ChunkOffsetHole, 12)
	b = binary.BigEndian.AppendUint64(b, off)
	return binary.BigEndian.AppendUint32(b, n)
}

// maxReadChunkHeader is the longest header a read reply's chunk carries
// before its data: a hole chunk's.
const maxReadChunkHeader = wire.ChunkHeaderSize + 12
