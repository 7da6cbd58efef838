package nbdtarget

import (
	"bufio"
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

	"github.com/nbdmapper/nbdmapper/backing"
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
// At most MaxInFlight goroutines exist per connection, and the reader stops
// taking requests while their buffers would exceed MaxInFlightBytes, which
// bounds memory per connection whatever the client sends.
type conn struct {
	srv *Server
	nc  net.Conn
	br  *bufio.Reader
	bw  *bufio.Writer
	log *slog.Logger

	// Negotiated in the handshake.
	noZeroes   bool
	structured bool
	meta       bool    // base:allocation selected
	metaExport *Export // ... for this export

	x  *Export
	st *exportStats

	rmu      sync.Mutex   // the read token: held while decoding a request
	readDone bool         // the stream has ended (DISC, EOF, broken, Shutdown); under rmu
	workers  int          // goroutines in the pool; under rmu
	waiting  atomic.Int32 // goroutines waiting for the read token
	pool     sync.WaitGroup
	bytes    budget

	wmu     sync.Mutex
	pending atomic.Int32 // replies waiting for or holding wmu
	werr    error        // first write error; later replies are dropped

	stopped atomic.Bool
}

func (c *conn) serve() {
	defer c.srv.dropConn(c)
	defer c.nc.Close()
	x, err := c.handshake()
	if err != nil {
		if c.quiet(err) || errors.Is(err, errAbort) {
			c.log.Debug("nbd handshake ended", "err", err)
		} else {
			c.log.Warn("nbd handshake failed", "err", err)
		}
		return
	}
	c.x, c.st = x, c.srv.stats[x]
	c.log = c.log.With("export", x.Name)
	c.st.conns.Add(1)
	c.st.connsTotal.Add(1)
	defer c.st.conns.Add(-1)
	c.log.Debug("nbd transmission", "structured", c.structured, "meta", c.meta)
	c.transmit()
}

// quiet reports whether err is an ordinary way for a connection to end.
func (c *conn) quiet(err error) bool {
	return errors.Is(err, io.EOF) || errors.Is(err, net.ErrClosed) ||
		errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE) ||
		(c.stopped.Load() && errors.Is(err, os.ErrDeadlineExceeded))
}

// stopReading makes the reader stop taking requests; requests already read
// complete and get their replies. Used by Shutdown.
func (c *conn) stopReading() {
	c.stopped.Store(true)
	c.nc.SetReadDeadline(time.Now())
}

// transmit runs the transmission phase until DISC, EOF, a broken stream or
// Shutdown, waits for outstanding requests and flushes their replies.
func (c *conn) transmit() {
	c.bytes.init(c.srv.maxInFlightBytes())
	c.workers = 1
	c.pool.Add(1)
	c.work()
	c.pool.Wait()
	c.wmu.Lock()
	if c.werr == nil {
		c.werr = c.bw.Flush()
	}
	c.wmu.Unlock()
}

// work is one goroutine of the pool: take the token, read a request, run it.
func (c *conn) work() {
	defer c.pool.Done()
	for {
		j := c.next()
		if j == nil {
			return
		}
		c.handle(j)
	}
}

// next reads the next request while holding the read token, or returns nil
// once the stream has ended. Before it gives the token up it starts another
// goroutine if none is waiting for the token, so the request after this one
// is read while this one runs.
func (c *conn) next() *job {
	c.waiting.Add(1)
	c.rmu.Lock()
	c.waiting.Add(-1)
	defer c.rmu.Unlock()
	if c.readDone {
		return nil
	}
	j := c.read()
	if j == nil {
		c.readDone = true
		return nil
	}
	c.st.inFlight.Add(1)
	if c.waiting.Load() == 0 && c.workers < c.srv.maxInFlight() {
		c.workers++
		c.pool.Add(1)
		go c.work()
	}
	return j
}

