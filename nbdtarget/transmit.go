package nbdtarget

import (
	"bufio"
	"context"
	"crypto/tls"
	"errors"
	"io"
	"log/slog"
	"net"
	"os"
	"runtime/debug"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sync/semaphore"

	"github.com/nbdmapper/nbdmapper/backing"
	"github.com/nbdmapper/nbdmapper/flush"
	"github.com/nbdmapper/nbdmapper/mapped"
	"github.com/nbdmapper/nbdmapper/wire"
)

// conn is one client connection. Its transmission phase runs on a
// leader/follower pool of goroutines, as nbdkit runs its threads: whoever
// holds the read token decodes the next request (and a WRITE's payload),
// makes sure another goroutine will read the request after it, hands the
// token on, and then runs its own request and writes the reply under wmu.
// Replies leave in completion order, and a request is never handed from the
// goroutine that read it to another one, which would put a cross-thread
// wake-up on every request's path:
//
//	g1: read 1 | run read 1 ............ reply 1
//	g2:          read 2 | run write 2 reply 2       (reply 2 may precede reply 1)
//	g3:                   read 3 | run flush 3 ..... reply 3
//	g2:                                    read 4 | ...
//
// A client that waits for each reply before it sends the next request and
// flushes (queue depth 1: fio's --fsync=1, a database's write and fsync)
// gains nothing from a goroutine reading ahead: nothing arrives while its
// request runs. It costs, though: the goroutine woken to read becomes
// runnable just as the request enters its blocking device call (fdatasync),
// so the scheduler hands the call's P to another thread to run a read that
// finds nothing. Such a connection is served in serial mode (see serial):
// the reader keeps the token through its own request and reads the next
// one itself, lingering for it on its thread (rawSocket). A request that
// runs longer than handOverAfter hands the token on (handTokenOn), so one
// sent meanwhile waits at most that long to be read, and a request that
// had come before the last reply left ends serial mode.
//
// At most MaxInFlight goroutines exist per connection. Every request is
// charged its memory (cost) before it is read any further, against the
// connection's MaxInFlightBytes and the server's Memory; the reader stops
// taking requests while either is spent, which bounds memory per connection
// and per server whatever the clients send.
type conn struct {
	srv  *Server
	nc   net.Conn
	sock net.Conn // reads and writes nc, for br, bw and TLS (rawSocket)
	br   *bufio.Reader
	bw   *bufio.Writer
	log  *slog.Logger

	// Negotiated in the handshake.
	noZeroes   bool
	structured bool
	meta       bool            // base:allocation selected
	metaExport *Export         // ... for this export
	tls        *tls.Conn       // after STARTTLS; br and bw then read and write it
	sealed     *bufio.Reader   // after STARTTLS: what crypto/tls reads, from sock (sealedConn)
	raw        syscall.RawConn // nc's descriptor, for spliced reads; nil if it has none

	transmitting bool // the handshake is over (tlsRecords); set before transmit
	ro           bool // the export is read-only for this client

	x *Export
	// xmem is x's memory budget on this server (Server.budget).
	xmem *exportBudget
	st   *exportStats

	rmu        sync.Mutex             // the read token: held while decoding a request
	readDone   bool                   // the stream has ended (DISC, EOF, broken, Shutdown); under rmu
	workers    int                    // goroutines in the pool; under rmu
	waiting    atomic.Int32           // goroutines waiting for the read token
	running    atomic.Int32           // requests read and not yet answered (account)
	serialN    int                    // requests in a row fit for serial mode; under rmu
	sinceFlush int                    // requests read since the last flush; under rmu
	hdr        [wire.RequestSize]byte // the request header being read (a local would escape); under rmu
	bulkN      int                    // the bulk score (see bulk); under rmu
	bulky      bool                   // writing in bulk: counted twice in Server.OnActive (twice); under rmu
	outside    bool                   // the socket is out of the poller: counted twice too; under rmu
	replyFirst atomic.Bool            // nothing of the next request had come when the last serial reply left
	pool       sync.WaitGroup
	mem        *semaphore.Weighted // MaxInFlightBytes

	wmu     sync.Mutex
	pending atomic.Int32 // replies waiting for or holding wmu
	werr    error        // first write error; later replies are dropped
	broken  atomic.Bool  // werr is set, as seen without wmu

	// Reply batching (see unlockSend): queued says the read buffer holds
	// another whole request header, which the reader will take without
	// blocking, and holding replies for it pays (holdPays); owed says
	// replies wait in bw for the reader to flush them before it could block
	// (yieldReplies).
	queued atomic.Bool
	owed   atomic.Bool
	window window // the client's queue depth, as the reader sees it; under rmu

	stopped       atomic.Bool
	stopCtx       context.Context // done once stopped: ends a wait for memory
	stop          context.CancelFunc
	writeSince    atomic.Int64 // Server.ticks+1 when the current write began; 0 when not writing
	payloadSince  atomic.Int64 // Server.ticks+1 when the reader began to wait for a payload; 0 when not
	replyTimedOut atomic.Bool
}

func (c *conn) serve() {
	defer c.srv.dropConn(c)
	defer c.close()
	c.nc.SetDeadline(time.Now().Add(c.srv.handshakeTimeout()))
	if c.stopped.Load() {
		// A Shutdown that came first set its read deadline before the
		// one just set, which replaced it; one that comes later sets its
		// own after stopped, so it is never lost.
		return
	}
	x, err := c.handshake()
	if c.st != nil {
		// Joined in the handshake, whatever came after. Deferred after
		// close, so it runs first: the export is free by the time the
		// client sees the connection end (RemoveExport).
		defer c.left()
	}
	if err == nil {
		// Cleared before stopped is read, so a Shutdown that races with the
		// end of the handshake either sees the connection stopped or sets
		// its read deadline after this.
		c.nc.SetDeadline(time.Time{})
		if c.stopped.Load() {
			return
		}
	}
	if err != nil {
		if errors.Is(err, os.ErrDeadlineExceeded) && !c.stopped.Load() {
			c.srv.counters.handshakeTimeouts.Add(1)
			c.log.Info("nbd handshake timed out", "timeout", c.srv.handshakeTimeout())
			return
		}
		if c.quiet(err) || errors.Is(err, errAbort) {
			c.log.Debug("nbd handshake ended", "err", err)
		} else {
			c.log.Warn("nbd handshake failed", "err", err)
		}
		return
	}
	c.st.connsTotal.Add(1)
	c.log = c.log.With("export", x.Name)
	c.log.Debug("nbd transmission", "structured", c.structured, "meta", c.meta)
	c.transmitting = true
	if c.srv.beforeTransmit != nil {
		c.srv.beforeTransmit(c)
	}
	c.transmit()
}

