package nbdtarget

import (
	"bytes"
	"encoding/binary"
	"io"
	"net"
	"testing"
	"time"

	"github.com/nbdmapper/nbdmapper/backing"
	"github.com/nbdmapper/nbdmapper/table"
)

// fakeConn feeds a fixed client byte stream to the server and drops
// everything the server sends.
type fakeConn struct{ r io.Reader }

func (f *fakeConn) Read(p []byte) (int, error)         { return f.r.Read(p) }
func (f *fakeConn) Write(p []byte) (int, error)        { return len(p), nil }
func (f *fakeConn) Close() error                       { return nil }
func (f *fakeConn) LocalAddr() net.Addr                { return &net.UnixAddr{Name: "fuzz", Net: "unix"} }
func (f *fakeConn) RemoteAddr() net.Addr               { return &net.UnixAddr{Name: "fuzz", Net: "unix"} }
func (f *fakeConn) SetDeadline(t time.Time) error      { return nil }
func (f *fakeConn) SetReadDeadline(t time.Time) error  { return nil }
func (f *fakeConn) SetWriteDeadline(t time.Time) error { return nil }

func fuzzServer(t testing.TB) *Server {
	x := newExport(t, "x",
		seg{len: 64 * kb, dev: backing.NewMem("a", 64*kb)},
		seg{len: 64 * kb, kind: table.KindZero},
		seg{len: 64 * kb, kind: table.KindError},
		seg{len: 64 * kb, dev: &failDev{Device: backing.NewMem("f", 64*kb), from: 0, to: 4 * kb}},
		seg{len: 64 * kb, dev: noZeroDev{backing.NewMem("z", 64*kb)}},
	)
	ro := newExport(t, "ro", seg{len: 4 * kb, dev: backing.NewMem("r", 4*kb)})
	ro.ReadOnly = true
	srv := &Server{Exports: []*Export{x, ro}}
	srv.init()
	return srv
}

// clientStream builds a well-formed session: flags, options, GO, requests.
func clientStream(structured bool, reqs ...request) []byte {
	b := binary.BigEndian.AppendUint32(nil, 3)
	opt := func(id uint32, data []byte) {
		b = binary.BigEndian.AppendUint64(b, magicOpt)
		b = binary.BigEndian.AppendUint32(b, id)
		b = binary.BigEndian.AppendUint32(b, uint32(len(data)))
		b = append(b, data...)
	}
	opt(optList, nil)
	opt(optInfo, infoData("x", infoName, infoDescription, infoBlockSize))
	if structured {
		opt(optStructuredReply, nil)
		opt(optListMetaContext, metaData("x"))
		opt(optSetMetaContext, metaData("x", metaBaseAllocation))
	}
	opt(99, []byte("unknown"))
	opt(optGo, infoData(""))
	for _, r := range reqs {
		b = encodeRequest(b, r)
		if r.Type == cmdWrite {
			b = append(b, bytes.Repeat([]byte{0xa5}, int(r.Length))...)
		}
	}
	return b
}

var seedRequests = []request{
	{Type: cmdWrite, Handle: 1, Offset: 512, Length: 1024},
	{Type: cmdRead, Handle: 2, Offset: 0, Length: 4096},
	{Type: cmdRead, Flags: cfDF, Handle: 3, Offset: 128 * kb, Length: 512},
	{Type: cmdBlockStatus, Flags: cfReqOne, Handle: 4, Offset: 0, Length: 320 * kb},
	{Type: cmdWriteZeroes, Flags: cfFastZero | cfNoHole, Handle: 5, Offset: 256 * kb, Length: 4096},
	{Type: cmdTrim, Flags: cfFUA, Handle: 6, Offset: 0, Length: 8192},
	{Type: cmdCache, Handle: 7, Offset: 0, Length: 4096},
	{Type: cmdFlush, Handle: 8},
	{Type: cmdRead, Handle: 9, Offset: 1 << 40, Length: 1 << 31},
	{Type: cmdDisc, Handle: 10},
}

// FuzzHandshake runs a whole session from arbitrary client bytes: it must
// end (the stream is finite) without panicking.
func FuzzHandshake(f *testing.F) {
	f.Add(clientStream(false))
	f.Add(clientStream(true, seedRequests...))
	f.Add([]byte{0, 0, 0, 1, 'I', 'H', 'A', 'V', 'E', 'O', 'P', 'T', 0, 0, 0, 1, 0, 0, 0, 0})
	srv := fuzzServer(f)
	f.Fuzz(func(t *testing.T, data []byte) {
		c := srv.newConn(&fakeConn{r: bytes.NewReader(data)})
		c.serve()
	})
}

// FuzzRequest feeds arbitrary bytes to the transmission phase (the first
// byte picks simple or structured replies and the export) and checks that
// the decoder round-trips every header it accepts.
func FuzzRequest(f *testing.F) {
	var reqs []byte
	for _, r := range seedRequests {
		reqs = encodeRequest(reqs, r)
		if r.Type == cmdWrite {
			reqs = append(reqs, make([]byte, r.Length)...)
		}
	}
	f.Add(append([]byte{0}, reqs...))
	f.Add(append([]byte{3}, reqs...))
	f.Add(append([]byte{1}, encodeRequest(nil, request{Type: cmdWrite, Length: MaxPayload + 1})...))
	srv := fuzzServer(f)
	f.Fuzz(func(t *testing.T, data []byte) {
		if len(data) == 0 {
			return
		}
		mode, stream := data[0], data[1:]
		if len(stream) >= requestSize {
			if r, ok := decodeRequest(stream); ok {
				if back := encodeRequest(nil, r); !bytes.Equal(back, stream[:requestSize]) {
					t.Fatalf("round trip %x != %x", back, stream[:requestSize])
				}
			}
		}
		c := srv.newConn(&fakeConn{r: bytes.NewReader(stream)})
		defer srv.dropConn(c)
		c.structured = mode&1 != 0
		c.meta = mode&2 != 0 && c.structured
		c.x = srv.Exports[int(mode>>2)%len(srv.Exports)]
		c.ro = c.x.ReadOnly
		c.st = &c.x.st
		c.transmit()
	})
}
