package nbdtest

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
)

// Client is a minimal NBD client for tests that need to act on each reply
// the moment it arrives, which libnbd's tools cannot tell a Go test: fixed
// newstyle with NO_ZEROES, NBD_OPT_EXPORT_NAME, and one request at a time
// with simple replies. Use one Client per goroutine; open several for
// concurrency. Byte layouts are from the NBD protocol's doc/proto.md.
type Client struct {
	c      net.Conn
	br     *bufio.Reader
	size   uint64
	cookie uint64
}

// NBD protocol constants the client uses.
const (
	nbdMagic      = 0x4e42444d41474943
	optMagic      = 0x49484156454F5054
	optExportName = 1
	requestMagic  = 0x25609513
	replyMagic    = 0x67446698
	cmdRead       = 0
	cmdWrite      = 1
	cmdFlush      = 3
	flagFUA       = 1 << 0
)

// ErrnoError is an error reply from the server.
type ErrnoError uint32

func (e ErrnoError) Error() string { return fmt.Sprintf("NBD error %d", uint32(e)) }

// Dial connects to export on a unix socket.
func Dial(socket, export string) (*Client, error) {
	c, err := net.Dial("unix", socket)
	if err != nil {
		return nil, err
	}
	nc := &Client{c: c, br: bufio.NewReader(c)}
	if err := nc.handshake(export); err != nil {
		c.Close()
		return nil, fmt.Errorf("handshake: %w", err)
	}
	return nc, nil
}

func (nc *Client) handshake(export string) error {
	var g struct {
		Magic, Opt uint64
		Flags      uint16
	}
	if err := binary.Read(nc.br, binary.BigEndian, &g); err != nil {
		return err
	}
	if g.Magic != nbdMagic || g.Opt != optMagic {
		return errors.New("bad greeting")
	}
	// client flags FIXED_NEWSTYLE|NO_ZEROES, then EXPORT_NAME
	b := binary.BigEndian.AppendUint32(nil, 3)
	b = binary.BigEndian.AppendUint64(b, optMagic)
	b = binary.BigEndian.AppendUint32(b, optExportName)
	b = binary.BigEndian.AppendUint32(b, uint32(len(export)))
	b = append(b, export...)
	if _, err := nc.c.Write(b); err != nil {
		return err
	}
	var info struct {
		Size  uint64
		Flags uint16
	}
	if err := binary.Read(nc.br, binary.BigEndian, &info); err != nil {
		return err
	}
	nc.size = info.Size
	return nil
}

// Size is the export size the server announced.
func (nc *Client) Size() int64 { return int64(nc.size) }

// do sends one request and waits for its reply, reading n bytes of data.
//
//	request: u32 magic, u16 flags, u16 type, u64 cookie, u64 offset, u32 length, data
//	reply:   u32 magic, u32 error, u64 cookie, data (reads without error)
func (nc *Client) do(cmd, flags uint16, off uint64, length uint32, data []byte) ([]byte, error) {
	nc.cookie++
	b := make([]byte, 28, 28+len(data))
	binary.BigEndian.PutUint32(b[0:], requestMagic)
	binary.BigEndian.PutUint16(b[4:], flags)
	binary.BigEndian.PutUint16(b[6:], cmd)
	binary.BigEndian.PutUint64(b[8:], nc.cookie)
	binary.BigEndian.PutUint64(b[16:], off)
	binary.BigEndian.PutUint32(b[24:], length)
	b = append(b, data...)
	if _, err := nc.c.Write(b); err != nil {
		return nil, err
	}
	var r [16]byte
	if _, err := io.ReadFull(nc.br, r[:]); err != nil {
		return nil, err
	}
	if binary.BigEndian.Uint32(r[0:]) != replyMagic || binary.BigEndian.Uint64(r[8:]) != nc.cookie {
		return nil, errors.New("bad reply")
	}
	if errno := binary.BigEndian.Uint32(r[4:]); errno != 0 {
		return nil, ErrnoError(errno)
	}
	if cmd != cmdRead {
		return nil, nil
	}
	p := make([]byte, length)
	_, err := io.ReadFull(nc.br, p)
	return p, err
}

// Write writes p at off, with the FUA flag if fua.
func (nc *Client) Write(p []byte, off int64, fua bool) error {
	var flags uint16
	if fua {
		flags = flagFUA
	}
	_, err := nc.do(cmdWrite, flags, uint64(off), uint32(len(p)), p)
	return err
}

// Flush sends NBD_CMD_FLUSH and waits for its reply.
func (nc *Client) Flush() error {
	_, err := nc.do(cmdFlush, 0, 0, 0, nil)
	return err
}

// Read reads n bytes at off.
func (nc *Client) Read(off int64, n int) ([]byte, error) {
	return nc.do(cmdRead, 0, uint64(off), uint32(n), nil)
}

// Close closes the connection without NBD_CMD_DISC.
func (nc *Client) Close() error { return nc.c.Close() }