// join counts the connection into x before the reply that starts its
// transmission goes out, so that a RemoveExport after the client has that
// reply finds the export busy. It is false when RemoveExport has taken x
// out since the handshake looked it up.
func (c *conn) join(x *Export) bool {
	c.srv.mu.Lock()
	ok := !x.removed.Load()
	if ok {
		c.x, c.st, c.xmem = x, &x.st, c.srv.budget(x)
		c.st.conns.Add(1)
		c.srv.transmitting.Add(1)
	}
	c.srv.mu.Unlock()
	if ok {
		c.srv.activeChanged(1) // OnActive may stop the world: not under mu
	}
	return ok
}

// left counts the connection out of its export, waking a RemoveExport
// that waits for the last one.
func (c *conn) left() {
	c.st.conns.Add(-1)
	c.srv.transmitting.Add(-1)
	if c.twice() {
		c.srv.activeChanged(-1)
	}
	c.srv.activeChanged(-1)
	if c.x.removed.Load() {
		c.srv.mu.Lock()
		c.srv.connGone.Broadcast()
		c.srv.mu.Unlock()
	}
}

// quiet reports whether err is an ordinary way for a connection to end.
func (c *conn) quiet(err error) bool {
	return errors.Is(err, io.EOF) || errors.Is(err, net.ErrClosed) || errors.Is(err, context.Canceled) ||
		errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE) ||
		(c.stopped.Load() && errors.Is(err, os.ErrDeadlineExceeded))
}

// stopReading makes the reader stop taking requests; requests already read
// complete and get their replies. Used by Shutdown.
func (c *conn) stopReading() {
	c.stopped.Store(true)
	c.stop()
	c.nc.SetReadDeadline(time.Now())
}

// transmit runs the transmission phase until DISC, EOF, a broken stream or
// Shutdown, waits for outstanding requests and flushes their replies.
func (c *conn) transmit() {
	c.mem = semaphore.NewWeighted(c.srv.maxInFlightBytes())
	c.sinceFlush = flushWindow // no flush yet
	c.workers = 1
	c.pool.Add(1)
	c.work()
	c.pool.Wait()
	c.lockSend()
	c.unlockSend()
}

// work is one goroutine of the pool: take the token, read a request, run it.
func (c *conn) work() {
	defer c.pool.Done()
	held := false
	for {
		j, handOver := c.next(held)
		if j == nil {
			return
		}
		serial := handOver != nil
		c.handle(j, serial)
		if serial && c.srv.afterSerialReply != nil {
			c.srv.afterSerialReply()
		}
		// Still ours unless this request's hand-over has fired and given
		// it up. The timer is the request's own: once one has fired,
		// another goroutine may take the token and arm one for a serial
		// request of its own, which a timer shared by all would let this
		// Stop take for a token still held here, and two goroutines would
		// read the stream at once.
		held = serial && handOver.Stop()
	}
}

// next reads the next request while holding the read token (taking it
// first unless held), or returns nil once the stream has ended. Before it
// gives the token up it starts another goroutine if none is waiting for
// the token, so the request after this one is read while this one runs. In
// serial mode it keeps the token instead and returns the request's
// hand-over: a timer that gives the token up (handTokenOn) if the request
// runs for handOverAfter.
func (c *conn) next(held bool) (j *job, handOver *time.Timer) {
	if !held {
		c.waiting.Add(1)
		c.rmu.Lock()
		c.waiting.Add(-1)
	}
	if c.readDone {
		c.rmu.Unlock()
		return nil, nil
	}
	waits := c.socketWaits()
	j = c.read()
	if j == nil {
		c.readDone = true
		c.queued.Store(false) // the replies still to come flush themselves
		c.rmu.Unlock()
		return nil, nil
	}
	c.st.inFlight.Add(1)
	c.bulk(&j.req)
	alone := c.running.Add(1) == 1
	if c.serial(alone, waits, &j.req) {
		c.st.serial.Add(1)
		return j, time.AfterFunc(c.srv.handOverAfter(), c.handTokenOn)
	}
	c.readAhead()
	c.rmu.Unlock()
	return j, nil
}

// readAhead starts another goroutine of the pool if none is waiting for
// the read token. The caller holds the token.
func (c *conn) readAhead() {
	if c.waiting.Load() == 0 && c.workers < c.srv.maxInFlight() {
		c.workers++
		c.pool.Add(1)
		go c.work()
	}
}

// Serial mode (see conn).
const (
	// serialAfter is how many requests in a row must each have come alone
	// to a waiting reader before serial mode starts.
	serialAfter = 3
	// handOverAfter is how long a request in serial mode runs before its
	// goroutine gives the read token up, as in the ordinary mode.
	handOverAfter = time.Millisecond
	// flushWindow: serial mode holds while one of the last flushWindow
	// requests was a flush.
	flushWindow = 8
)

// socketWaits is how many reads of the socket have found it empty so far.
func (c *conn) socketWaits() uint64 {
	if rs, ok := c.sock.(*rawSocket); ok {
		return rs.waits.Load()
	}
	return 0
}

