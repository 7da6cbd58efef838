package soak

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"time"

	"github.com/nbdmapper/nbdmapper/internal/testing/nbdtest"
)

// A raw, pipelined NBD client written from proto.md: fixed newstyle with
// NO_ZEROES, optionally structured replies and base:allocation, then any
// number of requests in flight, answered in any order. Byte layouts are in
// the NBD protocol's doc/proto.md (and ../shared/REFERENCE.md).
const (
	nbdMagic     = 0x4e42444d41474943
	optMagic     = 0x49484156454F5054
	repMagic     = 0x3e889045565a9
	reqMagic     = 0x25609513
	simpleMagic  = 0x67446698
	chunkMagic   = 0x668e33ef
	optGo        = 7
	optStruct    = 8
	optSetMeta   = 10
	repAck       = 1
	repInfo      = 3
	repMeta      = 4
	cmdRead      = nbdtest.CmdRead
	cmdWrite     = nbdtest.CmdWrite
	cmdDisc      = nbdtest.CmdDisc
	cmdFlush     = nbdtest.CmdFlush
	cmdTrim      = nbdtest.CmdTrim
	cmdCache     = nbdtest.CmdCache
	cmdZeroes    = nbdtest.CmdWriteZeroes
	cmdBlockStat = nbdtest.CmdBlockStatus
	flagFUA      = nbdtest.FlagFUA
	flagNoHole   = nbdtest.FlagNoHole
	flagReqOne   = nbdtest.FlagReqOne
	flagFastZero = nbdtest.FlagFastZero
	chunkNone    = 0
	chunkData    = 1
	chunkHole    = 2
	chunkBS      = 5
	chunkErr     = 1<<15 + 1
	chunkErrOff  = 1<<15 + 2
	stateZero    = 1 << 1
	errENOTSUP   = 95
)

// nbdConn is one client connection. Requests are sent by one goroutine
// (send); a reader goroutine matches replies to them and calls their done.
type nbdConn struct {
	nc         net.Conn
	bw         *bufio.Writer
	structured bool
	metaID     uint32
	size       int64

	mu         sync.Mutex
	cookie     uint64
	waiting    map[uint64]*call
	err        error // why the reader stopped
	readerDone chan struct{}
}

// call is one request in flight and what its reply carried.
type call struct {
	typ, flags uint16
	off        int64
	n          int64
	errno      uint32
	data       []byte      // READ: the bytes read
	exts       [][2]uint32 // BLOCK_STATUS: (length, flags)
	done       func(*call) // called by the reader with the reply, or with lost set
	lost       bool        // the connection died before the reply
	covered    int64       // READ: bytes the content chunks covered
	holes      int64       // READ: OFFSET_HOLE chunks among them
	holeAt     []int64     // READ: offset and length of the first two, for a failure's report
}

func dialNBD(sock, export string, structured bool) (*nbdConn, error) {
	nc, err := net.Dial("unix", sock)
	if err != nil {
		return nil, err
	}
	c := &nbdConn{nc: nc, bw: bufio.NewWriterSize(nc, 256<<10), structured: structured,
		waiting: make(map[uint64]*call), readerDone: make(chan struct{})}
	nc.SetDeadline(time.Now().Add(bound))
	br := bufio.NewReaderSize(nc, 256<<10)
	if err := c.handshake(br, export); err != nil {
		nc.Close()
		return nil, fmt.Errorf("handshake: %w", err)
	}
	nc.SetDeadline(time.Time{})
	go c.reader(br)
	return c, nil
}