// read decodes one request and its payload; nil means the stream ended.
func (c *conn) read() *job {
	var hdr [requestSize]byte
	if _, err := io.ReadFull(c.br, hdr[:]); err != nil {
		if !c.quiet(err) && !errors.Is(err, io.ErrUnexpectedEOF) {
			c.log.Warn("nbd read request", "err", err)
		}
		return nil
	}
	r, ok := decodeRequest(hdr[:])
	if !ok {
		// Nothing after a bad magic can be trusted to be a header.
		c.log.Warn("nbd request with bad magic: closing connection")
		return nil
	}
	if r.Type == cmdDisc {
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
	return j
}

// readPayload reserves the request's buffer budget and reads a WRITE's
// payload. An oversized payload is read and thrown away, so that the stream
// stays in sync, and the request is failed with EINVAL.
func (c *conn) readPayload(j *job) error {
	r := &j.req
	switch {
	case r.Type == cmdWrite && r.Length > MaxPayload:
		if _, err := io.CopyN(io.Discard, c.br, int64(r.Length)); err != nil {
			return err
		}
		j.errno, j.msg = EINVAL, "request exceeds maximum payload"
	case r.Type == cmdWrite || r.Type == cmdRead && r.Length <= MaxPayload:
		j.cost = int64(r.Length)
	}
	c.bytes.acquire(j.cost)
	if r.Type == cmdWrite && j.errno == 0 && r.Length > 0 {
		j.setBuf(int(r.Length))
		if _, err := io.ReadFull(c.br, j.buf); err != nil {
			c.bytes.release(j.cost)
			return err
		}
	}
	return nil
}

// handle runs one request, accounts for it and replies.
func (c *conn) handle(j *job) {
	c.run(j)
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
	if obs := c.srv.Observe; obs != nil {
		obs(c.x.Name, Ops[opIndex(r.Type)], n, j.errno, d)
	}
	// Counted before the reply leaves, so a client that has its reply
	// sees it in Stats.
	c.reply(j)
	c.bytes.release(j.cost)
	putJob(j)
}

// run validates and executes j, leaving the outcome in j. A panic below the
// protocol edge is a bug; it fails this request with EIO instead of taking
// every connection down.
func (c *conn) run(j *job) {
	defer func() {
		if p := recover(); p != nil {
			stack := debug.Stack()
			c.log.Error("nbd request panicked", "op", Ops[opIndex(j.req.Type)], "panic", p, "stack", string(stack))
			if h := c.srv.OnPanic; h != nil {
				h(p, stack)
			}
			j.errno, j.msg, j.hasErrOff = EIO, "internal server error", false
		}
	}()
	if j.errno != 0 {
		return
	}
	r := &j.req
	if j.errno, j.msg = c.check(r); j.errno != 0 {
		return
	}
	x := c.x
	off, n := int64(r.Offset), int64(r.Length)
	fua := r.Flags&cfFUA != 0
	var err error
	switch r.Type {
	case cmdRead:
		if n == 0 {
			return
		}
		j.setBuf(int(n))
		j.errOff, err = x.readAt(j.buf, off)
		j.hasErrOff = err != nil
	case cmdWrite:
		if n == 0 {
			return
		}
		err = x.WriteAt(j.buf, off, fua)
	case cmdFlush:
		err = x.FlushAll()
	case cmdTrim:
		if n == 0 {
			return
		}
		err = x.Trim(off, n, fua)
	case cmdWriteZeroes:
		if n == 0 {
			return
		}
		err = x.WriteZeroes(off, n, r.Flags&cfNoHole == 0, r.Flags&cfFastZero != 0, fua)
	case cmdCache:
		err = x.Cache(off, n)
	case cmdBlockStatus:
		limit := maxExtents
		if r.Flags&cfReqOne != 0 {
			limit = 1
		}
		j.exts, err = x.blockStatus(off, n, limit, j.exts[:0])
	}
	if err != nil {
		j.errno = errnoOf(err, r.Type == cmdWriteZeroes && r.Flags&cfFastZero != 0)
		j.msg = err.Error()
		c.log.Debug("nbd request failed", "op", Ops[r.Type], "offset", off, "length", n, "errno", j.errno, "err", err)
	}
}

// check validates a request at the protocol edge, so that Export methods
// only ever see in-range requests with meaningful flags. It returns the
// spec's errno and a message for the client, or 0.
func (c *conn) check(r *request) (uint32, string) {
	if r.Type >= numCmds || r.Type == cmdDisc {
		return EINVAL, "unknown command"
	}
	writes := r.Type == cmdWrite || r.Type == cmdTrim || r.Type == cmdWriteZeroes
	if writes && c.x.ReadOnly {
		return EPERM, "export is read-only"
	}
	allowed := cfFUA
	switch r.Type {
	case cmdRead:
		if c.structured {
			allowed |= cfDF // one OFFSET_DATA chunk is all we ever send
		}
	case cmdWriteZeroes:
		allowed |= cfNoHole | cfFastZero
	case cmdBlockStatus:
		allowed |= cfReqOne
	}
	if r.Flags&^allowed != 0 {
		return EINVAL, "command flag not valid for this command"
	}
	switch r.Type {
	case cmdFlush:
		if r.Offset != 0 || r.Length != 0 {
			return EINVAL, "flush offset and length must be zero"
		}
		return 0, ""
	case cmdRead:
		if r.Length > MaxPayload {
			return EINVAL, "read exceeds maximum payload"
		}
	case cmdBlockStatus:
		if !c.meta {
			return EINVAL, "no metadata context negotiated"
		}
		if r.Length == 0 {
			return EINVAL, "zero-length block status"
		}
	}
	size := uint64(c.x.Size())
	if r.Offset > size || uint64(r.Length) > size-r.Offset {
		if r.Type == cmdWrite || r.Type == cmdWriteZeroes {
			return ENOSPC, "write beyond the end of the export"
		}
		return EINVAL, "request beyond the end of the export"
	}
	return 0, ""
}

// errnoOf maps an error from an Export operation to the NBD error sent to
// the client; it is the only such mapping. fastZero says the request was a
// WRITE_ZEROES with FAST_ZERO, the only request that may fail with ENOTSUP.
// Error targets (table.ErrTarget), short reads and I/O errors are EIO.
func errnoOf(err error, fastZero bool) uint32 {
	switch {
	case err == nil:
		return 0
	case errors.Is(err, backing.ErrNotSupported) || errors.Is(err, syscall.EOPNOTSUPP):
		if fastZero {
			return ENOTSUP
		}
		return EIO
	case errors.Is(err, syscall.ENOSPC) || errors.Is(err, syscall.EDQUOT) || errors.Is(err, syscall.EFBIG):
		return ENOSPC
	case errors.Is(err, syscall.EPERM) || errors.Is(err, syscall.EROFS) || errors.Is(err, syscall.EACCES):
		return EPERM
	case errors.Is(err, syscall.ENOMEM):
		return ENOMEM
	}
	return EIO
}

// reply sends j's reply: a simple reply, or, once structured replies are
// negotiated, a single final chunk for reads, block status and errors.
func (c *conn) reply(j *job) {
	r := &j.req
	b := j.out[:0]
	var data []byte
	switch {
	case j.errno != 0 && c.structured:
		b = appendErrorChunk(b, r.Handle, j.errno, j.msg, j.hasErrOff, uint64(j.errOff))
	case j.errno != 0:
		b = appendSimpleReply(b, r.Handle, j.errno)
	case r.Type == cmdRead && c.structured && r.Length == 0:
		b = appendChunkHeader(b, r.Handle, replyFlagDone, chunkNone, 0)
	case r.Type == cmdRead && c.structured:
		b = appendChunkHeader(b, r.Handle, replyFlagDone, chunkOffsetData, 8+r.Length)
		b = appendU64(b, r.Offset)
		data = j.buf
	case r.Type == cmdRead:
		b = appendSimpleReply(b, r.Handle, 0)
		data = j.buf
	case r.Type == cmdBlockStatus:
		b = appendBlockStatusChunk(b, r.Handle, metaBaseID, j.exts)
	default:
		b = appendSimpleReply(b, r.Handle, 0)
	}
	j.out = b
	c.send(b, data)
}

// send writes one reply. Whoever leaves the lock with no other reply waiting
// flushes, so a burst of completions goes out in few writes while a lone
// reply is never held back.
func (c *conn) send(hdr, data []byte) {
	c.pending.Add(1)
	c.wmu.Lock()
	if c.werr == nil {
		_, c.werr = c.bw.Write(hdr)
	}
	if c.werr == nil && len(data) > 0 {
		_, c.werr = c.bw.Write(data)
	}
	if c.pending.Add(-1) == 0 && c.werr == nil {
		c.werr = c.bw.Flush()
	}
	failed := c.werr
	c.wmu.Unlock()
	if failed != nil {
		// The client is gone or stuck: wake the reader so the connection
		// winds down; the other connections are not affected.
		c.nc.Close()
	}
}

// budget bounds the bytes of buffers a connection's requests hold. Only
// the holder of the read token acquires; any goroutine releases.
type budget struct {
	mu    sync.Mutex
	cond  sync.Cond
	bytes int64
}

func (b *budget) init(bytes int64) {
	b.cond.L = &b.mu
	b.bytes = bytes
}

func (b *budget) acquire(n int64) {
	b.mu.Lock()
	for b.bytes < n {
		b.cond.Wait()
	}
	b.bytes -= n
	b.mu.Unlock()
}

func (b *budget) release(n int64) {
	if n == 0 {
		return
	}
	b.mu.Lock()
	b.bytes += n
	b.mu.Unlock()
	b.cond.Signal()
}

// job is one request on its way through a worker. Jobs and their buffers
// are pooled, so steady-state I/O allocates almost nothing per request.
type job struct {
	req   request
	start time.Time
	cost  int64 // budget bytes held

	bufp *[]byte // pooled payload or read buffer
	buf  []byte  // (*bufp)[:req.Length]

	errno     uint32
	msg       string
	errOff    int64 // virtual offset of a read error, with hasErrOff
	hasErrOff bool

	exts []BlockExtent // block status result, reused
	out  []byte        // encoded reply header, reused
}

var jobPool = sync.Pool{New: func() any { return &job{out: make([]byte, 0, 64)} }}

func getJob() *job { return jobPool.Get().(*job) }

func putJob(j *job) {
	if j.bufp != nil {
		putBuf(j.bufp)
	}
	exts, out := j.exts[:0], j.out[:0]
	if cap(exts) > maxExtents {
		exts = nil
	}
	*j = job{exts: exts, out: out}
	jobPool.Put(j)
}

func (j *job) setBuf(n int) {
	j.bufp = getBuf(n)
	j.buf = (*j.bufp)[:n]
}