// serial reports whether r, just read, is to be run in serial mode, given
// whether it is alone in flight and the socket's waits before it was read.
// A request fits when the client sent it after the last reply, not with
// it, nothing else of the connection was in flight and nothing of the
// stream is buffered behind it. The client sent it after the reply when
// the reader had to wait for it or, in serial mode, where the reply goes
// out before the reader looks, when nothing of it had come as the reply
// left (replyFirst): a client woken by the reply on the reader's CPU often
// sends the next request before the reader gets to the socket (fio at
// queue depth 1 did so for half its requests, which ended serial mode
// each time). Serial mode starts at the serialAfter'th fitting request in
// a row and holds while one of the last flushWindow requests was a flush:
// without flushes, the device calls do not block long enough for a woken
// reader to cost more than lingering does (docs/decisions/serial-mode.md).
// The caller holds the token.
func (c *conn) serial(alone bool, waits uint64, r *wire.Request) bool {
	rs, ok := c.sock.(*rawSocket)
	if !ok {
		return false // no socket to linger on (net.Pipe)
	}
	after := c.replyFirst.Swap(false) || rs.waits.Load() != waits
	if alone && c.br.Buffered() == 0 && after {
		c.serialN++
	} else {
		c.serialN = 0
	}
	if r.Type == wire.CmdFlush {
		c.sinceFlush = 0
	} else if c.sinceFlush < flushWindow {
		c.sinceFlush++
	}
	on := c.serialN >= serialAfter && c.sinceFlush < flushWindow
	linger := time.Duration(0)
	if on {
		linger = lingerTime
	}
	rs.linger.Store(int64(linger))
	c.followPoller(rs, on)
	return on
}

// followPoller takes the socket out of Go's network poller when the
// connection is the server's only one and is in serial mode or writes in
// bulk, and counts it twice in OnActive, so that --procs auto gives it a
// second P (see ownSocket); it brings the socket back once another
// connection transmits, which would leave no P idle while each of the
// socket's waits held a thread. It stays out when serial mode or the bulk
// writes end on their own. A move is skipped, to be tried at the next
// request, while a reply is being written. The caller holds the token.
func (c *conn) followPoller(rs *rawSocket, serial bool) {
	alone := c.srv.transmitting.Load() == 1 && !c.srv.inPoller
	was := c.twice()
	switch {
	case c.outside && !alone && rs.rejoin():
		c.outside = false
	case !c.outside && alone && (serial || c.bulky) && rs.leave():
		c.outside = true
	}
	c.recount(was)
}

// handTokenOn runs when a request in serial mode has run for
// handOverAfter: it ends serial mode and gives the read token up on the
// request's behalf, as next does in the ordinary mode, so that a request
// sent meanwhile is read and runs beside it.
func (c *conn) handTokenOn() {
	c.serialN = 0
	c.sock.(*rawSocket).linger.Store(0)
	c.readAhead()
	c.rmu.Unlock()
}

// Bulk writes (see bulk).
const (
	// bulkMin is the smallest write that counts as a large one.
	bulkMin = 256 << 10
	// bulkScore is how high a connection's score climbs, one per large
	// write, before it counts as writing in bulk, and falls, one per other
	// read or write, before it stops: it changes at most once per
	// bulkScore requests.
	bulkScore = 16
)

// bulk follows whether the connection writes in bulk (large writes one
// after another), just read r being its latest request, and tells
// Server.OnActive when that changes: such a connection counts twice
// there, so that --procs auto gives it a second P. Its reader then copies
// the next payload out of the socket (and decrypts it, over TLS) while the
// write before is copied into the device, each a system call or Go code
// holding a P for hundreds of µs a MiB; with one P the second waits for
// sysmon to take the P from the first, 20 µs or more later. Small
// requests gain nothing from a second P but wake-ups, and large reads
// gained nothing either: plain ones are spliced, with no copy in the
// server, and over TLS they did not gain (docs/decisions/procs-auto.md).
// The caller holds the token.
func (c *conn) bulk(r *wire.Request) {
	switch {
	case r.Type == wire.CmdWrite && r.Length >= bulkMin:
		c.bulkN = min(c.bulkN+1, bulkScore)
	case r.Type == wire.CmdWrite || r.Type == wire.CmdRead:
		c.bulkN = max(c.bulkN-1, 0)
	}
	was := c.twice()
	switch {
	case !c.bulky && c.bulkN == bulkScore:
		c.bulky = true
	case c.bulky && c.bulkN == 0:
		c.bulky = false
	}
	c.recount(was)
}

// twice reports whether the connection counts twice in OnActive: it
// writes in bulk, or its socket is out of the poller. The caller holds the
// token.
func (c *conn) twice() bool { return c.bulky || c.outside }

// recount tells OnActive when twice has changed from was. The caller holds
// the token.
func (c *conn) recount(was bool) {
	switch now := c.twice(); {
	case now && !was:
		c.srv.activeChanged(1)
	case was && !now:
		c.srv.activeChanged(-1)
	}
}

// read decodes one request and its payload; nil means the stream ended.
func (c *conn) read() *job {
	hdr := c.hdr[:]
	c.mayBlock(wire.RequestSize)
	if _, err := io.ReadFull(c.br, hdr); err != nil {
		if !c.quiet(err) && !errors.Is(err, io.ErrUnexpectedEOF) {
			c.log.Warn("nbd read request", "err", err)
		}
		return nil
	}
	r, ok := wire.DecodeRequest(hdr)
	if !ok {
		// Nothing after a bad magic can be trusted to be a header.
		c.log.Warn("nbd request with bad magic: closing connection")
		return nil
	}
	if r.Type == wire.CmdDisc {
		return nil
	}
	j := getJob()
	j.req, j.start = r, time.Now()
	if err := c.readPayload(j); err != nil {
		putJob(j)
		if !c.quiet(err) {
			c.log.Warn("nbd read payload", "err", err)
		}
		return nil
	}
	queued := c.br.Buffered() >= wire.RequestSize && c.holdPays(&j.req)
	c.queued.Store(queued)
	if !queued {
		c.yieldReplies()
	}
	return j
}

// Reply batching pays for itself only where the client keeps more
// requests in flight than it takes to hide a wake-up: a held reply is one
// the client cannot act on, and a client with few requests in flight that
// gets its replies in bursts sleeps between them, sends its next requests
// in bursts in turn, and the two sides end up taking turns, each woken
// from sleep for every burst. Held replies lose at shallow queue depths
// and gain at deep ones (docs/decisions/reply-holding.md).
const (
	// holdWindow is the least queue depth (window.depth) at which replies
	// are held.
	holdWindow = 16
	// windowEpoch is how many requests one window epoch spans.
	windowEpoch = 256
)

// holdPays reports whether replies may wait for the request after r, which
// was just read with more of the stream buffered behind it: when the
// client keeps at least holdWindow requests in flight, or the connections
// outnumber the Ps (Server.crowded), where the CPU a write saves goes to
// another connection's requests. The caller holds the token.
func (c *conn) holdPays(r *wire.Request) bool {
	onWire := wire.RequestSize
	if r.Type == wire.CmdWrite {
		onWire += int(r.Length)
	}
	ahead := max(1, c.br.Buffered()/onWire) // as long as r, if more follow
	c.window.note(int(c.running.Load()) + 1 + ahead)
	return c.window.depth() >= holdWindow || c.srv.crowded.Load()
}

