package nbdtarget

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/nbdmapper/nbdmapper/backing"
	"github.com/nbdmapper/nbdmapper/internal/testing/nbdtest"
	"github.com/nbdmapper/nbdmapper/mapped"
	"github.com/nbdmapper/nbdmapper/wire"
)

// waitFor polls cond until it holds; the bound only turns a hang into a
// failure, it is not a timing assertion.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("gave up waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func TestHandshakeDeadline(t *testing.T) {
	f := newTFix(t, &Server{HandshakeTimeout: 50 * time.Millisecond})
	idle := dialRaw(t, f.sock)
	idle.read(18) // the greeting, then silence
	idle.nc.SetReadDeadline(time.Now().Add(60 * time.Second))
	if !idle.closed() {
		t.Fatal("an idle client was not closed")
	}
	if n := f.srv.Stats().HandshakeTimeouts; n != 1 {
		t.Fatalf("HandshakeTimeouts = %d, want 1", n)
	}
	// A client that finishes the handshake in time keeps its connection
	// past the deadline.
	c := dialRaw(t, f.sock)
	c.connect("t", false, false)
	time.Sleep(100 * time.Millisecond)
	c.request(wire.CmdRead, 0, 1, 0, 512, nil)
	if h, errno, _ := c.simple(512); h != 1 || errno != 0 {
		t.Fatalf("read after the deadline: handle %d errno %d", h, errno)
	}
}

func TestMaxConnections(t *testing.T) {
	f := newTFix(t, &Server{MaxConnections: 2})
	a, b := dialRaw(t, f.sock), dialRaw(t, f.sock)
	a.connect("t", false, false)
	b.greet(3) // still in the handshake: it counts too
	over := dialRaw(t, f.sock)
	over.nc.SetReadDeadline(time.Now().Add(60 * time.Second))
	if !over.closed() {
		t.Fatal("a third connection was served")
	}
	if n := f.srv.Stats().Refused; n != 1 {
		t.Fatalf("Refused = %d, want 1", n)
	}
	a.nc.Close()
	waitFor(t, "the closed connection to be dropped", func() bool { return f.srv.Stats().Connections == 1 })
	c := dialRaw(t, f.sock)
	c.connect("t", false, false)
	c.request(wire.CmdRead, 0, 7, 0, 512, nil)
	if h, errno, _ := c.simple(512); h != 7 || errno != 0 {
		t.Fatalf("read on a new connection: handle %d errno %d", h, errno)
	}
}

// flakyListener wraps a real listener and fails Accept with the queued
// errors first: the process running out of descriptors cannot be had on cue
// in-process (cmd/nbdmapper's test does it for real with a low ulimit).
type flakyListener struct {
	net.Listener
	mu   sync.Mutex
	errs []error
}

func (l *flakyListener) Accept() (net.Conn, error) {
	l.mu.Lock()
	if len(l.errs) > 0 {
		err := l.errs[0]
		l.errs = l.errs[1:]
		l.mu.Unlock()
		return nil, err
	}
	l.mu.Unlock()
	return l.Listener.Accept()
}

func TestAcceptBacksOffOnTemporaryErrors(t *testing.T) {
	f := newTFix(t, nil)
	sock := filepath.Join(t.TempDir(), "flaky.sock")
	inner, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	var errs []error
	for _, e := range []syscall.Errno{syscall.EMFILE, syscall.ENFILE, syscall.ENOBUFS, syscall.ENOMEM, syscall.ECONNABORTED} {
		errs = append(errs, &net.OpError{Op: "accept", Net: "unix", Err: os.NewSyscallError("accept4", e)})
	}
	l := &flakyListener{Listener: inner, errs: errs}
	served := make(chan error, 1)
	go func() { served <- f.srv.Serve(l) }()
	c := dialRaw(t, sock)
	c.connect("t", false, false)
	c.request(wire.CmdRead, 0, 1, 0, 512, nil)
	if h, errno, _ := c.simple(512); h != 1 || errno != 0 {
		t.Fatalf("read: handle %d errno %d", h, errno)
	}
	if n := f.srv.Stats().AcceptRetries; n != int64(len(errs)) {
		t.Fatalf("AcceptRetries = %d, want %d", n, len(errs))
	}
	// A listener that truly fails ends Serve with its reason.
	l.mu.Lock()
	l.errs = []error{&net.OpError{Op: "accept", Net: "unix", Err: os.NewSyscallError("accept4", syscall.EBADF)}}
	l.mu.Unlock()
	dialRaw(t, sock) // wakes the blocked Accept; the next one fails
	select {
	case err := <-served:
		if !errors.Is(err, syscall.EBADF) {
			t.Fatalf("Serve returned %v, want EBADF", err)
		}
	case <-time.After(60 * time.Second):
		t.Fatal("Serve did not return on a failed listener")
	}
}