func (c *nbdConn) handshake(br *bufio.Reader, export string) error {
	var g [18]byte
	if _, err := io.ReadFull(br, g[:]); err != nil {
		return err
	}
	if binary.BigEndian.Uint64(g[:]) != nbdMagic || binary.BigEndian.Uint64(g[8:]) != optMagic {
		return fmt.Errorf("greeting %x", g)
	}
	b := binary.BigEndian.AppendUint32(nil, 3)
	opt := func(id uint32, data []byte) {
		b = binary.BigEndian.AppendUint64(b, optMagic)
		b = binary.BigEndian.AppendUint32(b, id)
		b = binary.BigEndian.AppendUint32(b, uint32(len(data)))
		b = append(b, data...)
	}
	name := binary.BigEndian.AppendUint32(nil, uint32(len(export)))
	name = append(name, export...)
	if c.structured {
		opt(optStruct, nil)
		q := binary.BigEndian.AppendUint32(append([]byte(nil), name...), 1)
		q = binary.BigEndian.AppendUint32(q, uint32(len("base:allocation")))
		opt(optSetMeta, append(q, "base:allocation"...))
	}
	opt(optGo, binary.BigEndian.AppendUint16(append([]byte(nil), name...), 0))
	if _, err := c.nc.Write(b); err != nil {
		return err
	}
	for {
		var h [20]byte
		if _, err := io.ReadFull(br, h[:]); err != nil {
			return err
		}
		if binary.BigEndian.Uint64(h[:]) != repMagic {
			return fmt.Errorf("option reply magic %x", h[:8])
		}
		id, typ := binary.BigEndian.Uint32(h[8:]), binary.BigEndian.Uint32(h[12:])
		data := make([]byte, binary.BigEndian.Uint32(h[16:]))
		if _, err := io.ReadFull(br, data); err != nil {
			return err
		}
		switch {
		case typ&(1<<31) != 0:
			return fmt.Errorf("option %d: error %#x %q", id, typ, data)
		case typ == repMeta && len(data) >= 4:
			c.metaID = binary.BigEndian.Uint32(data)
		case typ == repInfo && len(data) == 12 && binary.BigEndian.Uint16(data) == 0:
			c.size = int64(binary.BigEndian.Uint64(data[2:]))
		case typ == repAck && id == optGo:
			return nil
		}
	}
}

// send queues a request; flush writes everything queued. A WRITE's payload
// follows its header.
func (c *nbdConn) send(cl *call, payload []byte) error {
	c.mu.Lock()
	if c.err != nil {
		c.mu.Unlock()
		return c.err
	}
	c.cookie++
	cookie := c.cookie
	c.waiting[cookie] = cl
	c.mu.Unlock()
	var h [28]byte
	putHeader(h[:], cl.typ, cl.flags, cl.off, cl.n)
	binary.BigEndian.PutUint64(h[8:], cookie)
	c.bw.Write(h[:])
	_, err := c.bw.Write(payload)
	return err
}

func (c *nbdConn) flush() error { return c.bw.Flush() }

// writeRaw sends bytes as they are (for aborts) and flushes.
func (c *nbdConn) writeRaw(b []byte) {
	c.bw.Write(b)
	c.bw.Flush()
}

// close ends the connection; calls still waiting are finished as lost.
func (c *nbdConn) close() {
	c.nc.Close()
	<-c.readerDone
}

func (c *nbdConn) reader(br *bufio.Reader) {
	defer close(c.readerDone)
	err := c.readReplies(br)
	c.mu.Lock()
	if c.err == nil {
		c.err = err
	}
	lost := c.waiting
	c.waiting = nil
	c.mu.Unlock()
	for _, cl := range lost {
		cl.lost = true
		cl.done(cl)
	}
}

var errProtocol = errors.New("protocol violation")

func (c *nbdConn) take(cookie uint64, final bool) (*call, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	cl := c.waiting[cookie]
	if cl == nil {
		return nil, fmt.Errorf("%w: reply for cookie %d, which is not in flight", errProtocol, cookie)
	}
	if final {
		delete(c.waiting, cookie)
	}
	return cl, nil
}

