package remote

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"time"

	"github.com/nbdmapper/nbdmapper/backing"
	"github.com/nbdmapper/nbdmapper/wire"
)

// The reply side of the transmission phase: one connection's reader
// decodes replies from whatever the server sends and applies each to the
// request it answers. Nothing a server sends can make it write outside a
// request's buffer, hold more than a bounded amount of memory, or loop
// without reading: every length is checked against the request before a
// byte of payload is read, and a reply that breaks proto.md is an error
// that ends the connection (its requests are then retried on another).
//
//	simple reply:  magic | errno | handle                 [READ data if errno 0]
//	chunk:         magic | flags | type | handle | length [payload]
//
//	chunk type     payload                               valid for
//	NONE           (empty; DONE must be set)             any
//	OFFSET_DATA    u64 offset | data                     READ
//	OFFSET_HOLE    u64 offset | u32 length               READ
//	BLOCK_STATUS   u32 context | {u32 length, u32 flags}  BLOCK_STATUS
//	ERROR          u32 errno | u16 n | message[n]        any
//	ERROR_OFFSET   u32 errno | u16 n | message[n] | u64  any

// Limits on what a reply may make the reader hold or do.
const (
	maxMessage     = 256 // bytes of an error message kept; the rest is skipped
	maxErrorChunk  = 6 + 4096 + 8
	maxDescriptors = 1 << 20 // in one BLOCK_STATUS chunk
	maxPieces      = 64      // disjoint pieces of a READ answered out of order
	maxHoles       = 16384   // holes one BLOCK_STATUS request records; past them all is data
)

// errShutdown marks a call the server answered with ESHUTDOWN: it is going
// away, and the call is retried on a new connection like one that dropped.
var errShutdown = errors.New("server shutting down (ESHUTDOWN)")

// call is one request on the wire and what its replies said.
type call struct {
	req wire.Request
	// payload is a WRITE's data; buf a READ's destination, len(buf) ==
	// req.Length.
	payload []byte
	buf     []byte

	// Set by the caller for each attempt.
	deadline   time.Time // the whole request's, retries included
	sent       time.Time
	flushStart uint64        // FLUSH: writes acknowledged when it was sent
	done       chan struct{} // the reader's signal that it has finished

	// Set by the reader.
	errno   uint32
	msg     string
	covered []backing.Range // READ: byte ranges of buf received, merged; BLOCK_STATUS: [0, n) answered
	holes   []backing.Range // BLOCK_STATUS: hole+zero extents, device offsets
	status  bool            // BLOCK_STATUS: the chunk arrived
	err     error           // nil, errDown or errShutdown: why there is no answer
}

// reset clears what a previous attempt's replies left.
func (c *call) reset() {
	c.errno, c.msg, c.covered, c.holes, c.status, c.err = 0, "", c.covered[:0], c.holes[:0], false, nil
}

// replyReader decodes one connection's replies.
type replyReader struct {
	br         *bufio.Reader
	structured bool
	metaID     uint32
	hdr        [wire.ChunkHeaderSize]byte
	scratch    [16]byte
}

// next reads one reply, or one chunk of a structured reply, and applies it
// to the call lookup returns for its handle. It returns that call and
// whether the reply was the call's last. An error means the stream cannot
// be trusted any more: the connection must close.
func (r *replyReader) next(lookup func(handle uint64) *call) (*call, bool, error) {
	if _, err := io.ReadFull(r.br, r.hdr[:4]); err != nil {
		return nil, false, err
	}
	n := wire.DecodeReplyMagic(r.hdr[:4])
	if n == 0 || (n == wire.ChunkHeaderSize && !r.structured) {
		return nil, false, fmt.Errorf("reply magic %#x: %w", binary.BigEndian.Uint32(r.hdr[:4]), ErrProtocol)
	}
	if _, err := io.ReadFull(r.br, r.hdr[4:n]); err != nil {
		return nil, false, err
	}
	h := wire.DecodeReply(r.hdr[:n])
	c := lookup(h.Handle)
	if c == nil {
		return nil, false, fmt.Errorf("reply for unknown handle %#x: %w", h.Handle, ErrProtocol)
	}
	if !h.Structured {
		return c, true, r.simple(c, h)
	}
	return c, h.Done(), r.chunk(c, h)
}

