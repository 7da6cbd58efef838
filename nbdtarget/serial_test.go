package nbdtarget

import (
	"bytes"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nbdmapper/nbdmapper/backing"
	"github.com/nbdmapper/nbdmapper/internal/testing/nbdtest"
	"github.com/nbdmapper/nbdmapper/wire"
)

// syncGate blocks Sync while armed until released.
type syncGate struct {
	backing.Device
	armed   atomic.Bool
	entered chan struct{}
	release chan struct{}
	once    sync.Once
}

func (g *syncGate) Sync() error {
	if g.armed.Load() {
		g.once.Do(func() { close(g.entered) })
		<-g.release
	}
	return g.Device.Sync()
}

// serialFix serves one export on a syncGate'd device to a raw client.
type serialFix struct {
	t      *testing.T
	srv    *Server
	addr   string     // the server's socket
	conn   *conn      // the server's connection to c
	rs     *rawSocket // the server's end of c
	gate   *syncGate
	c      *rawClient
	h      uint64
	waited uint64 // the server socket's waits at the last send
	open   func() // releases the gate's Syncs

	// pause, when set, stops the server after its next serial reply,
	// before it reads on: it closes paused, then waits for resume.
	pause   atomic.Bool
	paused  chan struct{}
	resume  func()
	resumed chan struct{}
}

// afterSerialReply is the server's Server.afterSerialReply.
func (f *serialFix) afterSerialReply() {
	if f.pause.CompareAndSwap(true, false) {
		close(f.paused)
		<-f.resumed
	}
}

func newSerialFix(t *testing.T) *serialFix {
	g := &syncGate{Device: backing.NewMem("s", 64*kb), entered: make(chan struct{}), release: make(chan struct{})}
	srv := &Server{Exports: []*Export{newExport(t, "t", seg{len: 64 * kb, dev: g})}}
	f := &serialFix{t: t, srv: srv, gate: g, paused: make(chan struct{}), resumed: make(chan struct{})}
	f.open = sync.OnceFunc(func() { close(g.release) })
	f.resume = sync.OnceFunc(func() { close(f.resumed) })
	srv.afterSerialReply = f.afterSerialReply
	// The handshake's reads find the socket empty too. The waits counted
	// once it is over, before the transmission phase reads anything, are
	// the handshake's, and the first send waits for the first of the
	// transmission's.
	transmitting := make(chan struct{})
	var first sync.Once // a test may open other connections after this one
	srv.beforeTransmit = func(c *conn) {
		first.Do(func() {
			f.conn, f.rs = c, c.sock.(*rawSocket)
			f.waited = f.rs.waits.Load()
			close(transmitting)
		})
	}
	sock := nbdtest.ServeUnix(t, srv, ErrServerClosed)
	f.addr = sock
	// Cleanups run last first: these before Shutdown, which waits for a
	// gated flush or a paused server.
	t.Cleanup(f.open)
	t.Cleanup(f.resume)
	f.c = dialRaw(t, sock)
	f.c.connect("t", false, false)
	select {
	case <-transmitting:
	case <-time.After(nbdtest.Bound):
		t.Fatal("the connection did not start its transmission phase")
	}
	return f
}

func (f *serialFix) serialRequests() int64 { return f.srv.Stats().Exports[0].SerialRequests }

// sock is the server's end of the connection.
func (f *serialFix) sock() *rawSocket { return f.rs }

// waits is how often the server's end of the connection found it empty.
func (f *serialFix) waits() uint64 { return f.sock().waits.Load() }

// lingers checks whether the server's reads linger on their thread for the
// next request (serial mode) or wait in the poller at once.
func (f *serialFix) lingers(t *testing.T, want bool) {
	t.Helper()
	got := time.Duration(f.sock().linger.Load())
	if (got != 0) != want || (want && got != lingerTime) {
		t.Fatalf("the server's reads linger for %v; want lingering %v (%v)", got, want, lingerTime)
	}
}

// encode returns a write of 4 KiB or a flush, with the next handle.
func (f *serialFix) encode(typ uint16) []byte {
	f.h++
	if typ == wire.CmdWrite {
		b := wire.AppendRequest(nil, wire.Request{Type: wire.CmdWrite, Handle: f.h, Length: 4096})
		return append(b, bytes.Repeat([]byte{byte(f.h)}, 4096)...)
	}
	return wire.AppendRequest(nil, wire.Request{Type: typ, Handle: f.h})
}