// window estimates a client's queue depth from the requests the server
// holds each time the reader takes one with more buffered behind it (those
// read and not yet answered, this one and the whole ones buffered behind
// it; only then could a reply be held): the most seen over the
// last one or two epochs of windowEpoch requests. A client waiting for
// replies has all its requests at the server, so the most seen over a few
// hundred requests is its queue depth, and the estimate follows a change
// within two epochs.
type window struct {
	n, cur, prev int
}

func (w *window) note(inHand int) {
	w.cur = max(w.cur, inHand)
	if w.n++; w.n == windowEpoch {
		w.n, w.prev, w.cur = 0, w.cur, 0
	}
}

func (w *window) depth() int { return max(w.cur, w.prev) }

// mayBlock is called by the reader before it reads n more bytes: if they
// are not all buffered the read may block, so the replies held back for
// the requests that were buffered go out first.
func (c *conn) mayBlock(n int) {
	if c.br.Buffered() < n {
		c.queued.Store(false)
		c.yieldReplies()
	}
}

// yieldReplies flushes the replies held back in bw, if any. The reader
// calls it with queued false, so unlockSend flushes.
func (c *conn) yieldReplies() {
	if c.owed.Load() {
		c.lockSend()
		c.unlockSend()
	}
}

// Memory charged per request (see cost).
const (
	// requestBase is charged to every request: its job, its share of a
	// goroutine stack, its reply header.
	requestBase = 8 << 10
	// streamPiece is the buffer a READ or WRITE longer than MaxPayload is
	// moved through, piece by piece, instead of being held whole.
	streamPiece = 4 << 20
	// walkCost covers a trim, zeroing or cache request's working set: the
	// device's walk.
	walkCost = mapped.WalkMemory
	// blockStatusCost covers a block status request: the reply's
	// descriptors and one Holes answer.
	blockStatusCost = maxExtents*(8+16) + mapped.HolesMemory
	// maxCost is the most any request is charged.
	maxCost = requestBase + MaxPayload
)

// cost is the memory request r may hold while it runs: its payload or read
// buffer (one streamPiece for longer ones) or its working set, and below
// the export (the device's RequestMemory: snapshot copy buffers, remote
// head and tail blocks) what the data commands hold there. It never
// depends on what the client asks for beyond MaxPayload, and is at most
// maxCost.
func cost(r *wire.Request, below int64) int64 {
	switch r.Type {
	case wire.CmdRead, wire.CmdWrite:
		if r.Length > MaxPayload {
			return min(requestBase+streamPiece+below, maxCost)
		}
		return min(requestBase+int64(r.Length)+below, maxCost)
	case wire.CmdTrim, wire.CmdWriteZeroes, wire.CmdCache:
		return min(requestBase+walkCost+below, maxCost)
	case wire.CmdBlockStatus:
		return requestBase + blockStatusCost
	}
	return requestBase
}

// charge takes n more bytes for j from its budgets (budgets), waiting (in
// arrival order) for each in turn until it has them. Only the holder of
// the read token charges, so a connection waits without reading further.
// A budget is waited for holding only the budgets before it, which every
// request takes in the same order, so the waits cannot form a cycle. The
// wait ends with an error, and j's memory given back, once the connection
// is stopped (Shutdown, RemoveExport), which would otherwise wait for
// memory that other connections hold.
func (c *conn) charge(j *job, n int64) error {
	bs := c.budgets(j)
	for i, b := range bs {
		if b.TryAcquire(n) {
			continue
		}
		if i > 0 {
			c.srv.counters.memWaits.Add(1)
		}
		c.queued.Store(false) // waiting: send what is held back first
		c.yieldReplies()
		var err error
		if i == len(bs)-1 && j.cost == 0 {
			err = c.awaitMemory(j, n) // the server's Memory, or its reserve
		} else {
			err = b.Acquire(c.stopCtx, n)
		}
		if err != nil {
			for _, held := range bs[:i] {
				held.Release(n)
			}
			c.uncharge(j)
			return err
		}
	}
	c.srv.counters.memInUse.Add(n)
	j.cost += n
	return nil
}

// budgets are what j's memory is charged to, in the order it takes them:
// its connection's (MaxInFlightBytes), its export's (ExportMemory) and the
// server's (Memory, or the reserve if j is on it).
func (c *conn) budgets(j *job) [3]*semaphore.Weighted {
	if j.reserved {
		return [3]*semaphore.Weighted{c.mem, c.xmem.Weighted, c.srv.reserve.sem}
	}
	return [3]*semaphore.Weighted{c.mem, c.xmem.Weighted, c.srv.mem}
}

// tryCharge is charge without waiting: false, and nothing taken, if any
// budget is short.
func (c *conn) tryCharge(j *job, n int64) bool {
	bs := c.budgets(j)
	for i, b := range bs {
		if !b.TryAcquire(n) {
			for _, held := range bs[:i] {
				held.Release(n)
			}
			return false
		}
	}
	c.srv.counters.memInUse.Add(n)
	j.cost += n
	return true
}

// uncharge gives j's memory back, and its export's turn on the reserve if
// it had it.
func (c *conn) uncharge(j *job) {
	if j.cost == 0 {
		return
	}
	c.srv.counters.memInUse.Add(-j.cost)
	for _, b := range c.budgets(j) {
		b.Release(j.cost)
	}
	if j.reserved {
		<-c.xmem.turn // before the reserve's waiters wake, which may want it
		c.srv.reserve.freed.Fire()
		j.reserved = false
	}
	j.cost = 0
}

// payloadFirst is how much of a WRITE's payload is charged before any of
// it has come: a longer payload is charged the rest only once its first
// payloadFirst bytes are in. The reader reads one payload at a time, so a
// client that announces payloads and withholds them holds at most this
// much (and requestBase) per connection, until ReplyTimeout closes it
// (watchReplies), instead of MaxPayload, which 8 connections' worth of
// headers would have taken the whole default Memory with.
const payloadFirst = 1 << 20

