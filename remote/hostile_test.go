package remote

import (
	"encoding/binary"
	"errors"
	"io"
	"net"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nbdmapper/nbdmapper/wire"
)

// fakeExport is what the hostile server advertises.
type fakeExport struct {
	size             uint64
	flags            uint16
	blockSize        bool
	min, pref, max   uint32
	structured, meta bool
}

// fakeSess is one transmission-phase connection of the hostile server.
type fakeSess struct {
	nc  net.Conn
	n   int // connection number, from 0
	wmu sync.Mutex
}

func (s *fakeSess) write(b []byte) {
	s.wmu.Lock()
	defer s.wmu.Unlock()
	s.nc.Write(b)
}

// hostileServer listens on a unix socket in t.TempDir() and runs handle for
// each request header it reads (WRITE payloads are left for handle to read
// from s.nc). It returns the nbd+unix URI.
func hostileServer(t *testing.T, x fakeExport, handle func(s *fakeSess, req wire.Request)) string {
	t.Helper()
	sock := filepath.Join(shortDir(t), "h.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	var mu sync.Mutex
	var conns []net.Conn
	t.Cleanup(func() {
		mu.Lock()
		defer mu.Unlock()
		for _, c := range conns {
			c.Close()
		}
	})
	go func() {
		for n := 0; ; n++ {
			nc, err := l.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, nc)
			mu.Unlock()
			go func(n int) {
				defer nc.Close()
				if !fakeHandshake(nc, x) {
					return
				}
				s := &fakeSess{nc: nc, n: n}
				var hdr [wire.RequestSize]byte
				for {
					if _, err := io.ReadFull(nc, hdr[:]); err != nil {
						return
					}
					req, ok := wire.DecodeRequest(hdr[:])
					if !ok || req.Type == wire.CmdDisc {
						return
					}
					handle(s, req)
				}
			}(n)
		}
	}()
	return "nbd+unix:///?socket=" + sock
}

func fakeHandshake(nc net.Conn, x fakeExport) bool {
	g := binary.BigEndian.AppendUint64(nil, wire.MagicNBD)
	g = binary.BigEndian.AppendUint64(g, wire.MagicOpt)
	g = binary.BigEndian.AppendUint16(g, wire.FlagFixedNewstyle|wire.FlagNoZeroes)
	nc.Write(g)
	var cf [4]byte
	if _, err := io.ReadFull(nc, cf[:]); err != nil {
		return false
	}
	rep := func(opt, typ uint32, body []byte) {
		b := binary.BigEndian.AppendUint64(nil, wire.MagicOptReply)
		b = binary.BigEndian.AppendUint32(b, opt)
		b = binary.BigEndian.AppendUint32(b, typ)
		b = binary.BigEndian.AppendUint32(b, uint32(len(body)))
		nc.Write(append(b, body...))
	}
	for {
		var oh [16]byte
		if _, err := io.ReadFull(nc, oh[:]); err != nil {
			return false
		}
		opt := binary.BigEndian.Uint32(oh[8:])
		data := make([]byte, binary.BigEndian.Uint32(oh[12:]))
		if _, err := io.ReadFull(nc, data); err != nil {
			return false
		}
		switch opt {
		case wire.OptStructuredReply:
			if x.structured {
				rep(opt, wire.RepAck, nil)
			} else {
				rep(opt, wire.RepErrUnsup, nil)
			}
		case wire.OptSetMetaContext:
			if x.meta {
				rep(opt, wire.RepMetaContext, append(be32(1), wire.MetaBaseAllocation...))
			}
			rep(opt, wire.RepAck, nil)
		case wire.OptGo:
			info := be16(wire.InfoExport)
			info = append(info, be64(x.size)...)
			info = append(info, be16(x.flags|wire.TfHasFlags)...)
			rep(opt, wire.RepInfo, info)
			if x.blockSize {
				bs := be16(wire.InfoBlockSize)
				bs = append(bs, be32(x.min)...)
				bs = append(bs, be32(x.pref)...)
				bs = append(bs, be32(x.max)...)
				rep(opt, wire.RepInfo, bs)
			}
			rep(opt, wire.RepAck, nil)
			return true
		default:
			rep(opt, wire.RepErrUnsup, nil)
		}
	}
}

const rwFlags = wire.TfSendFlush | wire.TfSendFUA | wire.TfSendTrim | wire.TfSendWriteZeroes | wire.TfSendCache

// A remote that advertises a maximum block size far below proto.md's 1 MiB
// is refused: every request would be cut into a round trip per few bytes.
func TestTinyMaxBlockRefused(t *testing.T) {
	for _, max := range []uint32{1, 512, minMaxBlock - 512} {
		uri := hostileServer(t, fakeExport{size: 1 << 30, flags: rwFlags, blockSize: true, min: 1, pref: 1, max: max},
			func(s *fakeSess, req wire.Request) {})
		u, err := ParseURI(uri)
		if err != nil {
			t.Fatal(err)
		}
		d, err := Open(uri, u, false, testOptions(t))
		if err == nil {
			d.Close()
		}
		if !errors.Is(err, ErrProtocol) {
			t.Errorf("maximum block size %d: Open: %v, want %v", max, err, ErrProtocol)
		}
	}
}

// A request cut into more pieces than run at once fails by one deadline
// when the remote does not answer: the pieces of the first round time out
// together, and none is sent after that, where each round used to wait a
// deadline of its own.
func TestSplitRequestHasOneDeadline(t *testing.T) {
	var sent atomic.Int64
	uri := hostileServer(t, fakeExport{size: 1 << 30, flags: rwFlags, blockSize: true, min: 512, pref: 4096, max: 1 << 20},
		func(s *fakeSess, req wire.Request) {
			if req.Type == wire.CmdWriteZeroes {
				sent.Add(1)
			}
			// a hung remote: it takes requests and never answers
		})
	o := testOptions(t)
	o.Timeout = 300 * time.Millisecond
	d := openURI(t, uri, o)
	defer d.Close()
	const pieces = 8 * parallel // of 1 MiB
	if err := d.Zero(0, pieces<<20, true); !errors.Is(err, ErrTimeout) {
		t.Fatalf("WRITE_ZEROES to a remote that never answers: %v, want %v", err, ErrTimeout)
	}
	if n := sent.Load(); n > parallel+1 {
		t.Fatalf("%d of the request's %d pieces were sent after it had timed out, want at most the %d of a round", n, pieces, parallel+1)
	}
}