// send sends a request once the server's reader waits for it, as it does
// for a client at queue depth 1, and returns its handle.
func (f *serialFix) send(typ uint16) uint64 {
	f.t.Helper()
	nbdtest.Until(f.t, "the server to wait for the next request", func() bool { return f.waits() > f.waited })
	f.waited = f.waits()
	f.c.write(f.encode(typ))
	return f.h
}

// answered reads one simple reply and checks it is handle's, without error.
func (f *serialFix) answered(t *testing.T, handle uint64) {
	t.Helper()
	if h, e, _ := f.c.simple(0); h != handle || e != 0 {
		t.Fatalf("reply: handle %d errno %d, want handle %d without error", h, e, handle)
	}
}

// roundTrip sends a request and waits for its reply, as a client at queue
// depth 1 does.
func (f *serialFix) roundTrip(t *testing.T, typ uint16) {
	t.Helper()
	f.answered(t, f.send(typ))
}

// threeOneAtATime sends a write, a flush and a write, each once the one
// before is answered, which puts the connection in serial mode from the
// third, and checks that want requests have run serially by then.
func (f *serialFix) threeOneAtATime(t *testing.T, want int64) {
	t.Helper()
	f.roundTrip(t, wire.CmdWrite)
	f.roundTrip(t, wire.CmdFlush)
	f.roundTrip(t, wire.CmdWrite)
	if n := f.serialRequests(); n != want {
		t.Fatalf("%d serial requests after three more one at a time, want %d", n, want)
	}
}

// A client that writes and flushes one request at a time, as fio's
// --fsync=1 does, is served in serial mode from its third request; a
// request it sends while a serial flush blocks is still read and answered
// before the flush ends (the flush hands reading on), and that ends serial
// mode until the client again waits for each reply.
//
// Only the gated flush may hand reading on: a loaded machine can stall any
// request past handOverAfter, which ends serial mode too, so the hand-over
// waits an hour except for that flush.
func TestSerialMode(t *testing.T) {
	f := newSerialFix(t)
	f.srv.serialHandOver.Store(int64(time.Hour))
	f.roundTrip(t, wire.CmdWrite)
	f.roundTrip(t, wire.CmdFlush)
	if n := f.serialRequests(); n != 0 {
		t.Fatalf("%d requests serial after two: want none before the third", n)
	}
	f.lingers(t, false)
	for range 3 {
		f.roundTrip(t, wire.CmdWrite)
		f.roundTrip(t, wire.CmdFlush)
	}
	if n := f.serialRequests(); n != 6 {
		t.Fatalf("%d of the 6 requests from the third on ran serially", n)
	}
	f.lingers(t, true)

	f.roundTrip(t, wire.CmdWrite)
	f.gate.armed.Store(true)
	f.srv.serialHandOver.Store(int64(handOverAfter))
	flush := f.send(wire.CmdFlush)
	nbdtest.Recv(t, f.gate.entered, "the flush to reach its device")
	if n := f.serialRequests(); n != 8 {
		t.Fatalf("the gated flush did not run serially (%d serial requests, want 8)", n)
	}
	f.roundTrip(t, wire.CmdWrite) // answered while the flush is blocked
	f.open()
	f.answered(t, flush)
	if n := f.serialRequests(); n != 8 {
		t.Fatalf("the write sent beside the flush ran serially (%d serial requests, want 8)", n)
	}
	f.lingers(t, false)

	// Back to one at a time: serial again from the third.
	f.srv.serialHandOver.Store(int64(time.Hour))
	f.threeOneAtATime(t, 9)
	f.lingers(t, true)
}