// readPayload charges the request's memory and reads a WRITE's payload.
// A WRITE longer than payloadFirst is charged in two steps (payloadFirst),
// and written as it arrives (writeStream) when it is longer than
// MaxPayload, or when the memory for the rest of it is not free at once:
// waiting for it while holding the first part could leave every
// connection holding part of what the others wait for.
func (c *conn) readPayload(j *job) error {
	r := &j.req
	below := c.x.Dev.RequestMemory() // once: a reload may change it
	if r.Type != wire.CmdWrite || r.Length <= payloadFirst {
		if err := c.charge(j, cost(r, below)); err != nil {
			return err
		}
		if r.Type != wire.CmdWrite || r.Length == 0 {
			return nil
		}
		j.setBuf(int(r.Length))
		return c.readFull(j, j.buf)
	}
	if r.Length > MaxPayload {
		if err := c.charge(j, cost(r, below)); err != nil {
			return err
		}
		j.setBuf(streamPiece)
		return c.writeStream(j, 0)
	}
	if err := c.charge(j, requestBase+payloadFirst); err != nil {
		return err
	}
	j.setBuf(payloadFirst)
	if err := c.readFull(j, j.buf); err != nil {
		return err
	}
	if !c.tryCharge(j, cost(r, below)-j.cost) {
		return c.writeStream(j, payloadFirst)
	}
	first := j.bufp
	j.setBuf(int(r.Length))
	copy(j.buf[:payloadFirst], (*first)[:payloadFirst])
	putBuf(first)
	return c.readFull(j, j.buf[payloadFirst:])
}

// readFull reads p, part of j's payload, from the connection. While the
// client has yet to send some of it, the server's watch closes the
// connection if it has not come within ReplyTimeout (payloadSince). On
// failure j's memory goes back.
func (c *conn) readFull(j *job, p []byte) error {
	c.mayBlock(len(p))
	if c.br.Buffered() < len(p) {
		c.payloadSince.Store(c.srv.ticks.Load() + 1)
		defer c.payloadSince.Store(0)
	}
	if err := c.readWhole(p); err != nil {
		c.uncharge(j)
		return err
	}
	return nil
}

// readWhole reads all of p from the stream: what br holds of it, and the
// rest straight from the socket, in one wait when the socket is out of the
// poller (rawSocket.ReadWhole) and the server is not crowded, so that the
// reader, whose connection then counts twice in OnActive, has a P of its
// own to hold while it waits. br would read the rest straight from the
// socket too, being longer than its buffer, but a piece at a time, and
// with its last piece it may take the next request's header; in the
// poller, where there is no wait to save, it still does.
func (c *conn) readWhole(p []byte) error {
	rs, ok := c.sock.(*rawSocket)
	n := c.br.Buffered()
	if !ok || c.tls != nil || len(p)-n < c.br.Size() || c.srv.crowded.Load() || !rs.outside() {
		_, err := io.ReadFull(c.br, p)
		return err
	}
	if n > 0 {
		c.br.Read(p[:n]) // what br holds: it reads nothing more
	}
	return rs.ReadWhole(p[n:])
}

// writeStream runs a WRITE while its payload arrives: one piece at a time
// through j.buf, read from the socket and written to the export, so it
// never holds more than one piece; the first have bytes are in j.buf
// already. The whole payload is consumed even after a piece fails, so that
// the stream stays in sync; the request is then failed with that piece's
// error. It runs on the reader, holding the read token: nothing else can
// be read from the connection until the payload has been.
func (c *conn) writeStream(j *job, have int) error {
	r := &j.req
	j.ran = true
	j.errno, j.msg = c.check(r)
	piece := int64(len(j.buf))
	off, left := int64(r.Offset), int64(r.Length)
	for left > 0 {
		p := j.buf[:min(left, piece)]
		if have > 0 {
			p, have = j.buf[:have], 0
		} else if err := c.readFull(j, p); err != nil {
			return err
		}
		if j.errno == 0 {
			c.protect(j, func() error { return c.x.Dev.Write(p, off, r.Flags&wire.CfFUA != 0) })
		}
		off += int64(len(p))
		left -= int64(len(p))
	}
	return nil
}

// handle runs one request, accounts for it and replies; for a request in
// serial mode it first notes whether the client has begun to send the
// next one (replyFirst, see conn.serial).
func (c *conn) handle(j *job, serial bool) {
	c.run(j)
	if serial {
		// The read buffer held nothing of the stream when this request was
		// read, and only the token's holder fills it, so the socket is
		// where the next request would be. (Over TLS crypto/tls, or the
		// buffer under it, may hold the start of a record read with this
		// one; a request sent so counts as sent after the reply, which
		// costs it at most being read once this reply has left.)
		c.replyFirst.Store(c.sock.(*rawSocket).drained())
	}
	if j.errno == 0 && j.req.Type == wire.CmdRead && j.req.Length > MaxPayload {
		c.readStream(j)
		c.account(j)
	} else {
		// Counted before the reply leaves, so a client that has its reply
		// sees it in Stats.
		c.account(j)
		c.reply(j)
	}
	c.uncharge(j)
	putJob(j)
}

// account counts a completed request in Stats and Observe.
func (c *conn) account(j *job) {
	d := time.Since(j.start)
	r := &j.req
	op := &c.st.ops[opIndex(r.Type)]
	op.requests.Add(1)
	op.nanos.Add(int64(d))
	var n int64
	if j.errno == 0 {
		n = int64(r.Length)
		op.bytes.Add(n)
	} else {
		op.errors[errnoIndex(j.errno)].Add(1)
	}
	c.st.inFlight.Add(-1)
	c.running.Add(-1)
	if obs := c.srv.Observe; obs != nil {
		obs(c.x.Name, Ops[opIndex(r.Type)], n, j.errno, d)
	}
}

// run validates and executes j, leaving the outcome in j.
func (c *conn) run(j *job) {
	if j.ran || j.errno != 0 {
		return
	}
	r := &j.req
	if j.errno, j.msg = c.check(r); j.errno != 0 {
		return
	}
	if r.Type == wire.CmdRead && r.Length > MaxPayload {
		return // read piece by piece as the reply goes out (readStream)
	}
	c.protect(j, func() error { return c.exec(j) })
}