// openFDs counts this process's open descriptors.
func openFDs(t *testing.T) int {
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	return len(ents)
}

// TestAbortedClientsLeakNothing opens 10,000 connections and abandons each
// at a random point: before the greeting is read, mid-option, mid-header,
// mid-payload, or with requests in flight. Afterwards the server holds no
// more goroutines or descriptors than before.
func TestAbortedClientsLeakNothing(t *testing.T) {
	n := 10000
	if testing.Short() {
		n = 1000
	}
	f := newTFix(t, nil)
	c := dialRaw(t, f.sock) // one warm connection, so pools exist
	c.connect("t", true, false)
	c.nc.Close()
	waitFor(t, "the warm-up connection to close", func() bool { return f.srv.Stats().Connections == 0 })
	runtime.GC()
	baseG, baseFD := runtime.NumGoroutine(), openFDs(t)

	rng := rand.New(rand.NewPCG(1, 2))
	payload := bytes.Repeat([]byte{0xab}, 8192)
	var wg sync.WaitGroup
	sem := make(chan struct{}, 32)
	for i := range n {
		point := rng.IntN(7)
		sem <- struct{}{}
		wg.Add(1)
		go func() {
			defer func() { <-sem; wg.Done() }()
			nc, err := net.Dial("unix", f.sock)
			if err != nil {
				t.Errorf("dial %d: %v", i, err)
				return
			}
			defer nc.Close()
			abort(nc, point, payload)
		}()
	}
	wg.Wait()
	waitFor(t, "every aborted connection to be dropped", func() bool { return f.srv.Stats().Connections == 0 })
	// Goroutines end just after their connection is dropped.
	waitFor(t, fmt.Sprintf("goroutines back to %d", baseG), func() bool { runtime.GC(); return runtime.NumGoroutine() <= baseG })
	if fds := openFDs(t); fds > baseFD {
		t.Fatalf("open descriptors %d after %d aborted clients, %d before", fds, n, baseFD)
	}
	if st := f.srv.Stats(); st.MemoryInUse != 0 {
		t.Fatalf("MemoryInUse = %d after every connection closed", st.MemoryInUse)
	}
}

