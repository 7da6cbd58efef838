package nbdtest

import (
	"bufio"
	"crypto/tls"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
)

// Client is a small NBD client (fixed newstyle, written from proto.md) for
// what libnbd will not do: requests longer than its 64 MiB cap, thousands
// of requests in flight, no block-size negotiation, hanging up at any
// point, acting on each reply the moment it arrives. It returns errors
// instead of failing a test, so any goroutine may use it; Send and Recv
// each belong to one goroutine at a time.
//
// Pipelined:
//
//	c, _ := nbdtest.DialNBD("unix", sock, "d", nbdtest.Structured)
//	c.Send(nbdtest.CmdWrite, 0, 1, 0, uint32(len(p)))
//	c.Write(p)
//	r, _ := c.Recv() // r.Handle == 1, r.Errno == 0
//
// Or one request and its reply at a time, as libnbd's synchronous calls:
//
//	c.Pwrite(p, off, true) // with FUA
//	c.Flush()
type Client struct {
	nc     net.Conn
	br     *bufio.Reader
	bw     *bufio.Writer
	size   uint64 // from NBD_INFO_EXPORT
	flags  uint16
	cookie uint64 // the last handle the synchronous calls used
}

// Size is the export size the server announced.
func (c *Client) Size() uint64 { return c.size }

// Flags are the transmission flags the server announced.
func (c *Client) Flags() uint16 { return c.flags }

// Dial connects to export on a unix socket with no protocol extensions.
func Dial(socket, export string) (*Client, error) { return DialNBD("unix", socket, export) }

// Commands, command flags and options, as proto.md numbers them.
const (
	CmdRead        = 0
	CmdWrite       = 1
	CmdDisc        = 2
	CmdFlush       = 3
	CmdTrim        = 4
	CmdCache       = 5
	CmdWriteZeroes = 6
	CmdBlockStatus = 7

	FlagFUA      = 1 << 0
	FlagNoHole   = 1 << 1
	FlagDF       = 1 << 2
	FlagReqOne   = 1 << 3
	FlagFastZero = 1 << 4
)

// DialOption asks for a protocol extension in the handshake.
type DialOption int

const (
	Structured DialOption = iota // NBD_OPT_STRUCTURED_REPLY
	Allocation                   // SET_META_CONTEXT base:allocation (implies Structured)
)

// DialNBD connects and negotiates export with NBD_OPT_GO, asking for no
// info beyond the mandatory NBD_INFO_EXPORT (so no block size limits).
func DialNBD(network, addr, export string, opts ...DialOption) (*Client, error) {
	return DialTLS(network, addr, export, nil, opts...)
}

// DialTLS is DialNBD with NBD_OPT_STARTTLS first, when cfg is not nil:
// every later option and the transmission phase go over TLS with cfg.
func DialTLS(network, addr, export string, cfg *tls.Config, opts ...DialOption) (*Client, error) {
	nc, err := net.Dial(network, addr)
	if err != nil {
		return nil, err
	}
	c := &Client{}
	c.use(nc)
	if err := c.handshake(export, cfg, opts); err != nil {
		c.nc.Close()
		return nil, fmt.Errorf("handshake: %w", err)
	}
	return c, nil
}

// use makes nc the connection the client reads and writes.
func (c *Client) use(nc net.Conn) {
	c.nc, c.br, c.bw = nc, bufio.NewReaderSize(nc, 1<<20), bufio.NewWriterSize(nc, 1<<20)
}