// protect runs fn, one request's call into the export, and records its
// error in j. A panic below the protocol edge is a bug; it fails this
// request with EIO, is logged with its stack and reported to OnPanic,
// instead of taking every connection down.
func (c *conn) protect(j *job, fn func() error) {
	defer func() {
		if p := recover(); p != nil {
			c.srv.Panicked(p, debug.Stack())
			j.errno, j.msg, j.hasErrOff = wire.EIO, errMessage(wire.EIO), false
		}
	}()
	if err := fn(); err != nil && j.errno == 0 {
		r := &j.req
		j.errno = errnoOf(err, r)
		j.msg = errMessage(j.errno)
		c.log.Debug("nbd request failed", "op", Ops[r.Type], "offset", r.Offset, "length", r.Length, "errno", j.errno, "err", err)
	}
}

// exec executes a validated request (READ and WRITE up to MaxPayload).
func (c *conn) exec(j *job) error {
	x, r := c.x, &j.req
	off, n := int64(r.Offset), int64(r.Length)
	fua := r.Flags&wire.CfFUA != 0
	switch r.Type {
	case wire.CmdRead:
		if n == 0 {
			return nil
		}
		if ok, err := c.spliceRead(j); ok {
			j.hasErrOff = err != nil
			return err
		}
		j.setBuf(int(n))
		var err error
		if c.sparse(r) {
			j.holes, j.errOff, err = x.Dev.ReadSparse(j.buf, off, j.holes[:0])
		} else {
			j.errOff, err = x.Dev.Read(j.buf, off)
		}
		j.hasErrOff = err != nil
		return err
	case wire.CmdWrite:
		if n == 0 {
			return nil
		}
		return x.Dev.Write(j.buf, off, fua)
	case wire.CmdFlush:
		return x.Dev.Flush()
	case wire.CmdTrim:
		if n == 0 {
			return nil
		}
		return x.Dev.Trim(off, n, fua)
	case wire.CmdWriteZeroes:
		if n == 0 {
			return nil
		}
		return x.Dev.WriteZeroes(off, n, r.Flags&wire.CfNoHole == 0, r.Flags&wire.CfFastZero != 0, fua)
	case wire.CmdCache:
		if n == 0 {
			return nil
		}
		return x.Dev.Cache(off, n)
	case wire.CmdBlockStatus:
		limit := maxExtents
		if r.Flags&wire.CfReqOne != 0 {
			limit = 1
		}
		var err error
		j.bs, err = x.Dev.BlockStatus(off, n, limit, j.bs[:0])
		return err
	}
	return nil
}

// errMessage is the text of an error chunk: fixed per errno, so that no
// detail of the host (paths, device names) reaches a client. The log has
// the full error.
func errMessage(errno uint32) string {
	switch errno {
	case wire.EPERM:
		return "operation not permitted"
	case wire.EIO:
		return "input/output error"
	case wire.ENOMEM:
		return "out of memory"
	case wire.EINVAL:
		return "invalid argument"
	case wire.ENOSPC:
		return "no space left on device"
	case wire.EOVERFLOW:
		return "value too large"
	case wire.ENOTSUP:
		return "operation not supported"
	case wire.ESHUTDOWN:
		return "server shutting down"
	}
	return "error"
}

// check validates a request at the protocol edge, so that Export methods
// only ever see in-range requests with meaningful flags. It returns the
// spec's errno and a message for the client, or 0.
func (c *conn) check(r *wire.Request) (uint32, string) {
	if r.Type >= wire.NumCmds || r.Type == wire.CmdDisc {
		return wire.EINVAL, "unknown command"
	}
	writes := r.Type == wire.CmdWrite || r.Type == wire.CmdTrim || r.Type == wire.CmdWriteZeroes
	if writes && c.ro {
		return wire.EPERM, "export is read-only"
	}
	allowed := wire.CfFUA
	switch r.Type {
	case wire.CmdRead:
		if c.structured {
			allowed |= wire.CfDF // answered with one OFFSET_DATA chunk, holes as zeros (sparse)
		}
	case wire.CmdWriteZeroes:
		allowed |= wire.CfNoHole | wire.CfFastZero
	case wire.CmdBlockStatus:
		allowed |= wire.CfReqOne
	}
	if r.Flags&^allowed != 0 {
		return wire.EINVAL, "command flag not valid for this command"
	}
	switch r.Type {
	case wire.CmdRead:
		if r.Flags&wire.CfDF != 0 && r.Length > MaxPayload {
			// One chunk that long could not be answered with an error
			// once a later piece failed, and past 4 GiB its length would
			// not fit the chunk header: the spec's answer is EOVERFLOW.
			return wire.EOVERFLOW, "read too long for one chunk"
		}
	case wire.CmdFlush:
		if r.Offset != 0 || r.Length != 0 {
			return wire.EINVAL, "flush offset and length must be zero"
		}
		return 0, ""
	case wire.CmdBlockStatus:
		if !c.meta {
			return wire.EINVAL, "no metadata context negotiated"
		}
		if r.Length == 0 {
			return wire.EINVAL, "zero-length block status"
		}
	}
	size := uint64(c.x.Size())
	if r.Offset > size || uint64(r.Length) > size-r.Offset {
		if r.Type == wire.CmdWrite || r.Type == wire.CmdWriteZeroes {
			return wire.ENOSPC, "write beyond the end of the export"
		}
		return wire.EINVAL, "request beyond the end of the export"
	}
	return 0, ""
}

// errnoOf maps an error from a device operation to the NBD error sent to
// the client for request r; it is the only such mapping. Only WRITE_ZEROES
// with FAST_ZERO may fail with ENOTSUP. A range past the end of a device
// that shrank since the request was validated gets the spec's errno for
// that: ENOSPC for writes, EINVAL for the rest. A device failed by an
// earlier sync is EIO, whatever that sync's errno. Error targets
// (table.ErrTarget), short reads and I/O errors are EIO.
func errnoOf(err error, r *wire.Request) uint32 {
	switch {
	case err == nil:
		return 0
	case errors.Is(err, flush.ErrSyncFailed):
		// An earlier sync of a device below failed: whatever its errno
		// was then, this request fails because of it, which is EIO.
		return wire.EIO
	case errors.Is(err, mapped.ErrBeyondEnd):
		if r.Type == wire.CmdWrite || r.Type == wire.CmdWriteZeroes {
			return wire.ENOSPC
		}
		return wire.EINVAL
	case errors.Is(err, backing.ErrNotSupported) || errors.Is(err, syscall.EOPNOTSUPP):
		if r.Type == wire.CmdWriteZeroes && r.Flags&wire.CfFastZero != 0 {
			return wire.ENOTSUP
		}
		return wire.EIO
	case errors.Is(err, syscall.ENOSPC) || errors.Is(err, syscall.EDQUOT) || errors.Is(err, syscall.EFBIG):
		return wire.ENOSPC
	case errors.Is(err, syscall.EPERM) || errors.Is(err, syscall.EROFS) || errors.Is(err, syscall.EACCES):
		return wire.EPERM
	case errors.Is(err, syscall.ENOMEM):
		return wire.ENOMEM
	}
	return wire.EIO
}