// A client that sends each request once it has the reply before stays in
// serial mode when its request is in the socket before the server's reader
// gets there (the client ran first after the reply), and leaves it when it
// sent the request while the one before ran, or began to send it with the
// one before.
func TestSerialModeLateRead(t *testing.T) {
	serial := func(t *testing.T) *serialFix {
		f := newSerialFix(t)
		f.srv.serialHandOver.Store(int64(time.Hour))
		f.threeOneAtATime(t, 1)
		return f
	}
	t.Run("sent after the reply", func(t *testing.T) {
		f := serial(t)
		// Armed once the write's reply is behind the server, which then
		// waits for the flush.
		nbdtest.Until(t, "the server to wait for the flush", func() bool { return f.waits() > f.waited })
		f.pause.Store(true)
		f.answered(t, f.send(wire.CmdFlush))
		nbdtest.Recv(t, f.paused, "the server to stop after the flush's reply")
		f.waited = f.waits()
		f.c.write(f.encode(wire.CmdWrite)) // in the socket before the reader looks
		f.resume()
		f.answered(t, f.h)
		nbdtest.Until(t, "the server to wait for the next request", func() bool { return f.waits() > f.waited })
		if n := f.waits(); n != f.waited+1 {
			t.Fatalf("the server found the socket empty %d times for the write and the read after it, want once (the read after)", n-f.waited)
		}
		if n := f.serialRequests(); n != 3 {
			t.Fatalf("the write read late did not run serially (%d serial requests, want 3)", n)
		}
		f.lingers(t, true)
		f.roundTrip(t, wire.CmdFlush)
		if n := f.serialRequests(); n != 4 {
			t.Fatalf("%d serial requests after one more flush, want 4", n)
		}
	})
	t.Run("sent while the last ran", func(t *testing.T) {
		f := serial(t)
		f.gate.armed.Store(true)
		flush := f.send(wire.CmdFlush)
		nbdtest.Recv(t, f.gate.entered, "the flush to reach its device")
		f.c.write(f.encode(wire.CmdWrite))
		f.open()
		f.answered(t, flush)
		f.answered(t, f.h)
		if n := f.serialRequests(); n != 2 {
			t.Fatalf("the write sent beside the flush ran serially (%d serial requests, want 2)", n)
		}
		f.lingers(t, false)
	})
	t.Run("sent with part of the next", func(t *testing.T) {
		f := serial(t)
		flush := f.encode(wire.CmdFlush)
		write := f.encode(wire.CmdWrite)
		nbdtest.Until(t, "the server to wait for the flush", func() bool { return f.waits() > f.waited })
		f.c.write(append(flush, write[:wire.RequestSize/2]...))
		f.answered(t, f.h-1)
		f.c.write(write[wire.RequestSize/2:])
		f.answered(t, f.h)
		if n := f.serialRequests(); n != 1 {
			t.Fatalf("a flush sent with half the next header, or that write, ran serially (%d serial requests, want 1)", n)
		}
		f.lingers(t, false)
	})
}

// A serial request's hand-over is its own. Once a serial write has
// handed the read token on, another goroutine reads the requests after it;
// when one of those (a flush, here held in its device) runs serially in
// turn and arms its own hand-over, the write's goroutine, back from its
// reply, must wait for the token. With one hand-over timer for the
// connection, its Stop stopped the flush's timer, took that for its own
// token not having been handed on, and read the stream beside the flush's
// goroutine, which held the token: two readers of one stream (the race
// detector caught it in the crash test, whose snapshot writes are slow).
func TestSerialHandOverIsTheRequests(t *testing.T) {
	f := newSerialFix(t)
	f.srv.serialHandOver.Store(int64(time.Hour))
	f.threeOneAtATime(t, 1)

	// A serial write whose hand-over fires at once; its goroutine stops
	// after the reply, before it looks at its hand-over. (Armed once the
	// server reads on, past the last request's reply.)
	nbdtest.Until(t, "the server to wait for the next request", func() bool { return f.waits() > f.waited })
	f.srv.serialHandOver.Store(1)
	f.pause.Store(true)
	f.answered(t, f.send(wire.CmdWrite))
	nbdtest.Recv(t, f.paused, "the write's goroutine to stop after its reply")
	nbdtest.Until(t, "the write to hand reading on", func() bool { return f.waits() > f.waited })
	f.srv.serialHandOver.Store(int64(time.Hour))

	// Three more one at a time: the third, a flush held in its device,
	// runs serially on the goroutine the token went to.
	f.roundTrip(t, wire.CmdWrite)
	f.roundTrip(t, wire.CmdWrite)
	f.gate.armed.Store(true)
	flush := f.send(wire.CmdFlush)
	nbdtest.Recv(t, f.gate.entered, "the flush to reach its device")
	if n := f.serialRequests(); n != 3 {
		t.Fatalf("%d serial requests, want 3: the first write, the handed-over one, the flush", n)
	}

	// The write's goroutine goes on: it must wait for the token, which
	// the flush holds, rather than read (and find the socket empty). Other
	// goroutines of the pool may be waiting for the token already; while
	// the flush is held, only the write's can join them.
	waits, waiting := f.waits(), f.conn.waiting.Load()
	f.resume()
	nbdtest.Until(t, "the write's goroutine to wait for the token, or to read", func() bool {
		return f.conn.waiting.Load() > waiting || f.waits() > waits
	})
	if f.waits() > waits {
		t.Fatal("the write's goroutine read the stream while the flush held the read token")
	}
	f.open()
	f.answered(t, flush)
	f.roundTrip(t, wire.CmdWrite)
	f.roundTrip(t, wire.CmdFlush)
}

