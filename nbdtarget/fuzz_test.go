package nbdtarget

import (
	"bytes"
	"encoding/binary"
	"io"
	"net"
	"path/filepath"
	"runtime"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/nbdmapper/nbdmapper/wire"
)

// fakeConn feeds a fixed client byte stream to the server and records
// everything the server sends.
type fakeConn struct {
	r io.Reader

	mu  sync.Mutex
	out bytes.Buffer
}

func (f *fakeConn) Read(p []byte) (int, error) { return f.r.Read(p) }
func (f *fakeConn) Write(p []byte) (int, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.out.Write(p)
}
func (f *fakeConn) Close() error                       { return nil }
func (f *fakeConn) LocalAddr() net.Addr                { return &net.UnixAddr{Name: "fuzz", Net: "unix"} }
func (f *fakeConn) RemoteAddr() net.Addr               { return &net.UnixAddr{Name: "fuzz", Net: "unix"} }
func (f *fakeConn) SetDeadline(t time.Time) error      { return nil }
func (f *fakeConn) SetReadDeadline(t time.Time) error  { return nil }
func (f *fakeConn) SetWriteDeadline(t time.Time) error { return nil }

func (f *fakeConn) output() []byte {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.out.Bytes())
}

// clientStream builds a well-formed session: flags, options, GO, requests.
func clientStream(structured bool, reqs ...wire.Request) []byte {
	b := binary.BigEndian.AppendUint32(nil, 3)
	opt := func(id uint32, data []byte) {
		b = binary.BigEndian.AppendUint64(b, wire.MagicOpt)
		b = binary.BigEndian.AppendUint32(b, id)
		b = binary.BigEndian.AppendUint32(b, uint32(len(data)))
		b = append(b, data...)
	}
	opt(wire.OptList, nil)
	opt(wire.OptInfo, infoData("x", wire.InfoName, wire.InfoDescription, wire.InfoBlockSize))
	if structured {
		opt(wire.OptStructuredReply, nil)
		opt(wire.OptListMetaContext, metaData("x"))
		opt(wire.OptSetMetaContext, metaData("x", wire.MetaBaseAllocation))
	}
	opt(99, []byte("unknown"))
	opt(wire.OptGo, infoData(""))
	return append(b, requestStream(reqs...)...)
}

// requestStream encodes requests, each WRITE followed by its payload.
func requestStream(reqs ...wire.Request) []byte {
	var b []byte
	for i, r := range reqs {
		b = wire.AppendRequest(b, r)
		if r.Type == wire.CmdWrite {
			b = append(b, bytes.Repeat([]byte{0xa5 ^ byte(i)}, int(r.Length))...)
		}
	}
	return b
}