// sparse says whether read r is answered with hole chunks for its holes:
// only with structured replies and without DF, which asks for one data
// chunk. Other reads get the holes' zeros as data.
func (c *conn) sparse(r *wire.Request) bool {
	return c.structured && r.Flags&wire.CfDF == 0
}

// reply sends j's reply: a simple reply, or, once structured replies are
// negotiated, a single final chunk for block status and errors, and for
// reads one data chunk, or data and hole chunks if it has holes.
func (c *conn) reply(j *job) {
	r := &j.req
	b := j.out[:0]
	var data []byte
	switch {
	case j.errno != 0 && c.structured:
		b = appendErrorChunk(b, r.Handle, j.errno, j.msg, j.hasErrOff, uint64(j.errOff))
	case j.errno != 0:
		b = wire.AppendSimpleReply(b, r.Handle, j.errno)
	case r.Type == wire.CmdRead && c.structured && r.Length == 0:
		b = wire.AppendChunkHeader(b, r.Handle, wire.ReplyFlagDone, wire.ChunkNone, 0)
	case r.Type == wire.CmdRead && j.pipe != nil:
		if c.structured {
			b = appendDataChunkHeader(b, r.Handle, wire.ReplyFlagDone, r.Offset, r.Length)
			c.st.readChunks[0].Add(1)
		} else {
			b = wire.AppendSimpleReply(b, r.Handle, 0)
		}
		j.out = b
		c.sendSpliced(j, b)
		return
	case r.Type == wire.CmdRead && c.structured && len(j.holes) > 0:
		c.sendRead(j, int64(r.Offset), j.buf, true)
		return
	case r.Type == wire.CmdRead && c.structured:
		b = appendDataChunkHeader(b, r.Handle, wire.ReplyFlagDone, r.Offset, r.Length)
		data = j.buf
		c.st.readChunks[0].Add(1)
	case r.Type == wire.CmdRead:
		b = wire.AppendSimpleReply(b, r.Handle, 0)
		data = j.buf
	case r.Type == wire.CmdBlockStatus:
		b = appendBlockStatusChunk(b, r.Handle, metaBaseID, j.bs)
	default:
		b = wire.AppendSimpleReply(b, r.Handle, 0)
	}
	j.out = b
	c.send(b, data)
}

// sendRead sends the chunks of a structured read reply for [off,
// off+len(p)) whose holes are j.holes (ascending, inside it, p not holding
// their bytes): OFFSET_DATA for the data between the holes and OFFSET_HOLE
// for each hole, in order, under one hold of the write lock; the last
// chunk is flagged done if done (a long read's last piece). At most
// 2*mapped.MaxHoles+1 chunks:
//
//	p      [ data ][ hole ][ data ][ hole ]
//	chunks  DATA    HOLE    DATA    HOLE+done
func (c *conn) sendRead(j *job, off int64, p []byte, done bool) {
	h := j.req.Handle
	// Room for every header first, so that the parts cut from j.out stay
	// valid as it grows.
	if need := (2*len(j.holes) + 1) * maxReadChunkHeader; cap(j.out) < need {
		j.out = make([]byte, 0, need)
	}
	b, parts := j.out[:0], j.parts[:0]
	end := off + int64(len(p))
	flag := func(last int64) uint16 {
		if done && last == end {
			return wire.ReplyFlagDone
		}
		return 0
	}
	var nData, holeBytes int64
	pos := off
	data := func(to int64) {
		nData++
		at := len(b)
		b = appendDataChunkHeader(b, h, flag(to), uint64(pos), uint32(to-pos))
		parts = append(parts, b[at:], p[pos-off:to-off])
	}
	for _, hole := range j.holes {
		if hole.Off > pos {
			data(hole.Off)
		}
		at := len(b)
		b = appendHoleChunk(b, h, flag(hole.End()), uint64(hole.Off), uint32(hole.Len))
		parts = append(parts, b[at:])
		holeBytes += hole.Len
		pos = hole.End()
	}
	if pos < end {
		data(end)
	}
	c.st.readChunks[0].Add(nData)
	c.st.readChunks[1].Add(int64(len(j.holes)))
	c.st.readHoleBytes.Add(holeBytes)
	j.out, j.parts = b, parts
	c.sendParts(parts)
}

// readStream answers a READ longer than MaxPayload, reading it one
// streamPiece at a time, so that it never holds more than one piece. The
// first piece is read before anything is sent, so a failure there is an
// ordinary error reply. With structured replies every piece is its own
// OFFSET_DATA chunk (a DF read this long was refused with EOVERFLOW), and
// other replies may go out between them; a later failure ends the reply
// with an ERROR_OFFSET chunk, and a connection whose writes have failed
// reads no further. A simple reply promises all the data in its header,
// so the pieces go out under one hold of the write lock, and a failure
// after the header can only be reported by closing the connection, as the
// NBD spec requires.
func (c *conn) readStream(j *job) {
	r := &j.req
	j.setBuf(streamPiece)
	off, end := int64(r.Offset), int64(r.Offset)+int64(r.Length)
	sparse := c.sparse(r)
	piece := func() []byte {
		p := j.buf[:min(end-off, streamPiece)]
		c.protect(j, func() error {
			var err error
			if sparse {
				j.holes, j.errOff, err = c.x.Dev.ReadSparse(p, off, j.holes[:0])
			} else {
				j.errOff, err = c.x.Dev.Read(p, off)
			}
			j.hasErrOff = err != nil
			return err
		})
		return p
	}
	p := piece()
	if j.errno != 0 {
		c.reply(j)
		return
	}
	if sparse {
		for {
			last := off+int64(len(p)) == end
			c.sendRead(j, off, p, last)
			if last || c.broken.Load() {
				return
			}
			off += int64(len(p))
			if p = piece(); j.errno != 0 {
				c.reply(j) // the final ERROR_OFFSET chunk
				return
			}
		}
	}
	j.out = wire.AppendSimpleReply(j.out[:0], r.Handle, 0)
	c.lockSend()
	defer c.unlockSend()
	if c.werr == nil {
		_, c.werr = c.bw.Write(j.out)
	}
	for c.werr == nil {
		c.writing()
		_, c.werr = c.bw.Write(p)
		off += int64(len(p))
		if c.werr != nil || off == end {
			break
		}
		// Reading the device is not the client failing to take the
		// reply: a slow disk must not look like a stuck client.
		c.writeSince.Store(0)
		if p = piece(); j.errno != 0 {
			c.log.Warn("nbd read failed after its reply header was sent: closing the connection", "offset", off, "errno", j.errno)
			c.werr = errBrokenReply
		}
	}
}

