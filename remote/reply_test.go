package remote

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"testing"

	"github.com/nbdmapper/nbdmapper/backing"
	"github.com/nbdmapper/nbdmapper/wire"
)

// Reply builders, from proto.md's layouts (wire.go's helpers where they
// exist).
func simpleReply(handle uint64, errno uint32, data ...byte) []byte {
	return append(wire.AppendSimpleReply(nil, handle, errno), data...)
}

func chunk(handle uint64, flags, typ uint16, payload ...[]byte) []byte {
	p := bytes.Join(payload, nil)
	return append(wire.AppendChunkHeader(nil, handle, flags, typ, uint32(len(p))), p...)
}

func be64(v uint64) []byte { return binary.BigEndian.AppendUint64(nil, v) }
func be32(v uint32) []byte { return binary.BigEndian.AppendUint32(nil, v) }
func be16(v uint16) []byte { return binary.BigEndian.AppendUint16(nil, v) }

const done = wire.ReplyFlagDone

// replyRig is a set of requests in flight and a reader over a scripted
// reply stream, as one connection sees them.
type replyRig struct {
	calls map[uint64]*call
	bufs  map[uint64][]byte // each READ's buffer with guard bytes after it
	rr    replyReader
}

const guard = 64

func newReplyRig(stream []byte, structured bool) *replyRig {
	r := &replyRig{calls: map[uint64]*call{}, bufs: map[uint64][]byte{}}
	add := func(h uint64, typ uint16, off uint64, n uint32) {
		c := &call{req: wire.Request{Handle: h, Type: typ, Offset: off, Length: n}}
		if typ == wire.CmdRead {
			b := bytes.Repeat([]byte{0xee}, int(n)+guard)
			r.bufs[h] = b
			c.buf = b[:n:n]
		}
		r.calls[h] = c
	}
	add(1, wire.CmdRead, 4096, 8192)
	add(2, wire.CmdBlockStatus, 65536, 65536)
	add(3, wire.CmdWrite, 0, 512)
	add(4, wire.CmdRead, 0, 0)
	add(5, wire.CmdFlush, 0, 0)
	r.rr = replyReader{br: bufio.NewReaderSize(bytes.NewReader(stream), 16), structured: structured, metaID: 7}
	return r
}

// run reads replies until the stream ends or breaks, as the connection's
// reader does, and returns the calls finished and the error that ended it.
func (r *replyRig) run(t testing.TB) (map[uint64]*call, error) {
	finished := map[uint64]*call{}
	for {
		c, last, err := r.rr.next(func(h uint64) *call { return r.calls[h] })
		if err != nil {
			return finished, err
		}
		if last {
			delete(r.calls, c.req.Handle)
			finished[c.req.Handle] = c
		}
		r.check(t, c)
	}
}

// check asserts what no reply may break: nothing written past a READ's
// buffer, holes and coverage inside the request.
func (r *replyRig) check(t testing.TB, c *call) {
	if b := r.bufs[c.req.Handle]; b != nil {
		for _, g := range b[c.req.Length:] {
			if g != 0xee {
				t.Fatalf("reply wrote past the buffer of handle %d", c.req.Handle)
			}
		}
	}
	end := int64(c.req.Offset) + int64(c.req.Length)
	for _, h := range c.holes {
		if h.Off < int64(c.req.Offset) || h.End() > end || h.Len <= 0 {
			t.Fatalf("hole %v outside request %+v", h, c.req)
		}
	}
	if len(c.holes) > maxHoles || len(c.covered) > maxPieces {
		t.Fatalf("%d holes, %d pieces: over the bounds", len(c.holes), len(c.covered))
	}
	for _, p := range c.covered {
		if p.Off < 0 || p.End() > int64(c.req.Length) {
			t.Fatalf("covered %v outside request %+v", p, c.req)
		}
	}
}

