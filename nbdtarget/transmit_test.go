package nbdtarget

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nbdmapper/nbdmapper/backing"
	"github.com/nbdmapper/nbdmapper/internal/testing/nbdtest"
	"github.com/nbdmapper/nbdmapper/table"
	"github.com/nbdmapper/nbdmapper/wire"
)

// Layout of the "t" export, 64 KiB per line:
//
//	virtual  0K        64K      128K     192K          256K           320K       384K
//	         | A @0    | zero   | error  | fail @0     | nozero @0    | gate @0  |
//
// fail's first 4 KiB fail every read and write; nozero has no native
// zeroing; gate blocks reads at its offset 0 until released.
const (
	kb        = 1024
	offA      = 0
	offZero   = 64 * kb
	offError  = 128 * kb
	offFail   = 192 * kb
	offNoZero = 256 * kb
	offGate   = 320 * kb
	sizeT     = 384 * kb
)

type tfix struct {
	srv  *Server
	sock string
	a    *backing.Mem
	gate *gateDev
}

func newTFix(t *testing.T, srv *Server) *tfix {
	if srv == nil {
		srv = &Server{}
	}
	return newTFixOn(t, srv, srv)
}

// newTFixOn is newTFix serving through on, which wraps srv.
func newTFixOn(t *testing.T, srv *Server, on nbdtest.Servable) *tfix {
	f := &tfix{a: backing.NewMem("a", 64*kb)}
	f.gate = &gateDev{Device: backing.NewMem("g", 64*kb), at: 0, entered: make(chan struct{}), release: make(chan struct{})}
	x := newExport(t, "t",
		seg{len: 64 * kb, dev: f.a},
		seg{len: 64 * kb, kind: table.KindZero},
		seg{len: 64 * kb, kind: table.KindError},
		seg{len: 64 * kb, dev: &failDev{Device: backing.NewMem("f", 64*kb), from: 0, to: 4 * kb}},
		seg{len: 64 * kb, dev: noZeroDev{backing.NewMem("z", 64*kb)}},
		seg{len: 64 * kb, dev: f.gate},
	)
	ro := newExport(t, "ro", seg{len: 64 * kb, dev: backing.NewMem("r", 64*kb)})
	ro.ReadOnly = true
	srv.Exports = []*Export{x, ro}
	f.srv = srv
	f.sock = nbdtest.ServeUnix(t, on, ErrServerClosed)
	return f
}

