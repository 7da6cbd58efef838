package nbdtarget

import (
	"fmt"
	"net"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nbdmapper/nbdmapper/backing"
	"github.com/nbdmapper/nbdmapper/internal/testing/nbdtest"
	"github.com/nbdmapper/nbdmapper/wire"
)

// countingServer serves on a listener whose connections count the writes
// the server makes to them: one per system call.
type countingServer struct {
	*Server
	writes, reads atomic.Int64
}

func (s *countingServer) Serve(l net.Listener) error {
	return s.Server.Serve(&wrappingListener{l, func(c net.Conn) net.Conn { return countingConn{c, s} }})
}

type countingConn struct {
	net.Conn
	s *countingServer
}

func (c countingConn) Write(p []byte) (int, error) {
	c.s.writes.Add(1)
	return c.Conn.Write(p)
}

func (c countingConn) Read(p []byte) (int, error) {
	c.s.reads.Add(1)
	return c.Conn.Read(p)
}

// Requests that arrive together are answered together: with one worker,
// which runs them one after another, the replies to 32 reads sent in one
// write (a queue depth at which replies are held, holdWindow; all of them
// fitting the 64 KiB write buffer) wait in it until the last read is in
// hand, then go out in one write (and the last reply in another).
func TestRepliesBatched(t *testing.T) {
	srv := &countingServer{Server: &Server{MaxInFlight: 1}}
	f := newTFixOn(t, srv.Server, srv)
	c := dialRaw(t, f.sock)
	c.connect("t", false, false)
	const n = 2 * holdWindow
	if w := sendTogether(t, srv, c, n); w > 2 {
		t.Errorf("%d replies took %d writes, want at most 2", n, w)
	}
}

// sendTogether sends n reads of 512 bytes in one write and takes their
// replies, returning the writes the server made for them.
func sendTogether(t *testing.T, srv *countingServer, c *rawClient, n int) int64 {
	return sendTogetherOf(t, srv, c, wire.CmdRead, n)
}

// sendTogetherOf is sendTogether for reads or for writes of 4 KiB.
func sendTogetherOf(t *testing.T, srv *countingServer, c *rawClient, typ uint16, n int) int64 {
	t.Helper()
	before := srv.writes.Load()
	length, data := 512, 512
	if typ == wire.CmdWrite {
		length, data = 4096, 0
	}
	var reqs []byte
	for h := range uint64(n) {
		reqs = wire.AppendRequest(reqs, wire.Request{Type: typ, Handle: h, Offset: offA, Length: uint32(length)})
		if typ == wire.CmdWrite {
			reqs = append(reqs, make([]byte, length)...)
		}
	}
	c.write(reqs)
	for range n {
		if _, e, _ := c.simple(data); e != 0 {
			t.Fatalf("request type %d: errno %d", typ, e)
		}
	}
	return srv.writes.Load() - before
}

// A client with fewer than holdWindow requests in flight gets every reply
// at once, even for requests it sent together, unless the connections
// outnumber the Ps: then the writes saved are CPU for the others.
func TestRepliesNotHeldForShallowClient(t *testing.T) {
	const n = holdWindow / 2
	for _, typ := range []uint16{wire.CmdRead, wire.CmdWrite} {
		// Writes: the buffered requests are counted by their payloads too.
		t.Run(fmt.Sprintf("alone, type %d", typ), func(t *testing.T) {
			srv := &countingServer{Server: &Server{MaxInFlight: 1}}
			f := newTFixOn(t, srv.Server, srv)
			c := dialRaw(t, f.sock)
			c.connect("t", false, false)
			if w := sendTogetherOf(t, srv, c, typ, n); w != n {
				t.Errorf("%d replies took %d writes, want %d", n, w, n)
			}
		})
	}
	t.Run("crowded", func(t *testing.T) {
		srv := &countingServer{Server: &Server{MaxInFlight: 1}}
		f := newTFixOn(t, srv.Server, srv)
		for range runtime.GOMAXPROCS(0) {
			dialRaw(t, f.sock).connect("t", false, false)
		}
		c := dialRaw(t, f.sock)
		c.connect("t", false, false)
		nbdtest.Until(t, "the server to count the connections", srv.crowded.Load)
		if w := sendTogether(t, srv, c, n); w > 2 {
			t.Errorf("%d replies took %d writes, want at most 2", n, w)
		}
	})
}