// abort drives nc to one of several points of a connection and stops.
func abort(nc net.Conn, point int, payload []byte) {
	nc.SetDeadline(time.Now().Add(60 * time.Second))
	if point == 0 {
		return // before reading the greeting
	}
	var g [18]byte
	if _, err := io.ReadFull(nc, g[:]); err != nil {
		return
	}
	nc.Write(binary.BigEndian.AppendUint32(nil, 3))
	if point == 1 {
		nc.Write([]byte("IHAVEOPT\x00\x00\x00\x07")) // half an option header
		return
	}
	opt := binary.BigEndian.AppendUint64(nil, 0x49484156454F5054)
	opt = binary.BigEndian.AppendUint32(opt, 7)
	data := infoData("t")
	opt = binary.BigEndian.AppendUint32(opt, uint32(len(data)))
	nc.Write(append(opt, data...))
	if point == 2 {
		return // GO sent, replies unread
	}
	for {
		h := make([]byte, 20)
		if _, err := io.ReadFull(nc, h); err != nil {
			return
		}
		body := make([]byte, binary.BigEndian.Uint32(h[16:]))
		if _, err := io.ReadFull(nc, body); err != nil {
			return
		}
		if binary.BigEndian.Uint32(h[12:]) == 1 {
			break
		}
	}
	switch point {
	case 3: // half a request header
		nc.Write(wire.AppendRequest(nil, wire.Request{Type: wire.CmdRead, Length: 512})[:13])
	case 4: // a WRITE header and half its payload
		nc.Write(wire.AppendRequest(nil, wire.Request{Type: wire.CmdWrite, Length: uint32(len(payload))}))
		nc.Write(payload[:len(payload)/2])
	case 5: // reads in flight, replies never read
		for h := range 64 {
			nc.Write(wire.AppendRequest(nil, wire.Request{Type: wire.CmdRead, Handle: uint64(h), Length: 64 * kb}))
		}
	case 6: // a long write, cut off early
		nc.Write(wire.AppendRequest(nil, wire.Request{Type: wire.CmdWrite, Length: MaxPayload + 1}))
		nc.Write(payload)
	}
}

// panicDev panics on every read: a bug in device code.
type panicDev struct{ backing.Device }

func (panicDev) ReadAt(p []byte, off int64) (int, error) { panic("device bug") }

func TestPanicBecomesEIO(t *testing.T) {
	var mu sync.Mutex
	var panics []any
	srv := &Server{OnPanic: func(v any, stack []byte) {
		mu.Lock()
		defer mu.Unlock()
		panics = append(panics, v)
		if len(stack) == 0 {
			t.Error("OnPanic without a stack")
		}
	}}
	good := backing.NewMem("good", 64*kb)
	srv.Exports = []*Export{newExport(t, "p", seg{len: 64 * kb, dev: good}, seg{len: 64 * kb, dev: panicDev{backing.NewMem("bug", 64*kb)}})}
	sock := nbdtest.ServeUnix(t, srv, ErrServerClosed)
	for _, structured := range []bool{false, true} {
		c := dialRaw(t, sock)
		c.connect("p", structured, false)
		c.request(wire.CmdRead, 0, 1, 64*kb, 512, nil)
		r := c.any()
		errno := r.errno
		if !r.simple {
			errno, _, _, _ = chunkErrno(r.ch)
		}
		if r.handle != 1 || errno != wire.EIO {
			t.Fatalf("structured=%v: read over a panicking device: %+v", structured, r)
		}
		c.request(wire.CmdRead, 0, 2, 0, 512, nil)
		if r := c.any(); r.handle != 2 || r.errno != 0 {
			t.Fatalf("structured=%v: the connection did not survive: %+v", structured, r)
		}
	}
	mu.Lock()
	defer mu.Unlock()
	if len(panics) != 2 || panics[0] != "device bug" || srv.Stats().Panics != 2 {
		t.Fatalf("OnPanic saw %v, Stats.Panics %d; want 2 device bugs", panics, srv.Stats().Panics)
	}
}

// TestClientThatStopsReadingIsClosed fills a connection with reads whose
// replies the client never takes: after ReplyTimeout the server closes it,
// and the memory its requests held comes back.
func TestClientThatStopsReadingIsClosed(t *testing.T) {
	f := newTFix(t, &Server{ReplyTimeout: 100 * time.Millisecond})
	c := dialRaw(t, f.sock)
	c.connect("t", false, false)
	if uc, ok := c.nc.(*net.UnixConn); ok {
		uc.SetReadBuffer(4096) // so the replies back up quickly
	}
	for h := range 64 {
		c.request(wire.CmdRead, 0, uint64(h), 0, 64*kb, nil)
	}
	waitFor(t, "the stuck connection to be closed", func() bool {
		st := f.srv.Stats()
		return st.ReplyTimeouts == 1 && st.Connections == 0
	})
	servesNext(t, f)
}