// sendParts writes one reply made of several parts (a sparse read's
// chunks and their data) under one hold of the write lock, so that they
// leave together.
func (c *conn) sendParts(parts [][]byte) {
	c.lockSend()
	defer c.unlockSend()
	for _, p := range parts {
		if c.werr != nil {
			return
		}
		_, c.werr = c.bw.Write(p)
	}
}

// errBrokenReply ends a connection whose reply could not be completed.
var errBrokenReply = errors.New("reply broken off")

// send writes one reply into bw; unlockSend decides when bw is flushed.
func (c *conn) send(hdr, data []byte) {
	c.lockSend()
	defer c.unlockSend()
	if c.werr == nil {
		_, c.werr = c.bw.Write(hdr)
	}
	if c.werr == nil && len(data) > 0 {
		_, c.werr = c.bw.Write(data)
	}
}

// lockSend starts a hold of the write lock.
func (c *conn) lockSend() {
	c.pending.Add(1)
	c.wmu.Lock()
	c.writing()
}

// writing notes that the connection is writing replies from now on, for
// the server's watch on clients that stop taking them (watchReplies). It
// costs an atomic load and store, where a write deadline per reply would
// cost a timer update.
func (c *conn) writing() {
	c.writeSince.Store(c.srv.ticks.Load() + 1)
}

// payloadStuck closes a connection whose client has not sent the payload
// it announced within ReplyTimeout, which would otherwise hold the
// memory charged for it.
func (c *conn) payloadStuck() {
	if c.replyTimedOut.CompareAndSwap(false, true) {
		c.srv.counters.payloadTimeouts.Add(1)
		c.log.Warn("nbd client stopped sending a write's payload: closing the connection", "timeout", c.srv.replyTimeout())
		c.nc.Close()
	}
}

// replyStuck closes a connection whose client has taken none of its
// replies for ReplyTimeout, so that the memory its requests hold comes
// back instead of staying pinned behind replies it will never read. The
// blocked write then fails, and the connection winds down as for any
// failed write.
func (c *conn) replyStuck() {
	if c.replyTimedOut.CompareAndSwap(false, true) {
		c.srv.counters.replyTimeouts.Add(1)
		c.log.Warn("nbd client stopped reading its replies: closing the connection", "timeout", c.srv.replyTimeout())
		c.nc.Close()
	}
}

// unlockSend ends a hold of the write lock, flushing the replies in bw
// unless another reply is about to join them: one waits for the lock
// (pending), or the read buffer holds another request (queued), whose
// reader flushes before it could block (mayBlock). So replies that
// complete together, or for requests that arrived together, go out in one
// write, and a reply is held back only while the connection has a request
// in hand, never while it waits for the client. A failed write closes the
// connection.
//
// owed is set before queued is read, and the reader clears queued before
// it reads owed, so a reply held back is always flushed by one of them.
func (c *conn) unlockSend() {
	if c.pending.Add(-1) == 0 && c.werr == nil {
		c.owed.Store(c.bw.Buffered() > 0)
		if c.owed.Load() && !c.queued.Load() {
			c.owed.Store(false)
			c.werr = c.bw.Flush()
		}
	}
	c.writeSince.Store(0)
	failed := c.werr
	c.wmu.Unlock()
	if failed != nil {
		c.broken.Store(true)
		// The client is gone or stuck, or a reply broke off: wake the
		// reader so the connection winds down; the other connections are
		// not affected.
		c.nc.Close()
	}
}

// job is one request on its way through a worker. Jobs and their buffers
// are pooled, so steady-state I/O allocates almost nothing per request.
type job struct {
	req      wire.Request
	start    time.Time
	cost     int64 // budget bytes held
	reserved bool  // charged to the server's reserve instead of its Memory (reserve.go)

	bufp *[]byte // pooled payload or read buffer
	buf  []byte  // (*bufp)[:req.Length]
	pipe *pipe   // a spliced read's data, instead of buf

	ran       bool // executed while its payload was read (writeStream)
	errno     uint32
	msg       string
	errOff    int64 // virtual offset of a read error, with hasErrOff
	hasErrOff bool

	bs    []mapped.BlockExtent // block status result, reused
	holes []backing.Range      // a sparse read's holes, reused
	parts [][]byte             // a sparse read's reply, in pieces, reused
	out   []byte               // encoded reply header(s), reused
}

var jobPool = sync.Pool{New: func() any { return &job{out: make([]byte, 0, 64)} }}

func getJob() *job { return jobPool.Get().(*job) }

func putJob(j *job) {
	if j.bufp != nil {
		putBuf(j.bufp)
	}
	clear(j.parts) // no reference to a returned buffer stays behind
	*j = job{bs: j.bs[:0], holes: j.holes[:0], parts: j.parts[:0], out: j.out[:0]}
	jobPool.Put(j)
}

func (j *job) setBuf(n int) {
	j.bufp = getBuf(n)
	j.buf = (*j.bufp)[:n]
}

// dropBuf gives back the buffer setBuf lent.
func (j *job) dropBuf() {
	if j.bufp != nil {
		putBuf(j.bufp)
	}
	j.bufp, j.buf = nil, nil
}