func TestRequestErrors(t *testing.T) {
	const over = MaxPayload + 1
	big := make([]byte, over)
	p512 := bytes.Repeat([]byte{0x5a}, 512)
	tests := []struct {
		name    string
		export  string
		typ     uint16
		flags   uint16
		off     uint64
		length  uint32
		payload []byte
		want    uint32
	}{
		{"unknown command", "t", 42, 0, 0, 512, nil, wire.EINVAL},
		{"unknown flag", "t", wire.CmdRead, 1 << 7, 0, 512, nil, wire.EINVAL},
		{"NO_HOLE on write", "t", wire.CmdWrite, wire.CfNoHole, 0, 512, p512, wire.EINVAL},
		{"DF without structured replies", "t", wire.CmdRead, wire.CfDF, 0, 512, nil, wire.EINVAL},
		{"REQ_ONE on read", "t", wire.CmdRead, wire.CfReqOne, 0, 512, nil, wire.EINVAL},
		{"read past end", "t", wire.CmdRead, 0, sizeT - 256, 512, nil, wire.EINVAL},
		{"read at end", "t", wire.CmdRead, 0, sizeT, 1, nil, wire.EINVAL},
		{"write past end", "t", wire.CmdWrite, 0, sizeT - 256, 512, p512, wire.ENOSPC},
		{"write zeroes past end", "t", wire.CmdWriteZeroes, 0, sizeT, 512, nil, wire.ENOSPC},
		{"trim past end", "t", wire.CmdTrim, 0, sizeT - 512, 1024, nil, wire.EINVAL},
		{"cache past end", "t", wire.CmdCache, 0, sizeT - 512, 1024, nil, wire.EINVAL},
		{"offset wraps around", "t", wire.CmdRead, 0, ^uint64(0) - 10, 512, nil, wire.EINVAL},
		{"long read past the end", "t", wire.CmdRead, 0, 0, over, nil, wire.EINVAL},
		{"long write past the end keeps the stream in sync", "t", wire.CmdWrite, 0, 0, over, big, wire.ENOSPC},
		{"oversized trim is range-checked, not refused", "t", wire.CmdTrim, 0, 0, over, nil, wire.EINVAL},
		{"flush with a length", "t", wire.CmdFlush, 0, 0, 512, nil, wire.EINVAL},
		{"block status without contexts", "t", wire.CmdBlockStatus, 0, 0, 512, nil, wire.EINVAL},
		{"read error target", "t", wire.CmdRead, 0, offError, 512, nil, wire.EIO},
		{"write error target", "t", wire.CmdWrite, 0, offError + 512, 512, p512, wire.EIO},
		{"trim across error target", "t", wire.CmdTrim, 0, offError - 512, 1024, nil, wire.EIO},
		{"read backing I/O error", "t", wire.CmdRead, 0, offFail, 4096, nil, wire.EIO},
		{"write backing I/O error", "t", wire.CmdWrite, wire.CfFUA, offFail + 512, 512, p512, wire.EIO},
		{"fast zero without native zeroing", "t", wire.CmdWriteZeroes, wire.CfFastZero, offNoZero, 4096, nil, wire.ENOTSUP},
		{"slow zero without native zeroing", "t", wire.CmdWriteZeroes, wire.CfNoHole, offNoZero, 4096, nil, 0},
		{"fast zero on a zero target", "t", wire.CmdWriteZeroes, wire.CfFastZero, offZero, 4096, nil, 0},
		{"zero-length read", "t", wire.CmdRead, 0, 100, 0, nil, 0},
		{"zero-length write", "t", wire.CmdWrite, 0, 100, 0, nil, 0},
		{"zero-length trim", "t", wire.CmdTrim, 0, 100, 0, nil, 0},
		{"zero-length write zeroes at the end", "t", wire.CmdWriteZeroes, 0, sizeT, 0, nil, 0},
		{"zero-length cache", "t", wire.CmdCache, 0, 0, 0, nil, 0},
		{"FUA on read is accepted", "t", wire.CmdRead, wire.CfFUA, 0, 512, nil, 0},
		{"cache", "t", wire.CmdCache, 0, 0, offError, nil, 0},
		{"cache over error target", "t", wire.CmdCache, 0, offError, 512, nil, wire.EIO},
		{"write on read-only", "ro", wire.CmdWrite, 0, 0, 512, p512, wire.EPERM},
		{"trim on read-only", "ro", wire.CmdTrim, 0, 0, 512, nil, wire.EPERM},
		{"write zeroes on read-only", "ro", wire.CmdWriteZeroes, wire.CfFastZero, 0, 512, nil, wire.EPERM},
		{"flush on read-only", "ro", wire.CmdFlush, 0, 0, 0, nil, 0},
	}
	f := newTFix(t, nil)
	conns := map[string]*rawClient{"t": dialRaw(t, f.sock), "ro": dialRaw(t, f.sock)}
	for name, c := range conns {
		c.connect(name, false, false)
	}
	for i, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			c := conns[tc.export]
			c.t = t
			h := uint64(1000 + i)
			c.request(tc.typ, tc.flags, h, tc.off, tc.length, tc.payload)
			dataLen := 0
			if tc.typ == wire.CmdRead && tc.want == 0 {
				dataLen = int(tc.length)
			}
			gotH, errno, _ := c.simple(dataLen)
			if gotH != h || errno != tc.want {
				t.Fatalf("reply handle %d errno %d, want %d %d", gotH, errno, h, tc.want)
			}
			// The connection is still usable and in sync.
			c.request(wire.CmdRead, 0, h+1e6, 0, 512, nil)
			if gotH, errno, _ := c.simple(512); gotH != h+1e6 || errno != 0 {
				t.Fatalf("follow-up read: handle %d errno %d", gotH, errno)
			}
		})
	}
}