// servesNext checks that every request's memory has come back and that a
// new connection is served.
func servesNext(t *testing.T, f *tfix) {
	t.Helper()
	waitFor(t, "the memory to come back", func() bool { return f.srv.Stats().MemoryInUse == 0 })
	d := dialRaw(t, f.sock)
	d.connect("t", false, false)
	d.request(wire.CmdRead, 0, 1, 0, 512, nil)
	if h, errno, _ := d.simple(512); h != 1 || errno != 0 {
		t.Fatalf("read on a new connection: handle %d errno %d", h, errno)
	}
}

// TestLongWalksReachEveryExtent trims, zeroes and caches a table of 3,000
// one-sector segments alternating between two devices, so that each
// request is walked in several pieces: every device byte the table maps is
// reached exactly once, and in few calls (each piece merges per device).
func TestLongWalksReachEveryExtent(t *testing.T) {
	const segs = 3000
	a := backing.NewRecorder(backing.NewMem("a", segs/2*512))
	b := backing.NewRecorder(backing.NewMem("b", segs/2*512))
	var layout []seg
	for i := range segs {
		dev := backing.Device(a)
		if i%2 == 1 {
			dev = b
		}
		layout = append(layout, seg{len: 512, dev: dev, off: int64(i/2) * 512})
	}
	srv := &Server{Exports: []*Export{newExport(t, "w", layout...)}}
	sock := nbdtest.ServeUnix(t, srv, ErrServerClosed)
	c := dialRaw(t, sock)
	c.connect("w", false, false)
	for _, tc := range []struct {
		typ uint16
		op  backing.Op
	}{{wire.CmdTrim, backing.OpDiscard}, {wire.CmdWriteZeroes, backing.OpZero}} {
		a.Reset()
		b.Reset()
		c.request(tc.typ, 0, 1, 0, segs*512, nil)
		if h, errno, _ := c.simple(0); h != 1 || errno != 0 {
			t.Fatalf("op %d: handle %d errno %d", tc.typ, h, errno)
		}
		for _, r := range []*backing.Recorder{a, b} {
			calls := r.Calls(tc.op)
			var covered int64
			for i, call := range calls {
				if call.Off != covered {
					t.Fatalf("%s %s: call %d at %d, want %d (calls %v)", r.Name(), tc.op, i, call.Off, covered, calls)
				}
				covered += call.Len
			}
			want := int64(segs / 2 * 512)
			if tc.op == backing.OpDiscard {
				// Trims are cut inward to the device's granularity.
				want -= want % r.Limits().Granularity
			}
			if covered != want {
				t.Fatalf("%s %s: %d bytes reached, want %d", r.Name(), tc.op, covered, want)
			}
			if pieces := (segs + mapped.WalkExtents - 1) / mapped.WalkExtents; len(calls) > pieces {
				t.Fatalf("%s %s: %d calls for %d pieces", r.Name(), tc.op, len(calls), pieces)
			}
		}
	}
	c.request(wire.CmdCache, 0, 2, 0, segs*512, nil)
	if h, errno, _ := c.simple(0); h != 2 || errno != 0 {
		t.Fatalf("cache: handle %d errno %d", h, errno)
	}
}

// TestAddRemoveExport changes the export set while serving: a new export
// is served at once; removing one with a client connected is refused,
// unless forced, which lets the request in flight finish and reply and then
// closes the connection.
// TestExportBusyOnceGoAnswered: a client that has GO's ACK is in
// transmission, so the export is busy from that reply on, not from some
// moment after it. Checked straight after the ACK, many times over, since
// the window it closes was a few instructions wide.
func TestExportBusyOnceGoAnswered(t *testing.T) {
	f := newTFix(t, nil)
	extra := newExport(t, "extra", seg{len: 64 * kb, dev: backing.NewMem("e", 64*kb)})
	if err := f.srv.AddExport(extra); err != nil {
		t.Fatal(err)
	}
	for i := range 1000 {
		c := dialRaw(t, f.sock)
		c.connect("extra", false, false)
		if n := extra.st.conns.Load(); n != 1 {
			t.Fatalf("round %d: GO answered, %d connections counted", i, n)
		}
		if _, err := f.srv.RemoveExport("extra", false); !errors.Is(err, ErrExportBusy) {
			t.Fatalf("round %d: removing the export just after GO: %v", i, err)
		}
		c.nc.Close()
		for extra.st.conns.Load() != 0 {
			runtime.Gosched()
		}
	}
}