// Serial mode needs both: a client that waits for each reply, and flushes.
func TestSerialModeNeeds(t *testing.T) {
	t.Run("no flushes", func(t *testing.T) {
		f := newSerialFix(t)
		for range 12 {
			f.roundTrip(t, wire.CmdWrite)
		}
		if n := f.serialRequests(); n != 0 {
			t.Fatalf("%d writes without flushes ran serially", n)
		}
		f.lingers(t, false)
	})
	t.Run("pipelined", func(t *testing.T) {
		f := newSerialFix(t)
		for range 6 {
			w, fl := f.encode(wire.CmdWrite), f.encode(wire.CmdFlush)
			f.c.write(append(w, fl...))
			got := map[uint64]bool{}
			for range 2 {
				h, e, _ := f.c.simple(0)
				if e != 0 || h+1 < f.h || h > f.h || got[h] {
					t.Fatalf("reply: handle %d errno %d, want %d and %d once each", h, e, f.h-1, f.h)
				}
				got[h] = true
			}
		}
		if n := f.serialRequests(); n != 0 {
			t.Fatalf("%d requests sent two at a time ran serially", n)
		}
		f.lingers(t, false)
	})
}

// A connection in serial mode that is the server's only one takes its
// socket out of the poller and counts twice in OnActive; its first request
// after another connection has begun to transmit brings the socket back,
// and it leaves again once that one has gone.
func TestSerialModeLeavesPoller(t *testing.T) {
	f := newSerialFix(t)
	f.srv.serialHandOver.Store(int64(time.Hour))
	check := func(out bool, active int) {
		t.Helper()
		f.srv.activeMu.Lock()
		n := f.srv.active
		f.srv.activeMu.Unlock()
		if f.sock().outside() != out || n != active {
			t.Fatalf("out of the poller %v, counted %d; want %v, %d", f.sock().outside(), n, out, active)
		}
	}
	f.roundTrip(t, wire.CmdWrite)
	f.roundTrip(t, wire.CmdFlush)
	check(false, 1)
	f.roundTrip(t, wire.CmdWrite) // the third: serial
	// The socket moves at a request that finds no call in progress on it
	// (rawSocket.leave's TryLock): the reply to the flush before, which ran
	// outside serial mode, may still be leaving. In serial mode the reader
	// replies itself, so the next request finds none.
	extra := 0
	for ; !f.sock().outside() && extra < 2; extra++ {
		f.roundTrip(t, wire.CmdFlush)
	}
	check(true, 2)
	f.roundTrip(t, wire.CmdFlush)
	check(true, 2)

	other := dialRaw(t, f.addr)
	other.connect("t", false, false)
	check(true, 3)
	f.roundTrip(t, wire.CmdWrite)
	check(false, 2)
	if n := f.serialRequests(); n != 3+int64(extra) {
		t.Fatalf("%d serial requests, want %d: the move back ends no serial mode", n, 3+extra)
	}
	f.roundTrip(t, wire.CmdFlush)
	check(false, 2)

	other.request(wire.CmdDisc, 0, 0, 0, 0, nil)
	nbdtest.Until(t, "the other connection to go", func() bool { return f.srv.transmitting.Load() == 1 })
	f.roundTrip(t, wire.CmdWrite)
	check(true, 2)
}