// The queue depth estimate is the most requests in hand over the last one
// or two epochs: it rises at once and falls within two epochs.
func TestWindow(t *testing.T) {
	var w window
	for range windowEpoch - 1 {
		w.note(4)
	}
	w.note(32)
	if d := w.depth(); d != 32 {
		t.Fatalf("depth %d after a 32 ended the first epoch, want 32", d)
	}
	for i := range windowEpoch {
		w.note(8)
		if d := w.depth(); d != 32 && i < windowEpoch-1 {
			t.Fatalf("depth %d after %d requests at 8 in the epoch after a 32, want 32", d, i+1)
		}
	}
	if d := w.depth(); d != 8 {
		t.Fatalf("depth %d after a whole epoch at 8, want 8", d)
	}
}

// A reply is held back only while the connection has another request in
// hand, never while that request runs or the server waits for the client.
// With one worker, reads sent together with one that blocks in its device
// (as many as holdWindow, so that replies are held) run first and their
// replies wait for the last to be read: they must go out before it runs. A
// read sent alone, while another blocks, is answered at once.
func TestRepliesNotHeldBehindSlowRequest(t *testing.T) {
	t.Run("sent together", func(t *testing.T) {
		f := newTFix(t, &Server{MaxInFlight: 1})
		open := opener(t, f.gate)
		c := dialRaw(t, f.sock)
		c.connect("t", false, false)
		const gated = holdWindow
		var reqs []byte
		for h := uint64(1); h <= gated; h++ {
			off := uint64(offA)
			if h == gated {
				off = offGate
			}
			reqs = wire.AppendRequest(reqs, wire.Request{Type: wire.CmdRead, Handle: h, Offset: off, Length: 4096})
		}
		c.write(reqs)
		for want := uint64(1); want < gated; want++ {
			if h, e, _ := c.simple(4096); h != want || e != 0 {
				t.Fatalf("reply handle %d errno %d, want %d's while the last read is blocked", h, e, want)
			}
		}
		open()
		if h, e, _ := c.simple(4096); h != gated || e != 0 {
			t.Fatalf("gated read: handle %d errno %d", h, e)
		}
	})
	t.Run("sent alone", func(t *testing.T) {
		f := newTFix(t, nil)
		open := opener(t, f.gate)
		c := dialRaw(t, f.sock)
		c.connect("t", false, false)
		c.request(wire.CmdRead, 0, 1, offGate, 4096, nil)
		nbdtest.Recv(t, f.gate.entered, "the gated read to reach its device")
		c.request(wire.CmdRead, 0, 2, offA, 4096, nil)
		if h, e, _ := c.simple(4096); h != 2 || e != 0 {
			t.Fatalf("reply handle %d errno %d, want the lone read's while the other is blocked", h, e)
		}
		open()
		if h, e, _ := c.simple(4096); h != 1 || e != 0 {
			t.Fatalf("gated read: handle %d errno %d", h, e)
		}
	})
}

// opener returns a func that opens g once; a test that fails before it
// does opens it when it ends, ahead of the Shutdown that waits for the
// gated request.
func opener(t *testing.T, g *gateDev) func() {
	var once sync.Once
	open := func() { once.Do(func() { close(g.release) }) }
	t.Cleanup(open)
	return open
}

// OnActive follows the connections in transmission, in order: a client
// that never gets past the handshake does not count.
func TestOnActive(t *testing.T) {
	var mu sync.Mutex
	var seen []int
	srv := &Server{OnActive: func(n int) { mu.Lock(); seen = append(seen, n); mu.Unlock() }}
	f := newTFix(t, srv)
	got := func(want ...int) {
		t.Helper()
		nbdtest.Until(t, "OnActive calls to be "+fmt.Sprint(want), func() bool {
			mu.Lock()
			defer mu.Unlock()
			return slices.Equal(seen, want)
		})
	}
	a, b := dialRaw(t, f.sock), dialRaw(t, f.sock)
	a.connect("t", false, false)
	got(1)
	bad := dialRaw(t, f.sock)
	bad.greet(3)
	bad.option(1, []byte("no such export")) // EXPORT_NAME: the server hangs up
	if !bad.closed() {
		t.Fatal("EXPORT_NAME of an unknown export left the connection open")
	}
	b.connect("ro", false, false)
	got(1, 2)
	a.nc.Close()
	got(1, 2, 1)
	b.request(wire.CmdDisc, 0, 0, 0, 0, nil)
	got(1, 2, 1, 0)
}