func (c *Client) handshake(export string, cfg *tls.Config, opts []DialOption) error {
	var g [18]byte
	if _, err := io.ReadFull(c.br, g[:]); err != nil {
		return err
	}
	if binary.BigEndian.Uint64(g[:]) != 0x4e42444d41474943 || binary.BigEndian.Uint64(g[8:]) != 0x49484156454F5054 {
		return errors.New("bad greeting")
	}
	c.bw.Write(binary.BigEndian.AppendUint32(nil, 3)) // FIXED_NEWSTYLE | NO_ZEROES
	if cfg != nil {
		if _, err := c.option(5, nil); err != nil { // STARTTLS
			return err
		}
		tc := tls.Client(c.nc, cfg)
		if err := tc.Handshake(); err != nil {
			return err
		}
		c.use(tc)
	}
	structured, meta := false, false
	for _, o := range opts {
		structured = structured || o == Structured || o == Allocation
		meta = meta || o == Allocation
	}
	if structured {
		if _, err := c.option(8, nil); err != nil {
			return err
		}
	}
	name := binary.BigEndian.AppendUint32(nil, uint32(len(export)))
	name = append(name, export...)
	if meta {
		q := binary.BigEndian.AppendUint32(name, 1)
		q = binary.BigEndian.AppendUint32(q, uint32(len("base:allocation")))
		if _, err := c.option(10, append(q, "base:allocation"...)); err != nil {
			return err
		}
	}
	infos, err := c.option(7, binary.BigEndian.AppendUint16(name, 0))
	if err != nil {
		return err
	}
	for _, in := range infos {
		if len(in) >= 12 && binary.BigEndian.Uint16(in) == 0 {
			c.size, c.flags = binary.BigEndian.Uint64(in[2:]), binary.BigEndian.Uint16(in[10:])
			return nil
		}
	}
	return errors.New("no NBD_INFO_EXPORT")
}

// option sends one option and reads its replies up to the final one,
// returning the data of REP_INFO replies.
func (c *Client) option(id uint32, data []byte) ([][]byte, error) {
	b := binary.BigEndian.AppendUint64(nil, 0x49484156454F5054)
	b = binary.BigEndian.AppendUint32(b, id)
	b = binary.BigEndian.AppendUint32(b, uint32(len(data)))
	c.bw.Write(append(b, data...))
	if err := c.bw.Flush(); err != nil {
		return nil, err
	}
	var infos [][]byte
	for {
		var h [20]byte
		if _, err := io.ReadFull(c.br, h[:]); err != nil {
			return nil, err
		}
		typ := binary.BigEndian.Uint32(h[12:])
		body := make([]byte, binary.BigEndian.Uint32(h[16:]))
		if _, err := io.ReadFull(c.br, body); err != nil {
			return nil, err
		}
		switch {
		case typ == 1: // ACK
			return infos, nil
		case typ == 3: // INFO
			infos = append(infos, body)
		case typ&(1<<31) != 0:
			return nil, fmt.Errorf("option %d: error reply %#x %q", id, typ, body)
		}
	}
}

// Send writes a request header; a WRITE's payload follows with Write.
// Nothing leaves until Recv or a full buffer.
func (c *Client) Send(typ, flags uint16, handle, off uint64, length uint32) error {
	b := binary.BigEndian.AppendUint32(make([]byte, 0, 28), 0x25609513)
	b = binary.BigEndian.AppendUint16(b, flags)
	b = binary.BigEndian.AppendUint16(b, typ)
	b = binary.BigEndian.AppendUint64(b, handle)
	b = binary.BigEndian.AppendUint64(b, off)
	b = binary.BigEndian.AppendUint32(b, length)
	_, err := c.bw.Write(b)
	return err
}

// Write sends payload bytes.
func (c *Client) Write(p []byte) (int, error) { return c.bw.Write(p) }

// Reply is a simple reply or one structured reply chunk.
type Reply struct {
	Simple  bool
	Handle  uint64
	Errno   uint32 // simple replies and error chunks
	Flags   uint16 // chunks: NBD_REPLY_FLAG_DONE is 1
	Type    uint16 // chunks: NONE 0, OFFSET_DATA 1, OFFSET_HOLE 2, BLOCK_STATUS 5, errors 2^15+
	Offset  uint64 // OFFSET_DATA and OFFSET_HOLE
	DataLen int64  // OFFSET_DATA: bytes of data that follow, to take with Read
	Payload []byte // other chunks: their whole payload
}

// Done reports whether this is the last reply for its handle.
func (r Reply) Done() bool { return r.Simple || r.Flags&1 != 0 }