func TestReadWriteRoundTrip(t *testing.T) {
	f := newTFix(t, nil)
	c := dialRaw(t, f.sock)
	c.connect("", false, false)
	data := bytes.Repeat([]byte("nbdmapper"), 1000)[:8000]
	c.request(wire.CmdWrite, wire.CfFUA, 1, 1000, uint32(len(data)), data)
	if _, e, _ := c.simple(0); e != 0 {
		t.Fatalf("write errno %d", e)
	}
	got := make([]byte, len(data))
	if _, err := f.a.ReadAt(got, 1000); err != nil || !bytes.Equal(got, data) {
		t.Fatalf("backing device does not hold the written data (err %v)", err)
	}
	c.request(wire.CmdRead, 0, 2, 1000, uint32(len(data)), nil)
	if _, e, d := c.simple(len(data)); e != 0 || !bytes.Equal(d, data) {
		t.Fatalf("read back errno %d, equal %v", e, bytes.Equal(d, data))
	}
	// Writes to a zero target are dropped; it still reads as zeros.
	c.request(wire.CmdWrite, 0, 3, offZero, 512, data[:512])
	if _, e, _ := c.simple(0); e != 0 {
		t.Fatalf("write to zero target: errno %d", e)
	}
	c.request(wire.CmdRead, 0, 4, offZero, 512, nil)
	if _, e, d := c.simple(512); e != 0 || !bytes.Equal(d, make([]byte, 512)) {
		t.Fatalf("zero target read errno %d data %x...", e, d[:8])
	}
	// Trim and write zeroes make the range read as zeros.
	// Requests in flight together may run in any order, so each waits for
	// the previous reply.
	for _, cmd := range []uint16{wire.CmdWriteZeroes, wire.CmdTrim} {
		for _, r := range []wire.Request{
			{Type: wire.CmdWrite, Handle: 5, Length: 4096},
			{Type: wire.CmdFlush, Handle: 6},
			{Type: cmd, Handle: 7, Length: 4096},
		} {
			var payload []byte
			if r.Type == wire.CmdWrite {
				payload = bytes.Repeat([]byte{1}, 4096)
			}
			c.request(r.Type, 0, r.Handle, 0, r.Length, payload)
			if _, e, _ := c.simple(0); e != 0 {
				t.Fatalf("cmd %d errno %d", r.Type, e)
			}
		}
		c.request(wire.CmdRead, 0, 8, 0, 4096, nil)
		if _, _, d := c.simple(4096); !bytes.Equal(d, make([]byte, 4096)) {
			t.Errorf("after command %d the range does not read as zeros", cmd)
		}
	}
}