// OnActive may call back into the Server: it runs outside the server's
// lock, which a connection holds while it joins its export.
func TestOnActiveCallsServer(t *testing.T) {
	srv := &Server{}
	calls := make(chan int64, 4)
	srv.OnActive = func(int) {
		// Stats on a goroutine of its own, so that the lock held around
		// OnActive, if it were, fails the test rather than hanging it.
		stats := make(chan int64, 1)
		go func() { stats <- srv.Stats().Connections }()
		select {
		case n := <-stats:
			calls <- n
		case <-time.After(nbdtest.Bound):
			calls <- -1
		}
	}
	f := newTFix(t, srv)
	c := dialRaw(t, f.sock)
	c.connect("t", false, false)
	if n := nbdtest.Recv(t, calls, "OnActive"); n != 1 {
		t.Fatalf("Stats from OnActive: %d connections (-1: it waited %v for the server's lock), want 1", n, nbdtest.Bound)
	}
}

// activeLog serves one 1 MiB export to a raw client on a server whose
// OnActive calls it records; inPoller keeps sockets in the poller.
type activeLog struct {
	mu   sync.Mutex
	seen []int
}

func (l *activeLog) serve(t *testing.T, inPoller bool) (*Server, *rawClient) {
	const mb = 1 << 20
	srv := &Server{
		Exports:  []*Export{newExport(t, "s", seg{len: mb, dev: backing.NewMem("s", mb)})},
		OnActive: func(n int) { l.mu.Lock(); l.seen = append(l.seen, n); l.mu.Unlock() },
		inPoller: inPoller,
	}
	c := dialRaw(t, nbdtest.ServeUnix(t, srv, ErrServerClosed))
	c.connect("s", false, false)
	return srv, c
}

// calls is what OnActive has been called with so far, in order.
func (l *activeLog) calls() []int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Clone(l.seen)
}

// is reports whether OnActive has been called with want, in order.
func (l *activeLog) is(want ...int) bool { return slices.Equal(l.calls(), want) }

// A connection writing in bulk counts twice in OnActive, from its
// bulkScore'th large write in a row, until as many other reads and writes
// have brought its score back down; flushes do not count, and a bulk
// connection that ends is counted out twice.
func TestOnActiveBulk(t *testing.T) {
	const mb = 1 << 20
	var log activeLog
	_, c := log.serve(t, true) // its requests one at a time, and flushes, are serial mode's
	h := uint64(0)
	send := func(typ uint16, n, times int) {
		t.Helper()
		for range times {
			h++
			var payload []byte
			data := 0
			switch typ {
			case wire.CmdWrite:
				payload = make([]byte, n)
			case wire.CmdRead:
				data = n
			}
			c.request(typ, 0, h, 0, uint32(n), payload)
			if got, errno, _ := c.simple(data); got != h || errno != 0 {
				t.Fatalf("request %d: reply %d, errno %d", h, got, errno)
			}
		}
	}
	calls := func(want ...int) {
		t.Helper()
		if got := log.calls(); !slices.Equal(got, want) {
			t.Fatalf("OnActive calls %v, want %v", got, want)
		}
	}
	send(wire.CmdWrite, bulkMin, bulkScore-1)
	send(wire.CmdFlush, 0, 3)
	send(wire.CmdWrite, bulkMin-1, 1) // one short of large
	send(wire.CmdWrite, bulkMin, 1)
	calls(1)
	send(wire.CmdWrite, bulkMin, 1)
	calls(1, 2)
	send(wire.CmdWrite, bulkMin, 4) // the score stays at its top
	send(wire.CmdRead, 4*kb, bulkScore-1)
	calls(1, 2)
	send(wire.CmdWrite, 4*kb, 1)
	calls(1, 2, 1)
	send(wire.CmdWrite, mb, bulkScore)
	calls(1, 2, 1, 2)
	c.request(wire.CmdDisc, 0, 0, 0, 0, nil)
	nbdtest.Until(t, "the connection to be counted out", func() bool { return log.is(1, 2, 1, 2, 1, 0) })
}

// corkedConn holds the client's writes while corked and sends them in one
// write when uncorked, so that many TLS records reach the server together.
type corkedConn struct {
	net.Conn
	mu     sync.Mutex
	corked bool
	held   []byte
}

func (c *corkedConn) Write(p []byte) (int, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.corked {
		c.held = append(c.held, p...)
		return len(p), nil
	}
	return c.Conn.Write(p)
}

func (c *corkedConn) uncork() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.corked = false
	_, err := c.Conn.Write(c.held)
	return err
}