func TestReplies(t *testing.T) {
	data := bytes.Repeat([]byte{0xab}, 8192)
	for _, tc := range []struct {
		name       string
		structured bool
		stream     [][]byte
		wantErr    error // the error ending the stream; io.EOF: it just ended
		check      func(t *testing.T, fin map[uint64]*call)
	}{
		{"simple read and write", false, [][]byte{simpleReply(3, 0), simpleReply(1, 0, data...)}, io.EOF,
			func(t *testing.T, fin map[uint64]*call) {
				if fin[3] == nil || fin[1] == nil || !bytes.Equal(fin[1].buf, data) {
					t.Fatal("simple replies not applied")
				}
			}},
		{"simple error", false, [][]byte{simpleReply(1, wire.EIO)}, io.EOF,
			func(t *testing.T, fin map[uint64]*call) {
				if fin[1] == nil || fin[1].errno != wire.EIO {
					t.Fatal("errno not recorded")
				}
			}},
		{"read in two chunks out of order, and a hole", true, [][]byte{
			chunk(1, 0, wire.ChunkOffsetData, be64(4096+6144), data[:2048]),
			chunk(1, 0, wire.ChunkOffsetHole, be64(4096+2048), be32(4096)),
			chunk(1, done, wire.ChunkOffsetData, be64(4096), data[:2048]),
		}, io.EOF, func(t *testing.T, fin map[uint64]*call) {
			c := fin[1]
			want := append(append(append([]byte(nil), data[:2048]...), make([]byte, 4096)...), data[:2048]...)
			if c == nil || c.errno != 0 || !bytes.Equal(c.buf, want) {
				t.Fatal("chunks not assembled")
			}
		}},
		{"structured empty read and write", true, [][]byte{chunk(4, done, wire.ChunkNone), chunk(3, done, wire.ChunkNone)}, io.EOF,
			func(t *testing.T, fin map[uint64]*call) {
				if fin[4] == nil || fin[3] == nil {
					t.Fatal("NONE chunks not final")
				}
			}},
		{"error chunk with message, then done", true, [][]byte{
			chunk(1, 0, wire.ChunkError, be32(wire.ENOSPC), be16(5), []byte("full!")),
			chunk(1, done, wire.ChunkNone),
		}, io.EOF, func(t *testing.T, fin map[uint64]*call) {
			if c := fin[1]; c == nil || c.errno != wire.ENOSPC || c.msg != "full!" {
				t.Fatalf("error chunk: %+v", fin[1])
			}
		}},
		{"error offset chunk", true, [][]byte{chunk(1, done, wire.ChunkErrorOffset, be32(wire.EIO), be16(0), be64(5000))}, io.EOF,
			func(t *testing.T, fin map[uint64]*call) {
				if c := fin[1]; c == nil || c.errno != wire.EIO {
					t.Fatal("error offset chunk")
				}
			}},
		{"unknown error type is an error", true, [][]byte{chunk(3, done, 1<<15+77, be32(wire.EPERM), be16(0), []byte("xyz"))}, io.EOF,
			func(t *testing.T, fin map[uint64]*call) {
				if c := fin[3]; c == nil || c.errno != wire.EPERM {
					t.Fatal("unknown error chunk")
				}
			}},
		{"block status: holes that read as zeros only, clipped", true, [][]byte{
			chunk(2, done, wire.ChunkBlockStatus, be32(7),
				be32(4096), be32(0), // data
				be32(4096), be32(wire.StateHole|wire.StateZero), // hole
				be32(4096), be32(wire.StateHole), // unallocated but not known zero: data to us
				be32(4096), be32(wire.StateZero), // allocated zeros: data
				be32(1<<20), be32(wire.StateHole|wire.StateZero)), // runs past the request: clipped
		}, io.EOF, func(t *testing.T, fin map[uint64]*call) {
			c := fin[2]
			want := []backing.Range{{Off: 65536 + 4096, Len: 4096}, {Off: 65536 + 16384, Len: 65536 - 16384}}
			if c == nil || len(c.holes) != 2 || c.holes[0] != want[0] || c.holes[1] != want[1] || c.covered[0].Len != 65536 {
				t.Fatalf("block status: %+v", c)
			}
		}},
		{"bad magic", true, [][]byte{be32(0x12345678), make([]byte, 16)}, ErrProtocol, nil},
		{"chunk without structured replies", false, [][]byte{chunk(3, done, wire.ChunkNone)}, ErrProtocol, nil},
		{"unknown handle", true, [][]byte{chunk(99, done, wire.ChunkNone)}, ErrProtocol, nil},
		{"data past the request", true, [][]byte{chunk(1, done, wire.ChunkOffsetData, be64(4096+8000), data[:500])}, ErrProtocol, nil},
		{"data before the request", true, [][]byte{chunk(1, done, wire.ChunkOffsetData, be64(0), data[:10])}, ErrProtocol, nil},
		{"offset overflow", true, [][]byte{chunk(1, done, wire.ChunkOffsetHole, be64(^uint64(0)-10), be32(4096))}, ErrProtocol, nil},
		{"overlapping chunks", true, [][]byte{
			chunk(1, 0, wire.ChunkOffsetData, be64(4096), data[:4096]),
			chunk(1, done, wire.ChunkOffsetData, be64(4096+4000), data[:4192]),
		}, ErrProtocol, nil},
		{"read incomplete at done", true, [][]byte{chunk(1, done, wire.ChunkOffsetData, be64(4096), data[:100])}, ErrProtocol, nil},
		{"data chunk for a write", true, [][]byte{chunk(3, done, wire.ChunkOffsetData, be64(0), data[:512])}, ErrProtocol, nil},
		{"none not final", true, [][]byte{chunk(3, 0, wire.ChunkNone)}, ErrProtocol, nil},
		{"block status, wrong context", true, [][]byte{chunk(2, done, wire.ChunkBlockStatus, be32(8), be32(65536), be32(0))}, ErrProtocol, nil},
		{"block status, zero-length extent", true, [][]byte{chunk(2, done, wire.ChunkBlockStatus, be32(7), be32(0), be32(0))}, ErrProtocol, nil},
		{"block status, ragged", true, [][]byte{chunk(2, done, wire.ChunkBlockStatus, be32(7), be32(1), be16(0))}, ErrProtocol, nil},
		{"block status, none at all", true, [][]byte{chunk(2, done, wire.ChunkNone)}, ErrProtocol, nil},
		{"simple success for block status", true, [][]byte{simpleReply(2, 0)}, ErrProtocol, nil},
		{"simple reply with data to a read after structured replies", true, [][]byte{simpleReply(1, 0, data...)}, ErrProtocol, nil},
		{"error message longer than the chunk", true, [][]byte{chunk(3, done, wire.ChunkError, be32(wire.EIO), be16(100), []byte("x"))}, ErrProtocol, nil},
		{"huge chunk length is refused before reading", true, [][]byte{wire.AppendChunkHeader(nil, 3, done, wire.ChunkError, 1<<31)}, ErrProtocol, nil},
		{"truncated", true, [][]byte{chunk(1, done, wire.ChunkOffsetData, be64(4096), data)[:100]}, io.ErrUnexpectedEOF, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := newReplyRig(bytes.Join(tc.stream, nil), tc.structured)
			fin, err := r.run(t)
			if !errors.Is(err, tc.wantErr) {
				t.Fatalf("stream ended with %v, want %v", err, tc.wantErr)
			}
			if tc.check != nil {
				tc.check(t, fin)
			}
		})
	}
}