func TestStructuredReplies(t *testing.T) {
	f := newTFix(t, nil)
	c := dialRaw(t, f.sock)
	if flags := c.connect("t", true, true); flags&wire.TfSendDF == 0 {
		t.Fatalf("DF not advertised with structured replies: %#x", flags)
	}
	data := bytes.Repeat([]byte{0xab}, 4096)
	c.request(wire.CmdWrite, 0, 1, 0, 4096, data)
	if r := c.any(); !r.simple || r.errno != 0 || r.handle != 1 {
		t.Fatalf("write reply %+v", r)
	}

	t.Run("read is one OFFSET_DATA chunk", func(t *testing.T) {
		c.t = t
		for _, flags := range []uint16{0, wire.CfDF} {
			c.request(wire.CmdRead, flags, 2, 512, 1024, nil)
			ch := c.chunk()
			if ch.handle != 2 || ch.typ != 1 || ch.flags != 1 || len(ch.payload) != 8+1024 {
				t.Fatalf("chunk %d %d %d len %d", ch.handle, ch.typ, ch.flags, len(ch.payload))
			}
			if off := binary.BigEndian.Uint64(ch.payload); off != 512 || !bytes.Equal(ch.payload[8:], data[:1024]) {
				t.Fatalf("offset %d or data wrong", off)
			}
		}
	})
	t.Run("zero-length read is NONE", func(t *testing.T) {
		c.t = t
		c.request(wire.CmdRead, 0, 3, 0, 0, nil)
		if ch := c.chunk(); ch.typ != 0 || ch.flags != 1 || len(ch.payload) != 0 {
			t.Fatalf("chunk %+v", ch)
		}
	})
	errTests := []struct {
		name   string
		typ    uint16
		off    uint64
		length uint32
		errno  uint32
		atOff  bool
	}{
		{"invalid read is ERROR", wire.CmdRead, sizeT, 512, wire.EINVAL, false},
		{"failed read is ERROR_OFFSET at the failing line", wire.CmdRead, offError - 512, 1024, wire.EIO, true},
		{"failed write is ERROR", wire.CmdWrite, offError, 512, wire.EIO, false},
		{"invalid block status is ERROR", wire.CmdBlockStatus, sizeT, 512, wire.EINVAL, false},
	}
	for _, tc := range errTests {
		t.Run(tc.name, func(t *testing.T) {
			c.t = t
			var payload []byte
			if tc.typ == wire.CmdWrite {
				payload = make([]byte, tc.length)
			}
			c.request(tc.typ, 0, 4, tc.off, tc.length, payload)
			ch := c.chunk()
			errno, msg, off, err := chunkErrno(ch)
			if err != nil || ch.flags != 1 || errno != tc.errno || msg == "" {
				t.Fatalf("chunk type %#x flags %d errno %d msg %q err %v", ch.typ, ch.flags, errno, msg, err)
			}
			// Device errors carry a fixed text per errno, never the
			// error's own (which names paths and devices).
			if tc.errno == wire.EIO && msg != errMessage(wire.EIO) {
				t.Fatalf("EIO message %q, want %q", msg, errMessage(wire.EIO))
			}
			if got := ch.typ == 1<<15+2; got != tc.atOff || (tc.atOff && off != offError) {
				t.Fatalf("chunk type %#x offset %d", ch.typ, off)
			}
		})
	}
	t.Run("block status", func(t *testing.T) {
		c.t = t
		type ext struct{ len, flags uint32 }
		for _, tc := range []struct {
			flags uint16
			off   uint64
			n     uint32
			want  []ext
		}{
			// A's first 4 KiB hold data; the rest of A is a hole and merges
			// with the zero target; the error line is data; fail, nozero
			// and gate are holes.
			{0, 0, sizeT, []ext{{4096, 0}, {124 * kb, 3}, {64 * kb, 0}, {192 * kb, 3}}},
			{wire.CfReqOne, 0, sizeT, []ext{{4096, 0}}},
			{wire.CfReqOne, 8192, sizeT - 8192, []ext{{120 * kb, 3}}},
			{0, offError + 100, 100, []ext{{100, 0}}},
		} {
			c.request(wire.CmdBlockStatus, tc.flags, 5, tc.off, tc.n, nil)
			ch := c.chunk()
			if ch.typ != 5 || ch.flags != 1 || binary.BigEndian.Uint32(ch.payload) != metaBaseID {
				t.Fatalf("chunk %+v", ch)
			}
			var got []ext
			for p := ch.payload[4:]; len(p) >= 8; p = p[8:] {
				got = append(got, ext{binary.BigEndian.Uint32(p), binary.BigEndian.Uint32(p[4:])})
			}
			if len(got) != len(tc.want) {
				t.Fatalf("off %d flags %d: extents %v, want %v", tc.off, tc.flags, got, tc.want)
			}
			for i := range got {
				if got[i] != tc.want[i] {
					t.Fatalf("off %d flags %d: extents %v, want %v", tc.off, tc.flags, got, tc.want)
				}
			}
		}
	})
}