func (r *replyReader) simple(c *call, h wire.Reply) error {
	if h.Errno != 0 {
		c.setErrno(h.Errno, "")
		return nil
	}
	switch c.req.Type {
	case wire.CmdRead:
		if r.structured {
			// proto.md: once structured replies are negotiated a READ's
			// data comes only in chunks, and a server that sends it
			// otherwise cannot be trusted to frame the rest.
			return fmt.Errorf("simple reply with data to READ after structured replies were negotiated: %w", ErrProtocol)
		}
		if _, err := io.ReadFull(r.br, c.buf); err != nil {
			return err
		}
		c.covered = append(c.covered[:0], backing.Range{Off: 0, Len: int64(len(c.buf))})
	case wire.CmdBlockStatus:
		return fmt.Errorf("simple reply to BLOCK_STATUS: %w", ErrProtocol)
	}
	return nil
}

func (r *replyReader) chunk(c *call, h wire.Reply) error {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("chunk type %d, %d bytes, for %s: %s: %w", h.Type, h.Length, cmdName(c.req.Type), fmt.Sprintf(format, args...), ErrProtocol)
	}
	switch {
	case h.Type == wire.ChunkNone:
		if h.Length != 0 || !h.Done() {
			return bad("NONE must be empty and final")
		}
	case h.Type&wire.ChunkErrorBit != 0:
		return r.errorChunk(c, h, bad)
	case h.Type == wire.ChunkOffsetData && c.req.Type == wire.CmdRead:
		if h.Length < 9 {
			return bad("no data")
		}
		off, err := r.u64()
		if err != nil {
			return err
		}
		rel, ok := c.within(off, uint64(h.Length-8))
		if !ok {
			return bad("offset %d outside the request", off)
		}
		if err := c.cover(rel, int64(h.Length-8)); err != nil {
			return bad("%v", err)
		}
		if _, err := io.ReadFull(r.br, c.buf[rel:rel+int64(h.Length-8)]); err != nil {
			return err
		}
	case h.Type == wire.ChunkOffsetHole && c.req.Type == wire.CmdRead:
		if h.Length != 12 {
			return bad("want 12 bytes")
		}
		off, err := r.u64()
		if err != nil {
			return err
		}
		n, err := r.u32()
		if err != nil {
			return err
		}
		rel, ok := c.within(off, uint64(n))
		if !ok || n == 0 {
			return bad("hole %d+%d outside the request", off, n)
		}
		if err := c.cover(rel, int64(n)); err != nil {
			return bad("%v", err)
		}
		clear(c.buf[rel : rel+int64(n)])
	case h.Type == wire.ChunkBlockStatus && c.req.Type == wire.CmdBlockStatus:
		if err := r.blockStatus(c, h, bad); err != nil {
			return err
		}
	default:
		return bad("unexpected")
	}
	if h.Done() {
		return c.complete(bad)
	}
	return nil
}

// errorChunk reads ERROR, ERROR_OFFSET and error types proto.md may add
// later, which a client must take as errors.
func (r *replyReader) errorChunk(c *call, h wire.Reply, bad func(string, ...any) error) error {
	if h.Length < 6 || h.Length > maxErrorChunk {
		return bad("bad length")
	}
	errno, err := r.u32()
	if err != nil {
		return err
	}
	var mb [2]byte
	if _, err := io.ReadFull(r.br, mb[:]); err != nil {
		return err
	}
	mlen := uint32(binary.BigEndian.Uint16(mb[:]))
	want := 6 + mlen
	if h.Type == wire.ChunkErrorOffset {
		want += 8
	}
	known := h.Type == wire.ChunkError || h.Type == wire.ChunkErrorOffset
	if (known && h.Length != want) || h.Length < 6+mlen {
		return bad("message of %d bytes does not fit", mlen)
	}
	keep := min(mlen, maxMessage)
	msg := make([]byte, keep)
	if _, err := io.ReadFull(r.br, msg); err != nil {
		return err
	}
	if _, err := r.br.Discard(int(h.Length - 6 - keep)); err != nil {
		return err
	}
	if errno == 0 {
		errno = wire.EIO // proto.md: must not be 0; take it as a failure all the same
	}
	c.setErrno(errno, printable(msg))
	return nil
}