// FuzzReplies feeds the reply reader arbitrary bytes: whatever a remote
// sends, it must not panic, write outside a request's buffer, or keep
// more than its bounds. The seeds run as a normal test.
func FuzzReplies(f *testing.F) {
	data := bytes.Repeat([]byte{0xab}, 8192)
	for _, s := range [][]byte{
		simpleReply(3, 0),
		simpleReply(1, 0, data...),
		chunk(1, done, wire.ChunkOffsetData, be64(4096), data),
		bytes.Join([][]byte{chunk(1, 0, wire.ChunkOffsetHole, be64(4096), be32(4096)), chunk(1, done, wire.ChunkOffsetData, be64(8192), data[:4096])}, nil),
		chunk(2, done, wire.ChunkBlockStatus, be32(7), be32(4096), be32(3), be32(61440), be32(0)),
		chunk(3, done, wire.ChunkError, be32(wire.EIO), be16(2), []byte("no")),
		chunk(5, done, wire.ChunkErrorOffset, be32(wire.EIO), be16(0), be64(1)),
		chunk(4, done, wire.ChunkNone),
		wire.AppendChunkHeader(nil, 1, 0, wire.ChunkOffsetData, 1<<30),
	} {
		f.Add(true, s)
		f.Add(false, s)
	}
	f.Fuzz(func(t *testing.T, structured bool, stream []byte) {
		r := newReplyRig(stream, structured)
		fin, err := r.run(t)
		if err == nil {
			t.Fatal("the stream ended without an error")
		}
		for _, c := range fin {
			if c.errno == 0 && c.req.Type == wire.CmdRead && c.req.Length > 0 &&
				(len(c.covered) != 1 || c.covered[0].Len != int64(c.req.Length)) {
				t.Fatalf("a read finished without error and without all its data: %+v", c.covered)
			}
		}
	})
}