// seedRequests touch every segment kind, every command and flag, and the
// edges: zero lengths, the last byte, one past the end, 2^64-1, a payload
// past the end, lengths past MaxPayload with and without their payload.
var seedRequests = []wire.Request{
	{Type: wire.CmdWrite, Handle: 1, Offset: 512, Length: 1024},
	{Type: wire.CmdRead, Handle: 2, Offset: 0, Length: 4096},
	{Type: wire.CmdRead, Flags: wire.CfDF, Handle: 3, Offset: 16 * kb, Length: 8 * kb},
	{Type: wire.CmdBlockStatus, Flags: wire.CfReqOne, Handle: 4, Offset: 0, Length: fuzzSize},
	{Type: wire.CmdWriteZeroes, Flags: wire.CfFastZero | wire.CfNoHole, Handle: 5, Offset: 32 * kb, Length: 4096},
	{Type: wire.CmdTrim, Flags: wire.CfFUA, Handle: 6, Offset: 0, Length: 8192},
	{Type: wire.CmdCache, Handle: 7, Offset: 0, Length: 4096},
	{Type: wire.CmdFlush, Handle: 8},
	{Type: wire.CmdWrite, Flags: wire.CfFUA, Handle: 9, Offset: 40*kb - 100, Length: 200},
	{Type: wire.CmdWrite, Flags: wire.CfFUA, Handle: 10, Offset: 72*kb + 10, Length: 100},
	{Type: wire.CmdRead, Handle: 11, Offset: 24*kb - 10, Length: 20},
	{Type: wire.CmdWrite, Handle: 12, Offset: 80*kb + 4000, Length: 200},
	{Type: wire.CmdRead, Handle: 13, Offset: 0, Length: fuzzSize},
	{Type: wire.CmdBlockStatus, Handle: 14, Offset: 0, Length: fuzzSize},
	{Type: wire.CmdWriteZeroes, Handle: 15, Offset: 0, Length: fuzzSize},
	{Type: wire.CmdTrim, Handle: 16, Offset: 0, Length: fuzzSize},
	{Type: wire.CmdRead, Handle: 17, Offset: fuzzSize - 1, Length: 1},
	{Type: wire.CmdRead, Handle: 18, Offset: fuzzSize, Length: 0},
	{Type: wire.CmdRead, Handle: 19, Offset: fuzzSize, Length: 1},
	{Type: wire.CmdRead, Handle: 20, Offset: 1<<64 - 1, Length: 1 << 31},
	{Type: wire.CmdWrite, Handle: 21, Offset: fuzzSize - 512, Length: 513},
	{Type: wire.CmdCache, Handle: 22, Offset: 0, Length: 1<<32 - 1},
	{Type: wire.CmdBlockStatus, Handle: 23, Offset: 0, Length: 0},
	{Type: wire.CmdRead, Handle: 24, Offset: 0, Length: MaxPayload + 1},
	{Type: wire.CmdFlush, Handle: 25, Offset: 1, Length: 1},
	{Type: 42, Handle: 26},
	{Type: wire.CmdRead, Flags: 1 << 7, Handle: 27},
	{Type: wire.CmdRead, Handle: 28, Offset: 16 * kb, Length: 4 * kb},
	{Type: wire.CmdRead, Flags: wire.CfDF, Handle: 29, Offset: 40 * kb, Length: 56 * kb},
	{Type: wire.CmdDisc, Handle: 30},
}

// holeRequests punch holes in every kind of segment and read them back,
// before and after writing into them: a's pages, the file, the striped
// pair (a zeroing that may punch), and the Faulty device.
var holeRequests = []wire.Request{
	{Type: wire.CmdTrim, Handle: 1, Offset: 0, Length: 16 * kb},
	{Type: wire.CmdRead, Handle: 2, Offset: 0, Length: 20 * kb},
	{Type: wire.CmdTrim, Handle: 3, Offset: 56 * kb, Length: 16 * kb},
	{Type: wire.CmdRead, Handle: 4, Offset: 56 * kb, Length: 16 * kb},
	{Type: wire.CmdWrite, Handle: 5, Offset: 60*kb + 100, Length: 200},
	{Type: wire.CmdRead, Handle: 6, Offset: 56 * kb, Length: 16 * kb},
	{Type: wire.CmdWriteZeroes, Handle: 7, Offset: 40 * kb, Length: 16 * kb},
	{Type: wire.CmdRead, Handle: 8, Offset: 36 * kb, Length: 24 * kb},
	{Type: wire.CmdTrim, Handle: 9, Offset: 72 * kb, Length: 8 * kb},
	{Type: wire.CmdRead, Handle: 10, Offset: 72 * kb, Length: 8 * kb},
	{Type: wire.CmdFlush, Handle: 11},
	{Type: wire.CmdRead, Handle: 12, Offset: 72 * kb, Length: 8 * kb},
	{Type: wire.CmdWrite, Handle: 13, Offset: 4 * kb, Length: 4 * kb},
	{Type: wire.CmdRead, Flags: wire.CfDF, Handle: 14, Offset: 0, Length: 20 * kb},
	{Type: wire.CmdRead, Handle: 15, Offset: 0, Length: 20 * kb},
	{Type: wire.CmdBlockStatus, Handle: 16, Offset: 0, Length: fuzzSize},
}