// Recv flushes what is buffered and reads the next reply header. A
// successful simple READ reply's data, and an OFFSET_DATA chunk's, follow
// and must be taken with Read before the next Recv.
func (c *Client) Recv() (Reply, error) {
	if err := c.bw.Flush(); err != nil {
		return Reply{}, err
	}
	var m [4]byte
	if _, err := io.ReadFull(c.br, m[:]); err != nil {
		return Reply{}, err
	}
	switch binary.BigEndian.Uint32(m[:]) {
	case 0x67446698:
		var h [12]byte
		if _, err := io.ReadFull(c.br, h[:]); err != nil {
			return Reply{}, err
		}
		return Reply{Simple: true, Errno: binary.BigEndian.Uint32(h[:]), Handle: binary.BigEndian.Uint64(h[4:])}, nil
	case 0x668e33ef:
		var h [16]byte
		if _, err := io.ReadFull(c.br, h[:]); err != nil {
			return Reply{}, err
		}
		r := Reply{Flags: binary.BigEndian.Uint16(h[:]), Type: binary.BigEndian.Uint16(h[2:]), Handle: binary.BigEndian.Uint64(h[4:])}
		n := int64(binary.BigEndian.Uint32(h[12:]))
		if r.Type == 1 {
			var off [8]byte
			if _, err := io.ReadFull(c.br, off[:]); err != nil {
				return r, err
			}
			r.Offset, r.DataLen = binary.BigEndian.Uint64(off[:]), n-8
			return r, nil
		}
		r.Payload = make([]byte, n)
		if _, err := io.ReadFull(c.br, r.Payload); err != nil {
			return r, err
		}
		if r.Type == 2 && n >= 8 {
			r.Offset = binary.BigEndian.Uint64(r.Payload)
		}
		if r.Type&(1<<15) != 0 && n >= 4 {
			r.Errno = binary.BigEndian.Uint32(r.Payload)
		}
		return r, nil
	}
	return Reply{}, errors.New("bad reply magic")
}

// Read reads reply data (see Recv).
func (c *Client) Read(p []byte) (int, error) { return c.br.Read(p) }

// ErrnoError is an NBD error reply to a synchronous call.
type ErrnoError uint32

func (e ErrnoError) Error() string { return fmt.Sprintf("NBD error %d", uint32(e)) }

// do sends one request (and payload) and waits for its reply, which must
// be the next one; a READ's data goes into into.
func (c *Client) do(typ, flags uint16, off uint64, length uint32, payload, into []byte) error {
	c.cookie++
	if err := c.Send(typ, flags, c.cookie, off, length); err != nil {
		return err
	}
	if _, err := c.Write(payload); err != nil {
		return err
	}
	for {
		r, err := c.Recv()
		if err != nil {
			return err
		}
		if r.Handle != c.cookie {
			return fmt.Errorf("reply for handle %d, want %d", r.Handle, c.cookie)
		}
		if r.Errno != 0 {
			return ErrnoError(r.Errno)
		}
		switch {
		case r.Simple && typ == CmdRead:
			_, err = io.ReadFull(c, into)
			return err
		case r.Type == 1: // OFFSET_DATA
			if _, err := io.ReadFull(c, into[r.Offset-off:][:r.DataLen]); err != nil {
				return err
			}
		}
		if r.Done() {
			return nil
		}
	}
}

// Pwrite writes p at off and waits for the reply, with FUA if fua.
func (c *Client) Pwrite(p []byte, off int64, fua bool) error {
	var flags uint16
	if fua {
		flags = FlagFUA
	}
	return c.do(CmdWrite, flags, uint64(off), uint32(len(p)), p, nil)
}

// Pread reads len(p) bytes at off into p.
func (c *Client) Pread(p []byte, off int64) error {
	return c.do(CmdRead, 0, uint64(off), uint32(len(p)), nil, p)
}

// Flush sends NBD_CMD_FLUSH and waits for its reply.
func (c *Client) Flush() error { return c.do(CmdFlush, 0, 0, 0, nil, nil) }

// Close hangs up without NBD_CMD_DISC.
func (c *Client) Close() error { return c.nc.Close() }
