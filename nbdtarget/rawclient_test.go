package nbdtarget

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"testing"
	"time"

	"github.com/nbdmapper/nbdmapper/internal/testing/nbdtest"
	"github.com/nbdmapper/nbdmapper/wire"
)

// rawClient speaks the wire protocol byte by byte, so tests can send what
// no well-behaved client would. Its encoders are written from proto.md, not
// from the server's helpers, except wire.AppendRequest (checked by FuzzRequest's
// round trip).
type rawClient struct {
	t  testing.TB
	nc net.Conn
}

func dialRaw(t testing.TB, sock string) *rawClient {
	t.Helper()
	nc, err := net.Dial("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { nc.Close() })
	return &rawClient{t: t, nc: nc}
}

func (c *rawClient) write(b []byte) {
	c.t.Helper()
	if _, err := c.nc.Write(b); err != nil {
		c.t.Fatalf("write: %v", err)
	}
}

func (c *rawClient) read(n int) []byte {
	c.t.Helper()
	b := make([]byte, n)
	c.nc.SetReadDeadline(time.Now().Add(nbdtest.Bound))
	defer c.nc.SetReadDeadline(time.Time{})
	if _, err := io.ReadFull(c.nc, b); err != nil {
		c.t.Fatalf("read %d bytes: %v", n, err)
	}
	return b
}

// closed reports whether the server closed the connection (EOF on read)
// rather than sending a byte. It waits at most nbdtest.Bound.
func (c *rawClient) closed() bool {
	c.t.Helper()
	c.nc.SetReadDeadline(time.Now().Add(nbdtest.Bound))
	defer c.nc.SetReadDeadline(time.Time{})
	var b [1]byte
	_, err := c.nc.Read(b[:])
	if errors.Is(err, os.ErrDeadlineExceeded) {
		c.t.Fatalf("connection neither closed nor sent anything in %v", nbdtest.Bound)
	}
	return err != nil
}

// greet reads the greeting and sends client flags.
func (c *rawClient) greet(cflags uint32) {
	c.t.Helper()
	g := c.read(18)
	if m := binary.BigEndian.Uint64(g); m != 0x4e42444d41474943 {
		c.t.Fatalf("NBDMAGIC = %#x", m)
	}
	if m := binary.BigEndian.Uint64(g[8:]); m != 0x49484156454F5054 {
		c.t.Fatalf("IHAVEOPT = %#x", m)
	}
	if f := binary.BigEndian.Uint16(g[16:]); f != 3 {
		c.t.Fatalf("handshake flags = %#x, want FIXED_NEWSTYLE|NO_ZEROES", f)
	}
	c.write(binary.BigEndian.AppendUint32(nil, cflags))
}

func (c *rawClient) option(id uint32, data []byte) {
	c.t.Helper()
	b := binary.BigEndian.AppendUint64(nil, 0x49484156454F5054)
	b = binary.BigEndian.AppendUint32(b, id)
	b = binary.BigEndian.AppendUint32(b, uint32(len(data)))
	c.write(append(b, data...))
}

type optRep struct {
	opt, typ uint32
	data     []byte
}

func (c *rawClient) reply() optRep {
	c.t.Helper()
	h := c.read(20)
	if m := binary.BigEndian.Uint64(h); m != 0x3e889045565a9 {
		c.t.Fatalf("option reply magic %#x", m)
	}
	r := optRep{opt: binary.BigEndian.Uint32(h[8:]), typ: binary.BigEndian.Uint32(h[12:])}
	r.data = c.read(int(binary.BigEndian.Uint32(h[16:])))
	return r
}

// replies reads option replies up to and including the first non-INFO,
// non-SERVER, non-META_CONTEXT one.
func (c *rawClient) replies() []optRep {
	c.t.Helper()
	var out []optRep
	for {
		r := c.reply()
		out = append(out, r)
		if r.typ != 2 && r.typ != 3 && r.typ != 4 {
			return out
		}
	}
}

func infoData(name string, reqs ...uint16) []byte {
	b := binary.BigEndian.AppendUint32(nil, uint32(len(name)))
	b = append(b, name...)
	b = binary.BigEndian.AppendUint16(b, uint16(len(reqs)))
	for _, r := range reqs {
		b = binary.BigEndian.AppendUint16(b, r)
	}
	return b
}

func metaData(name string, queries ...string) []byte {
	b := binary.BigEndian.AppendUint32(nil, uint32(len(name)))
	b = append(b, name...)
	b = binary.BigEndian.AppendUint32(b, uint32(len(queries)))
	for _, q := range queries {
		b = binary.BigEndian.AppendUint32(b, uint32(len(q)))
		b = append(b, q...)
	}
	return b
}

// connect does a whole handshake: optionally STRUCTURED_REPLY and SET
// base:allocation, then GO to name. It returns the transmission flags.
func (c *rawClient) connect(name string, structured, meta bool) uint16 {
	c.t.Helper()
	c.greet(3)
	if structured {
		c.option(8, nil)
		if r := c.reply(); r.typ != 1 {
			c.t.Fatalf("STRUCTURED_REPLY: reply %#x", r.typ)
		}
	}
	if meta {
		c.option(10, metaData(name, "base:allocation"))
		rs := c.replies()
		if len(rs) != 2 || rs[0].typ != 4 || rs[1].typ != 1 {
			c.t.Fatalf("SET_META_CONTEXT: %+v", rs)
		}
	}
	c.option(7, infoData(name))
	var flags uint16
	for _, r := range c.replies() {
		switch {
		case r.typ == 3 && binary.BigEndian.Uint16(r.data) == 0:
			flags = binary.BigEndian.Uint16(r.data[10:])
		case r.typ == 1:
		case r.typ == 3:
		default:
			c.t.Fatalf("GO %q: reply %#x %q", name, r.typ, r.data)
		}
	}
	return flags
}

func (c *rawClient) request(typ, flags uint16, handle, off uint64, length uint32, payload []byte) {
	c.t.Helper()
	b := wire.AppendRequest(nil, wire.Request{Flags: flags, Type: typ, Handle: handle, Offset: off, Length: length})
	c.write(append(b, payload...))
}

// simple reads a simple reply and, when dataLen > 0 and no error, its data.
func (c *rawClient) simple(dataLen int) (handle uint64, errno uint32, data []byte) {
	c.t.Helper()
	h := c.read(16)
	if m := binary.BigEndian.Uint32(h); m != 0x67446698 {
		c.t.Fatalf("simple reply magic %#x", m)
	}
	errno, handle = binary.BigEndian.Uint32(h[4:]), binary.BigEndian.Uint64(h[8:])
	if errno == 0 && dataLen > 0 {
		data = c.read(dataLen)
	}
	return handle, errno, data
}

type chunk struct {
	flags, typ uint16
	handle     uint64
	payload    []byte
}

func (c *rawClient) chunk() chunk {
	c.t.Helper()
	h := c.read(20)
	if m := binary.BigEndian.Uint32(h); m != 0x668e33ef {
		c.t.Fatalf("structured reply magic %#x", m)
	}
	return chunk{
		flags:   binary.BigEndian.Uint16(h[4:]),
		typ:     binary.BigEndian.Uint16(h[6:]),
		handle:  binary.BigEndian.Uint64(h[8:]),
		payload: c.read(int(binary.BigEndian.Uint32(h[16:]))),
	}
}

// chunkErrno decodes an ERROR or ERROR_OFFSET chunk.
func chunkErrno(ch chunk) (errno uint32, msg string, off uint64, err error) {
	if ch.typ&(1<<15) == 0 || len(ch.payload) < 6 {
		return 0, "", 0, fmt.Errorf("not an error chunk: type %#x", ch.typ)
	}
	errno = binary.BigEndian.Uint32(ch.payload)
	n := int(binary.BigEndian.Uint16(ch.payload[4:]))
	msg = string(ch.payload[6 : 6+n])
	if ch.typ == 1<<15+2 {
		off = binary.BigEndian.Uint64(ch.payload[6+n:])
	}
	return errno, msg, off, nil
}