// TestFuzzSeedsSendHoles: the fuzzers' hole seed gets hole chunks from
// every mode with structured replies, and the checker accepts them
// against the model (exact with one request in flight).
func TestFuzzSeedsSendHoles(t *testing.T) {
	file := filepath.Join(t.TempDir(), "file.img")
	for _, tc := range []struct {
		mode fuzzMode
		min  int64
	}{
		// In order: 1 + 1 + 2 + 1 + 2 for the reads of a, the file before
		// and after the write, the striped pair and a again; c's trim is
		// cached by the Faulty device until the flush, and the map, which
		// asked before, calls it data after (stale "data" costs a read).
		{fuzzMode{structured: true, meta: true, serial: true}, 7},
		{fuzzMode{structured: true, batch: true}, 1},
	} {
		before := fuzzHoleChunks.Load()
		tc.mode.file = file
		fuzzSession(t, requestStream(holeRequests...), tc.mode)
		if n := fuzzHoleChunks.Load() - before; n < tc.min {
			t.Errorf("mode %+v: %d hole chunks, want at least %d", tc.mode, n, tc.min)
		} else {
			t.Logf("mode %+v: %d hole chunks", tc.mode, n)
		}
	}
}

// fuzzBound bounds one input's session. The fuzzing engine counts an
// input that runs much longer as a hang without saying where; this reports
// every goroutine instead.
const fuzzBound = 5 * time.Second

// fuzzMode is how one fuzz input is served.
type fuzzMode struct {
	serial    bool   // one request in flight: replies in order, exact model
	batch     bool   // the discard engine gathers trims in a window
	handshake bool   // the input starts with the handshake
	file      string // the file behind the file segment
	// Without a handshake: the session to start transmission in.
	readOnly, structured, meta bool
}

// fuzzSession runs one connection over a fresh rig and checks every byte
// the server sent, then the export's contents.
func fuzzSession(t testing.TB, in []byte, mode fuzzMode) {
	rig := newFuzzRig(t, mode.file, mode.serial, mode.batch)
	defer rig.close()
	in = slices.Clone(in)
	var reqs []wireReq
	s := session{x: rig.x, structured: mode.structured}
	if mode.readOnly {
		s.x = rig.ro
	}
	if mode.meta && mode.structured {
		s.meta, s.metaID = metaYes, metaBaseID
	}
	if mode.handshake {
		hs := &hsWalker{t: t, exports: rig.srv.Exports, in: in}
		if x := hs.walk(); x != nil {
			reqs = splitRequests(in[hs.ip:])
		}
	} else {
		reqs = splitRequests(in)
	}

	fc := &fakeConn{r: bytes.NewReader(in)}
	c := rig.srv.newConn(fc)
	served := make(chan struct{})
	go func() {
		defer close(served)
		if mode.handshake {
			c.serve()
			return
		}
		c.structured, c.meta = s.structured, s.meta == metaYes
		rig.srv.mu.Lock()
		c.x, c.st, c.xmem = s.x, &s.x.st, rig.srv.budget(s.x)
		rig.srv.mu.Unlock()
		c.ro = c.x.ReadOnly
		c.transmit()
		rig.srv.dropConn(c)
	}()
	select {
	case <-served:
	case <-time.After(fuzzBound):
		buf := make([]byte, 1<<20)
		t.Fatalf("the session did not end in %v:\n%s", fuzzBound, buf[:runtime.Stack(buf, true)])
	}
	rig.checkPanics(t)
	out := fc.output()
	if mode.handshake {
		hs := &hsWalker{t: t, exports: rig.srv.Exports, in: in, out: out, check: true}
		x := hs.walk()
		if x == nil {
			return
		}
		s = session{x: x, structured: hs.structured, meta: hs.meta, metaID: hs.metaID}
		out = out[hs.op:]
	}
	m := newModel(s.x)
	ok := checkTransmission(t, &s, m, mode.serial, reqs, out)
	checkContents(t, s.x, m, ok)
}