type anyReply struct {
	simple bool
	handle uint64
	errno  uint32
	ch     chunk
}

// any reads one reply that carries no data: a simple reply or a chunk.
func (c *rawClient) any() anyReply {
	c.t.Helper()
	m := c.read(4)
	switch binary.BigEndian.Uint32(m) {
	case 0x67446698:
		h := c.read(12)
		return anyReply{simple: true, errno: binary.BigEndian.Uint32(h), handle: binary.BigEndian.Uint64(h[4:])}
	case 0x668e33ef:
		h := c.read(16)
		ch := chunk{flags: binary.BigEndian.Uint16(h), typ: binary.BigEndian.Uint16(h[2:]), handle: binary.BigEndian.Uint64(h[4:])}
		ch.payload = c.read(int(binary.BigEndian.Uint32(h[12:])))
		return anyReply{handle: ch.handle, ch: ch}
	}
	c.t.Fatalf("bad reply magic %x", m)
	return anyReply{}
}

// TestOutOfOrder holds one read in its backing device and checks that a
// later read is answered first.
func TestOutOfOrder(t *testing.T) {
	f := newTFix(t, nil)
	c := dialRaw(t, f.sock)
	c.connect("t", false, false)
	c.request(wire.CmdRead, 0, 1, offGate, 4096, nil)
	nbdtest.Recv(t, f.gate.entered, "the read to reach the gated device")
	for h := uint64(2); h < 6; h++ {
		c.request(wire.CmdRead, 0, h, offA, 4096, nil)
	}
	for want := uint64(2); want < 6; want++ {
		if h, e, _ := c.simple(4096); e != 0 || h == 1 {
			t.Fatalf("reply for handle %d errno %d before the blocked read was released", h, e)
		}
	}
	close(f.gate.release)
	if h, e, _ := c.simple(4096); h != 1 || e != 0 {
		t.Fatalf("blocked read: handle %d errno %d", h, e)
	}
}

// TestManyInFlight sends more requests than MaxInFlight without reading a
// reply, then collects every reply.
func TestManyInFlight(t *testing.T) {
	f := newTFix(t, &Server{MaxInFlight: 8})
	c := dialRaw(t, f.sock)
	c.connect("t", false, false)
	const n = 100
	for i := range n {
		c.request(wire.CmdWrite, 0, uint64(i), uint64(i*512), 512, bytes.Repeat([]byte{byte(i)}, 512))
	}
	seen := map[uint64]bool{}
	for range n {
		h, e, _ := c.simple(0)
		if e != 0 || seen[h] || h >= n {
			t.Fatalf("reply handle %d errno %d (seen %v)", h, e, seen[h])
		}
		seen[h] = true
	}
	for i := range n {
		b := make([]byte, 512)
		f.a.ReadAt(b, int64(i*512))
		if !bytes.Equal(b, bytes.Repeat([]byte{byte(i)}, 512)) {
			t.Fatalf("block %d holds %x...", i, b[:4])
		}
	}
}

func TestDiscFinishesOutstanding(t *testing.T) {
	f := newTFix(t, nil)
	c := dialRaw(t, f.sock)
	c.connect("t", false, false)
	c.request(wire.CmdRead, 0, 1, offGate, 512, nil)
	nbdtest.Recv(t, f.gate.entered, "the read to reach the gated device")
	c.request(wire.CmdDisc, 0, 2, 0, 0, nil)
	// Release the read only once the server has taken DISC and stopped
	// reading, so a server that closed at DISC would have done so by now.
	nbdtest.Until(t, "the server to stop reading after DISC", func() bool {
		buf := make([]byte, 1<<20)
		return !strings.Contains(string(buf[:runtime.Stack(buf, true)]), "nbdtarget.(*conn).read(")
	})
	close(f.gate.release)
	if h, e, _ := c.simple(512); h != 1 || e != 0 {
		t.Fatalf("outstanding read: handle %d errno %d", h, e)
	}
	if !c.closed() {
		t.Fatal("connection open after DISC")
	}
}