func (c *nbdConn) readReplies(br *bufio.Reader) error {
	var h [20]byte
	for {
		if _, err := io.ReadFull(br, h[:4]); err != nil {
			return err
		}
		switch binary.BigEndian.Uint32(h[:]) {
		case simpleMagic:
			if _, err := io.ReadFull(br, h[4:16]); err != nil {
				return err
			}
			cl, err := c.take(binary.BigEndian.Uint64(h[8:]), true)
			if err != nil {
				return err
			}
			cl.errno = binary.BigEndian.Uint32(h[4:])
			if cl.typ == cmdRead && cl.errno == 0 {
				cl.data = make([]byte, cl.n)
				if _, err := io.ReadFull(br, cl.data); err != nil {
					return err
				}
			}
			cl.done(cl)
		case chunkMagic:
			if _, err := io.ReadFull(br, h[4:20]); err != nil {
				return err
			}
			flags, typ := binary.BigEndian.Uint16(h[4:]), binary.BigEndian.Uint16(h[6:])
			final := flags&1 != 0
			cl, err := c.take(binary.BigEndian.Uint64(h[8:]), final)
			if err != nil {
				return err
			}
			p := make([]byte, binary.BigEndian.Uint32(h[16:]))
			if _, err := io.ReadFull(br, p); err != nil {
				return err
			}
			if err := cl.chunk(typ, p); err != nil {
				return err
			}
			if final && cl.typ == cmdRead && typ < 1<<15 && cl.covered != cl.n {
				return fmt.Errorf("%w: read of %d+%d answered with chunks covering %d bytes", errProtocol, cl.off, cl.n, cl.covered)
			}
			if final {
				cl.done(cl)
			}
		default:
			return fmt.Errorf("%w: reply magic %x", errProtocol, h[:4])
		}
	}
}

// chunk applies one structured reply chunk to cl.
func (cl *call) chunk(typ uint16, p []byte) error {
	bad := func(what string) error {
		return fmt.Errorf("%w: %s in a chunk of type %d (%d bytes) for request type %d at %d+%d",
			errProtocol, what, typ, len(p), cl.typ, cl.off, cl.n)
	}
	within := func(off, n int64) bool { return off >= cl.off && n >= 0 && off+n <= cl.off+cl.n }
	switch typ {
	case chunkNone:
		if len(p) != 0 {
			return bad("payload")
		}
	case chunkData, chunkHole:
		if cl.typ != cmdRead || len(p) < 8 {
			return bad("data")
		}
		off := int64(binary.BigEndian.Uint64(p))
		if cl.data == nil {
			cl.data = make([]byte, cl.n)
		}
		if typ == chunkData {
			if !within(off, int64(len(p)-8)) || len(p) == 8 {
				return bad("range")
			}
			copy(cl.data[off-cl.off:], p[8:])
			cl.covered += int64(len(p) - 8)
		} else {
			n := int64(binary.BigEndian.Uint32(p[8:]))
			if len(p) != 12 || n == 0 || !within(off, n) {
				return bad("hole")
			}
			clear(cl.data[off-cl.off : off-cl.off+n])
			cl.covered += n
			cl.holes++
			if len(cl.holeAt) < 4 {
				cl.holeAt = append(cl.holeAt, off, n)
			}
		}
	case chunkBS:
		if cl.typ != cmdBlockStat || len(p) < 12 || (len(p)-4)%8 != 0 {
			return bad("block status")
		}
		for q := p[4:]; len(q) > 0; q = q[8:] {
			cl.exts = append(cl.exts, [2]uint32{binary.BigEndian.Uint32(q), binary.BigEndian.Uint32(q[4:])})
		}
	case chunkErr, chunkErrOff:
		if len(p) < 6 {
			return bad("error")
		}
		if cl.errno == 0 {
			cl.errno = binary.BigEndian.Uint32(p)
		}
		if cl.errno == 0 {
			return bad("errno 0")
		}
	default:
		return bad("type")
	}
	return nil
}