// FuzzHandshake runs whole sessions from arbitrary client bytes and checks
// every option reply against proto.md and, once a GO or EXPORT_NAME
// succeeds, every transmission reply against the model. The length of the
// input picks one request in flight (exact model) or many.
func FuzzHandshake(f *testing.F) {
	f.Add(clientStream(false))
	f.Add(clientStream(true, seedRequests...))
	f.Add(clientStream(true, holeRequests...))
	f.Add(clientStream(false, seedRequests...))
	f.Add(append(clientStream(true), 0))
	f.Add([]byte{0, 0, 0, 1, 'I', 'H', 'A', 'V', 'E', 'O', 'P', 'T', 0, 0, 0, 1, 0, 0, 0, 0})
	f.Add([]byte{0, 0, 0, 3, 'I', 'H', 'A', 'V', 'E', 'O', 'P', 'T', 0, 0, 0, 1, 0, 0, 0, 2, 'r', 'o'})
	f.Add([]byte{0, 0, 0, 1, 'I', 'H', 'A', 'V', 'E', 'O', 'P', 'T', 0, 0, 0, 2, 0, 0, 0, 0})
	f.Add([]byte{0, 0, 0, 3, 'I', 'H', 'A', 'V', 'E', 'O', 'P', 'T', 0, 0, 0, 7, 0, 1, 0, 0})
	file := filepath.Join(f.TempDir(), "file.img")
	f.Fuzz(func(t *testing.T, data []byte) {
		fuzzSession(t, data, fuzzMode{serial: len(data)%2 == 0, batch: len(data)%3 == 0, handshake: true, file: file})
	})
}

// FuzzRequest feeds arbitrary bytes to the transmission phase and checks
// every reply against the model. The first byte picks the mode: bit 0
// structured replies, bit 1 base:allocation, bit 2 the read-only export,
// bit 3 many requests in flight (else one, and an exact model), bit 4
// batched trims.
func FuzzRequest(f *testing.F) {
	reqs := requestStream(seedRequests...)
	for _, mode := range []byte{0, 3, 7, 8, 11, 27} {
		f.Add(append([]byte{mode}, reqs...))
	}
	f.Add(append([]byte{1}, wire.AppendRequest(nil, wire.Request{Type: wire.CmdWrite, Length: MaxPayload + 1})...))
	for _, mode := range []byte{3, 9, 27} {
		f.Add(append([]byte{mode}, requestStream(holeRequests...)...))
	}
	f.Add(append([]byte{3}, requestStream(
		wire.Request{Type: wire.CmdWrite, Handle: 1, Offset: 16*kb - 300, Length: 600},
		wire.Request{Type: wire.CmdRead, Handle: 1, Offset: 0, Length: 20 * kb},
		wire.Request{Type: wire.CmdWrite, Handle: 2, Offset: 56*kb - 700, Length: 1400},
		wire.Request{Type: wire.CmdBlockStatus, Handle: 2, Offset: 0, Length: fuzzSize},
	)...))
	file := filepath.Join(f.TempDir(), "file.img")
	f.Fuzz(func(t *testing.T, data []byte) {
		if len(data) == 0 {
			return
		}
		mode, stream := data[0], data[1:]
		if len(stream) >= wire.RequestSize {
			if r, ok := wire.DecodeRequest(stream); ok {
				if back := wire.AppendRequest(nil, r); !bytes.Equal(back, stream[:wire.RequestSize]) {
					t.Fatalf("round trip %x != %x", back, stream[:wire.RequestSize])
				}
			}
		}
		fuzzSession(t, stream, fuzzMode{
			structured: mode&1 != 0,
			meta:       mode&2 != 0,
			readOnly:   mode&4 != 0,
			serial:     mode&8 == 0,
			batch:      mode&16 != 0,
			file:       file,
		})
	})
}