// blockStatus reads the descriptors of one BLOCK_STATUS chunk, keeping the
// extents that are both holes and zeros (backing.Device.Holes promises
// ranges that read as zeros; a hole that does not read as zeros is data
// to us), clipped to the request.
func (r *replyReader) blockStatus(c *call, h wire.Reply, bad func(string, ...any) error) error {
	if h.Length < 12 || (h.Length-4)%8 != 0 || (h.Length-4)/8 > maxDescriptors {
		return bad("bad length")
	}
	if c.status {
		return bad("a second BLOCK_STATUS chunk for one context")
	}
	id, err := r.u32()
	if err != nil {
		return err
	}
	if id != r.metaID {
		return bad("context %d, not the one selected (%d)", id, r.metaID)
	}
	c.status = true
	start, end := c.req.Offset, c.req.Offset+uint64(c.req.Length)
	pos := start
	for range (h.Length - 4) / 8 {
		if _, err := io.ReadFull(r.br, r.scratch[:8]); err != nil {
			return err
		}
		n := uint64(binary.BigEndian.Uint32(r.scratch[0:]))
		flags := binary.BigEndian.Uint32(r.scratch[4:])
		if n == 0 {
			return bad("an extent of length 0")
		}
		if pos >= end {
			continue // proto.md lets the last extent run past the request; any after it are ignored
		}
		n = min(n, end-pos)
		if flags&(wire.StateHole|wire.StateZero) == wire.StateHole|wire.StateZero {
			c.addHole(int64(pos), int64(n))
		}
		pos += n
	}
	c.covered = append(c.covered[:0], backing.Range{Off: 0, Len: int64(pos - start)})
	return nil
}

func (r *replyReader) u64() (uint64, error) {
	if _, err := io.ReadFull(r.br, r.scratch[:8]); err != nil {
		return 0, err
	}
	return binary.BigEndian.Uint64(r.scratch[:8]), nil
}

func (r *replyReader) u32() (uint32, error) {
	if _, err := io.ReadFull(r.br, r.scratch[:4]); err != nil {
		return 0, err
	}
	return binary.BigEndian.Uint32(r.scratch[:4]), nil
}

// setErrno records the first error a request's replies report.
func (c *call) setErrno(errno uint32, msg string) {
	if c.errno == 0 {
		c.errno, c.msg = errno, msg
	}
}

// within says where [off, off+n) starts inside the request, if it lies
// inside it.
func (c *call) within(off, n uint64) (int64, bool) {
	start, length := c.req.Offset, uint64(c.req.Length)
	if off < start || n > length || off-start > length-n {
		return 0, false
	}
	return int64(off - start), true
}

// cover records that [rel, rel+n) of a READ arrived. proto.md forbids
// chunks that overlap; pieces out of order are kept in a short sorted list
// (in order, they merge into one).
func (c *call) cover(rel, n int64) error {
	r := backing.Range{Off: rel, Len: n}
	i := 0
	for i < len(c.covered) && c.covered[i].End() <= r.Off {
		i++
	}
	if i < len(c.covered) && c.covered[i].Off < r.End() {
		return errors.New("chunks overlap")
	}
	switch {
	case i > 0 && c.covered[i-1].End() == r.Off:
		c.covered[i-1].Len += r.Len
		if i < len(c.covered) && c.covered[i-1].End() == c.covered[i].Off {
			c.covered[i-1].Len += c.covered[i].Len
			c.covered = append(c.covered[:i], c.covered[i+1:]...)
		}
	case i < len(c.covered) && r.End() == c.covered[i].Off:
		c.covered[i].Off, c.covered[i].Len = r.Off, c.covered[i].Len+r.Len
	default:
		if len(c.covered) == maxPieces {
			return errors.New("too many disjoint chunks")
		}
		c.covered = append(c.covered, backing.Range{})
		copy(c.covered[i+1:], c.covered[i:])
		c.covered[i] = r
	}
	return nil
}

// addHole appends a hole, merging it with the previous one when they
// touch; past maxHoles the rest is left as data, the safe answer.
func (c *call) addHole(off, n int64) {
	if k := len(c.holes) - 1; k >= 0 && c.holes[k].End() == off {
		c.holes[k].Len += n
		return
	}
	if len(c.holes) < maxHoles {
		c.holes = append(c.holes, backing.Range{Off: off, Len: n})
	}
}

// complete checks a request's replies once the last has come: a READ
// without an error must have had all its bytes, a BLOCK_STATUS its
// extents.
func (c *call) complete(bad func(string, ...any) error) error {
	if c.errno != 0 {
		return nil
	}
	switch c.req.Type {
	case wire.CmdRead:
		if c.req.Length > 0 && (len(c.covered) != 1 || c.covered[0].Len != int64(c.req.Length)) {
			return bad("the read's data is incomplete")
		}
	case wire.CmdBlockStatus:
		if !c.status {
			return bad("no extents")
		}
	}
	return nil
}

func cmdName(t uint16) string {
	if int(t) < len(wire.CmdNames) {
		return wire.CmdNames[t]
	}
	return fmt.Sprintf("command %d", t)
}