// TestJoinRemovedExport: an export removed between the handshake's lookup
// and its last reply is not joined, and nothing is counted into it.
func TestJoinRemovedExport(t *testing.T) {
	f := newTFix(t, nil)
	extra := newExport(t, "extra", seg{len: 64 * kb, dev: backing.NewMem("e", 64*kb)})
	if err := f.srv.AddExport(extra); err != nil {
		t.Fatal(err)
	}
	if _, err := f.srv.RemoveExport("extra", false); err != nil {
		t.Fatal(err)
	}
	c := &conn{srv: f.srv}
	if c.join(extra) {
		t.Fatal("joined a removed export")
	}
	if c.st != nil || extra.st.conns.Load() != 0 {
		t.Fatalf("a refused join counted: st %v, %d connections", c.st, extra.st.conns.Load())
	}
}

// A client that has seen its connection end (after NBD_CMD_DISC, as
// `nbdsh` and `nbd-client -d` leave) can remove the export at once: the
// connection counts out of it before its socket closes.
func TestRemoveAfterDisconnect(t *testing.T) {
	f := newTFix(t, nil)
	for i := range 20 {
		x := newExport(t, fmt.Sprintf("x%d", i), seg{len: 64 * kb, dev: backing.NewMem("e", 64*kb)})
		if err := f.srv.AddExport(x); err != nil {
			t.Fatal(err)
		}
		c := dialRaw(t, f.sock)
		c.connect(x.Name, false, false)
		c.request(wire.CmdDisc, 0, 0, 0, 0, nil)
		if !c.closed() {
			t.Fatal("the server sent something after NBD_CMD_DISC")
		}
		if _, err := f.srv.RemoveExport(x.Name, false); err != nil {
			t.Fatalf("round %d: removing the export after its client saw the connection end: %v", i, err)
		}
	}
}

func TestAddRemoveExport(t *testing.T) {
	f := newTFix(t, nil)
	extra := newExport(t, "extra", seg{len: 64 * kb, dev: backing.NewMem("e", 64*kb)})
	if err := f.srv.AddExport(extra); err != nil {
		t.Fatal(err)
	}
	if err := f.srv.AddExport(extra); !errors.Is(err, ErrExportExists) {
		t.Fatalf("adding it twice: %v", err)
	}
	c := dialRaw(t, f.sock)
	c.connect("extra", false, false)
	if _, err := f.srv.RemoveExport("extra", false); !errors.Is(err, ErrExportBusy) {
		t.Fatalf("removing a busy export: %v", err)
	}
	// A request in flight on "t" (held at the gate) is not affected by
	// removing another export; one on "extra" finishes before it goes.
	c.request(wire.CmdWrite, 0, 1, 0, 512, bytes.Repeat([]byte{7}, 512))
	if h, errno, _ := c.simple(0); h != 1 || errno != 0 {
		t.Fatalf("write: handle %d errno %d", h, errno)
	}
	removed := make(chan error, 1)
	go func() { _, err := f.srv.RemoveExport("extra", true); removed <- err }()
	c.nc.SetReadDeadline(time.Now().Add(60 * time.Second))
	if !c.closed() {
		t.Fatal("the forced removal left the connection open")
	}
	select {
	case err := <-removed:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(60 * time.Second):
		t.Fatal("RemoveExport did not return")
	}
	for _, x := range f.srv.ExportList() {
		if x.Name == "extra" {
			t.Fatal("removed export still listed")
		}
	}
	d := dialRaw(t, f.sock)
	d.greet(3)
	d.option(7, infoData("extra"))
	if r := d.reply(); r.typ != 1<<31+6 {
		t.Fatalf("GO for a removed export: reply %#x, want ERR_UNKNOWN", r.typ)
	}
}