// Over TLS too: crypto/tls decrypts one record per Read and the client
// sends each request as a record of its own, so without tlsRecords the
// reader would see one request at a time and flush every reply alone.
func TestTLSRepliesBatched(t *testing.T) {
	f := newTLSFix(t, TLSRequire)
	srv := &countingServer{Server: &Server{Exports: f.srv.Exports, TLSConfig: f.certs.Config(), TLS: TLSRequire, MaxInFlight: 1}}
	sock := nbdtest.ServeUnix(t, srv, ErrServerClosed)
	c := dialRaw(t, sock)
	cc := &corkedConn{Conn: c.nc}
	c.nc = cc
	c.greet(3)
	c.startTLS(f.goClient(t, "alice"))
	c.connect2("main")
	before := srv.writes.Load()
	const n = 32
	cc.mu.Lock()
	cc.corked = true
	cc.mu.Unlock()
	for h := range uint64(n) {
		c.request(wire.CmdRead, 0, h, 0, 512, nil)
	}
	if err := cc.uncork(); err != nil {
		t.Fatal(err)
	}
	for range n {
		if _, e, _ := c.simple(512); e != 0 {
			t.Fatalf("read: errno %d", e)
		}
	}
	if w := srv.writes.Load() - before; w > n/4 {
		t.Errorf("%d replies took %d writes, want at most %d", n, w, n/4)
	}
}

// Over TLS the records that have come are taken from the socket together:
// crypto/tls asks the socket for little more than the record it decrypts,
// so 32 writes of 4 KiB sent together, a record each, took a read of the
// socket each; through the buffer under it (sealedConn) they take a few.
func TestTLSRecordsReadTogether(t *testing.T) {
	f := newTLSFix(t, TLSRequire)
	srv := &countingServer{Server: &Server{Exports: f.srv.Exports, TLSConfig: f.certs.Config(), TLS: TLSRequire, MaxInFlight: 1}}
	sock := nbdtest.ServeUnix(t, srv, ErrServerClosed)
	c := dialRaw(t, sock)
	cc := &corkedConn{Conn: c.nc}
	c.nc = cc
	c.greet(3)
	c.startTLS(f.goClient(t, "alice"))
	c.connect2("main")
	const n = 32
	cc.mu.Lock()
	cc.corked = true
	cc.mu.Unlock()
	before := srv.reads.Load()
	for h := range uint64(n) {
		c.request(wire.CmdWrite, 0, h, h*4096, 4096, make([]byte, 4096))
	}
	if err := cc.uncork(); err != nil {
		t.Fatal(err)
	}
	for range n {
		if _, e, _ := c.simple(0); e != 0 {
			t.Fatalf("write: errno %d", e)
		}
	}
	// 32 records of a little over 4 KiB: three fills of the 64 KiB
	// buffer, and the reads that find the socket empty after them.
	if r := srv.reads.Load() - before; r > 8 {
		t.Errorf("%d writes of 4 KiB took %d reads of the socket, want at most 8", n, r)
	}
}

// A connection writing in bulk that is the server's only one takes its
// socket out of the poller too (conn.followPoller), and still counts only
// twice in OnActive.
func TestBulkLeavesPoller(t *testing.T) {
	var log activeLog
	srv, c := log.serve(t, false)
	for h := range uint64(bulkScore) {
		c.request(wire.CmdWrite, 0, h, 0, bulkMin, make([]byte, bulkMin))
		if got, errno, _ := c.simple(0); got != h || errno != 0 {
			t.Fatalf("write %d: reply %d, errno %d", h, got, errno)
		}
	}
	// The socket moves at a request that finds no call in progress on it
	// (rawSocket.leave's TryLock), and the reply to the write before may
	// still be leaving: a few more writes give it the chance.
	rs := onlySocket(t, srv)
	for h := uint64(bulkScore); h < 4*bulkScore && !rs.outside(); h++ {
		c.request(wire.CmdWrite, 0, h, 0, bulkMin, make([]byte, bulkMin))
		if got, errno, _ := c.simple(0); got != h || errno != 0 {
			t.Fatalf("write %d: reply %d, errno %d", h, got, errno)
		}
	}
	if !rs.outside() {
		t.Fatal("a lone connection writing in bulk is in the poller")
	}
	c.request(wire.CmdDisc, 0, 0, 0, 0, nil)
	nbdtest.Until(t, "the connection to be counted out", func() bool { return log.is(1, 2, 1, 0) })
}