func TestBrokenStreamClosesOnlyItsConnection(t *testing.T) {
	f := newTFix(t, nil)
	good := dialRaw(t, f.sock)
	good.connect("t", false, false)
	for _, garbage := range [][]byte{
		bytes.Repeat([]byte{0xff}, 28), // bad request magic
		wire.AppendRequest(nil, wire.Request{Type: wire.CmdWrite, Length: 4096})[:20], // then hang up mid-header
	} {
		bad := dialRaw(t, f.sock)
		bad.connect("t", false, false)
		bad.write(garbage)
		if len(garbage) == 28 && !bad.closed() {
			t.Fatal("connection with a bad request magic still open")
		}
		bad.nc.Close()
		good.request(wire.CmdRead, 0, 9, 0, 512, nil)
		if h, e, _ := good.simple(512); h != 9 || e != 0 {
			t.Fatalf("other connection: handle %d errno %d", h, e)
		}
	}
}

func TestShutdownFinishesInFlight(t *testing.T) {
	f := newTFix(t, nil)
	c := dialRaw(t, f.sock)
	c.connect("t", false, false)
	idle := dialRaw(t, f.sock)
	idle.greet(3) // stuck in the handshake
	c.request(wire.CmdRead, 0, 1, offGate, 512, nil)
	nbdtest.Recv(t, f.gate.entered, "the read to reach the gated device")
	done := make(chan error, 1)
	go func() { done <- f.srv.Shutdown(context.Background()) }()
	// The connection stuck in its handshake is closed by Shutdown; once it
	// is, Shutdown has stopped every connection, and must still be waiting
	// for the read held in the device.
	if !idle.closed() {
		t.Fatal("connection in its handshake still open during Shutdown")
	}
	select {
	case err := <-done:
		t.Fatalf("Shutdown returned %v with a request in flight", err)
	default:
	}
	close(f.gate.release)
	c.nc.SetReadDeadline(time.Now().Add(nbdtest.Bound))
	if h, e, _ := c.simple(512); h != 1 || e != 0 {
		t.Fatalf("in-flight read: handle %d errno %d", h, e)
	}
	if err := nbdtest.Recv(t, done, "Shutdown to return"); err != nil {
		t.Fatalf("Shutdown: %v", err)
	}
	if !c.closed() {
		t.Fatal("connection open after Shutdown")
	}
}

func TestStatsAndObserve(t *testing.T) {
	var mu sync.Mutex
	type obs struct {
		export, op string
		bytes      int64
		errno      uint32
	}
	var seen []obs
	f := newTFix(t, &Server{Observe: func(export, op string, n int64, errno uint32, d time.Duration) {
		mu.Lock()
		seen = append(seen, obs{export, op, n, errno})
		mu.Unlock()
	}})
	c := dialRaw(t, f.sock)
	c.connect("t", false, false)
	c.request(wire.CmdWrite, 0, 1, 0, 4096, make([]byte, 4096))
	c.simple(0)
	c.request(wire.CmdRead, 0, 2, 0, 4096, nil)
	c.simple(4096)
	c.request(wire.CmdRead, 0, 3, sizeT, 4096, nil)
	c.simple(0)
	c.request(wire.CmdFlush, 0, 4, 0, 0, nil)
	c.simple(0)

	st := f.srv.Stats()
	if len(st.Exports) != 2 || st.Exports[0].Name != "t" {
		t.Fatalf("exports %+v", st.Exports)
	}
	x := st.Exports[0]
	if x.Connections != 1 || x.ConnectionsTotal != 1 || x.InFlight != 0 {
		t.Errorf("connections %d total %d in flight %d", x.Connections, x.ConnectionsTotal, x.InFlight)
	}
	r, w, fl := x.Ops["read"], x.Ops["write"], x.Ops["flush"]
	if r.Requests != 2 || r.Bytes != 4096 || len(r.Errors) != 1 || r.Errors[wire.EINVAL] != 1 {
		t.Errorf("read stats %+v", r)
	}
	if w.Requests != 1 || w.Bytes != 4096 || w.Errors != nil || w.Duration <= 0 {
		t.Errorf("write stats %+v", w)
	}
	if fl.Requests != 1 || len(x.Ops) != 3 {
		t.Errorf("flush stats %+v, ops %v", fl, x.Ops)
	}
	mu.Lock()
	defer mu.Unlock()
	want := []obs{{"t", "write", 4096, 0}, {"t", "read", 4096, 0}, {"t", "read", 0, wire.EINVAL}, {"t", "flush", 0, 0}}
	if len(seen) != len(want) {
		t.Fatalf("observed %v", seen)
	}
	for i := range want {
		if seen[i] != want[i] {
			t.Errorf("observation %d = %v, want %v", i, seen[i], want[i])
		}
	}
}

// TestShutdownContext: a request that never finishes cannot hold Shutdown
// past its context. With the context already ended and a read held inside
// its device, Shutdown closes the connection at once (the client sees EOF
// and no reply while the read is still held), waits for the device call to
// return (it cannot be interrupted) and returns the context's error.
func TestShutdownContext(t *testing.T) {
	f := newTFix(t, nil)
	c := dialRaw(t, f.sock)
	c.connect("t", false, false)
	c.request(wire.CmdRead, 0, 1, offGate, 512, nil)
	nbdtest.Recv(t, f.gate.entered, "the read to reach the gated device")
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	done := make(chan error, 1)
	go func() { done <- f.srv.Shutdown(ctx) }()

	c.nc.SetReadDeadline(time.Now().Add(nbdtest.Bound))
	if n, err := io.Copy(io.Discard, c.nc); err != nil || n != 0 {
		t.Fatalf("connection during Shutdown with an ended context: %d bytes, %v; want EOF and no reply", n, err)
	}
	select {
	case err := <-done:
		t.Fatalf("Shutdown returned %v while a request was still inside its device", err)
	default:
	}
	close(f.gate.release)
	if err := nbdtest.Recv(t, done, "Shutdown to return"); !errors.Is(err, context.Canceled) {
		t.Fatalf("Shutdown = %v, want %v", err, context.Canceled)
	}
}

// lateDeadlineConn holds a connection's first SetDeadline (the handshake's)
// until gate closes, so that a Shutdown can come between the connection
// being taken and its handshake deadline being set.
type lateDeadlineConn struct {
	net.Conn
	gate <-chan struct{}
	once sync.Once
}

func (c *lateDeadlineConn) SetDeadline(t time.Time) error {
	c.once.Do(func() { <-c.gate })
	return c.Conn.SetDeadline(t)
}

// A Shutdown that stops a connection before its handshake deadline is set
// is not undone by that deadline: the connection ends at once instead of
// waiting out HandshakeTimeout for a client that sends nothing.
func TestShutdownBeforeHandshakeDeadline(t *testing.T) {
	gate := make(chan struct{})
	srv := &Server{HandshakeTimeout: time.Hour}
	f := newTFixOn(t, srv, &wrappingServer{srv, func(nc net.Conn) net.Conn { return &lateDeadlineConn{Conn: nc, gate: gate} }})
	dialRaw(t, f.sock) // sends nothing
	waitFor(t, "the connection to be taken", func() bool { return srv.Stats().Connections == 1 })
	shut := make(chan error, 1)
	go func() { shut <- srv.Shutdown(context.Background()) }()
	waitFor(t, "Shutdown to stop the connection", func() bool {
		srv.mu.Lock()
		defer srv.mu.Unlock()
		for c := range srv.conns {
			return c.stopped.Load()
		}
		return false
	})
	close(gate)
	select {
	case err := <-shut:
		if err != nil {
			t.Fatalf("Shutdown: %v", err)
		}
	case <-time.After(nbdtest.Bound):
		t.Fatalf("Shutdown still waiting after %v for a handshake it had stopped", nbdtest.Bound)
	}
}
