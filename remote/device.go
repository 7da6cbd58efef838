package remote

import (
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"net"
	"runtime/debug"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/nbdmapper/nbdmapper/backing"
	"github.com/nbdmapper/nbdmapper/wire"
)

// Errors a caller can act on. Each reaches the NBD client as EIO.
var (
	// ErrTimeout fails a request that got no answer within Options.Timeout,
	// retries on new connections included.
	ErrTimeout = errors.New("no answer from the remote within the request deadline")
	// ErrUnflushedLost fails every flush of a remote after a connection
	// to it dropped, or was made anew, while writes it had acknowledged
	// were not yet flushed: if the remote restarted, they are gone, and
	// no later flush can vouch for them. It is sticky, like a failed
	// fdatasync (docs/remote.md).
	ErrUnflushedLost = errors.New("writes the remote acknowledged were not flushed before its connection dropped; they may be lost")
	// ErrNoFlush refuses to open for writing a remote that does not
	// advertise SEND_FLUSH: nothing could make its writes durable.
	ErrNoFlush = errors.New("remote export does not advertise SEND_FLUSH, so its writes cannot be made durable (serve it --read-only, or enable flush on the server)")
	// ErrExportChanged refuses a reconnection to an export whose size,
	// flags or block sizes are not what they were.
	ErrExportChanged = errors.New("remote export changed since it was opened")

	errClosed = errors.New("remote device closed")
)

// Defaults of Options.
const (
	DefaultConnections = 4
	DefaultTimeout     = 30 * time.Second
	DefaultBackoffMin  = 50 * time.Millisecond
	DefaultBackoffMax  = 5 * time.Second
	DefaultQueueDepth  = 64
	DefaultDialTimeout = 10 * time.Second
)

// Options configure the devices a Scheme opens.
type Options struct {
	// Connections is how many connections to open to an export that
	// advertises CAN_MULTI_CONN; others get one.
	Connections int
	// Timeout bounds every request from its first send to its answer,
	// waiting for a reconnection and sending it again included; then it
	// fails with ErrTimeout (EIO). A request without a reply for this
	// long also ends its connection, as the remote seems hung.
	Timeout time.Duration
	// BackoffMin and BackoffMax bound the wait between reconnection
	// attempts, which doubles from the first to the second.
	BackoffMin, BackoffMax time.Duration
	// QueueDepth is how many requests each connection has in flight at
	// most; more wait for a slot (within their deadline).
	QueueDepth int
	// DialTimeout bounds one connection attempt, TLS and handshake
	// included.
	DialTimeout time.Duration
	// Logger gets connection losses, reconnections and failures.
	Logger *slog.Logger
	// OnPanic gets the value and stack of a panic recovered on a
	// connection's goroutines or in a device call.
	OnPanic func(v any, stack []byte)
}

func (o Options) withDefaults() Options {
	if o.Connections <= 0 {
		o.Connections = DefaultConnections
	}
	if o.Timeout <= 0 {
		o.Timeout = DefaultTimeout
	}
	if o.BackoffMin <= 0 {
		o.BackoffMin = DefaultBackoffMin
	}
	if o.BackoffMax < o.BackoffMin {
		o.BackoffMax = max(DefaultBackoffMax, o.BackoffMin)
	}
	if o.QueueDepth <= 0 {
		o.QueueDepth = DefaultQueueDepth
	}
	if o.DialTimeout <= 0 {
		o.DialTimeout = min(DefaultDialTimeout, o.Timeout)
	}
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	return o
}

// Device is an export of another NBD server as a backing.Device: one
// device to the flush engine (a flush sends it one NBD_CMD_FLUSH) and to
// the discard engine (merged TRIMs, cut at its limits), however many table
// lines name it. See the package comment.
type Device struct {
	name     string
	uri      URI
	id       backing.ID
	opts     Options
	readOnly bool
	log      *slog.Logger

	// What the first handshake found; reconnections must find the same.
	x        Export
	size     int64
	minBlock int64     // requests are aligned to it
	blocks   sync.Pool // *[]byte of minBlock bytes, for heads and tails
	maxIO    int64     // longest READ or WRITE
	maxLen   int64     // longest TRIM, WRITE_ZEROES, CACHE, BLOCK_STATUS
	tick     time.Duration

	live    atomic.Pointer[[]*conn] // the connections up now
	mu      sync.Mutex
	conns   []*conn // by slot; nil where down
	changed chan struct{}
	closed  bool
	lastErr string
	closing chan struct{}
	wg      sync.WaitGroup

	sem chan struct{} // a slot per request in flight

	// acked counts writes and zeroings the remote acknowledged without
	// FUA; flushed is acked as it was when the last successful flush was
	// sent. acked > flushed: the remote holds acknowledged
	// writes that are not yet durable.
	acked, flushed atomic.Uint64
	gap            atomic.Pointer[error]

	// Writes that read, modify and write back a block they cover only in
	// part hold rmw; all others that change data share it.
	rmw sync.RWMutex

	observe atomic.Pointer[func(device, op string, d time.Duration)]
	st      counters
}

var (
	_ backing.Device     = (*Device)(nil)
	_ backing.FastZeroer = (*Device)(nil)
	_ backing.Cacher     = (*Device)(nil)
)

type counters struct {
	connects, reconnects, drops, dialErrors atomic.Uint64
	retries, timeouts, errorReplies         atomic.Uint64
	requests                                [wire.NumCmds]atomic.Uint64
	roundTrips                              atomic.Uint64
	roundTripNanos                          atomic.Int64
	lastRoundTrip                           atomic.Int64
}

// Open connects to the export u names (name is how the table wrote it)
// and returns it as a device. The first connection must succeed; further
// ones (for CAN_MULTI_CONN) are made now too, and any that fail are
// retried in the background like lost ones.
func Open(name string, u URI, readOnly bool, opts Options) (*Device, error) {
	opts = opts.withDefaults()
	d := &Device{
		name: name, uri: u, id: backing.ID{URI: u.String()}, opts: opts, readOnly: readOnly,
		log:     opts.Logger.With("remote", name),
		changed: make(chan struct{}),
		closing: make(chan struct{}),
		tick:    min(max(opts.Timeout/8, 10*time.Millisecond), time.Second),
	}
	first, err := d.dial()
	if err != nil {
		return nil, fmt.Errorf("%s: %w", name, err)
	}
	if err := d.setExport(first.x); err != nil {
		first.nc.Close()
		return nil, fmt.Errorf("%s: %w", name, err)
	}
	n := 1
	if first.x.Flags&wire.TfCanMultiConn != 0 {
		n = opts.Connections
	}
	d.conns = make([]*conn, n)
	d.sem = make(chan struct{}, n*opts.QueueDepth)
	d.live.Store(new([]*conn))
	up := make([]*conn, n)
	up[0] = first
	var wg sync.WaitGroup
	for i := 1; i < n; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			cn, err := d.redial()
			if err != nil {
				d.st.dialErrors.Add(1)
				d.setErr(err)
				d.log.Warn("remote connection failed; retrying in the background", "slot", i, "err", err)
				return
			}
			up[i] = cn
		}()
	}
	wg.Wait()
	for i, cn := range up {
		if cn != nil {
			d.attach(i, cn, true)
		}
		d.wg.Add(1)
		go d.keep(i, cn)
	}
	d.log.Info("remote export", "uri", d.id.URI, "bytes", d.size, "connections", n,
		"flags", fmt.Sprintf("%#x", d.x.Flags), "min_block", d.minBlock, "max_io", d.maxIO, "block_status", d.x.Meta)
	return d, nil
}

// setExport checks what the first handshake found and derives the request
// limits from it.
// minMaxBlock is the least maximum block size a remote may advertise for an
// export larger than it: proto.md expects at least 1 MiB, and a much smaller
// one would cut every request into thousands of round trips.
const minMaxBlock = 64 << 10

func (d *Device) setExport(x Export) error {
	writable := !d.readOnly && x.Flags&wire.TfReadOnly == 0
	if writable && x.Flags&wire.TfSendFlush == 0 {
		return ErrNoFlush
	}
	d.x = x
	d.minBlock = max(int64(x.MinBlock), wire.DefaultMinBlock)
	if x.Size > 1<<62 || int64(x.Size)%d.minBlock != 0 {
		return fmt.Errorf("export size %d is not a multiple of its minimum block size %d: %w", x.Size, d.minBlock, ErrProtocol)
	}
	d.size = int64(x.Size)
	if x.MaxBlock != 0 && x.MaxBlock < minMaxBlock && uint64(x.MaxBlock) < x.Size {
		return fmt.Errorf("maximum block size %d, below %d: %w", x.MaxBlock, minMaxBlock, ErrProtocol)
	}
	maxLen := int64(1<<32 - 1)
	if x.MaxBlock != 0 {
		maxLen = int64(x.MaxBlock)
	}
	align := max(d.minBlock, 4096)
	if maxLen >= align {
		maxLen = maxLen / align * align
	} else {
		maxLen = maxLen / d.minBlock * d.minBlock
	}
	d.maxLen = max(maxLen, d.minBlock)
	d.maxIO = max(min(d.maxLen, wire.InteropPayload)/d.minBlock*d.minBlock, d.minBlock)
	return nil
}

// same checks that a reconnection found the export as it was.
func (d *Device) same(x Export) error {
	const relevant = wire.TfReadOnly | wire.TfSendFlush | wire.TfSendFUA | wire.TfSendTrim |
		wire.TfSendWriteZeroes | wire.TfSendFastZero | wire.TfSendCache | wire.TfCanMultiConn
	if x.Size != d.x.Size || x.Flags&relevant != d.x.Flags&relevant || x.MinBlock != d.x.MinBlock ||
		x.MaxBlock != d.x.MaxBlock || x.Structured != d.x.Structured || x.Meta != d.x.Meta {
		return fmt.Errorf("%w: size %d, flags %#x, block sizes %d/%d, block status %v; was %d, %#x, %d/%d, %v",
			ErrExportChanged, x.Size, x.Flags, x.MinBlock, x.MaxBlock, x.Meta,
			d.x.Size, d.x.Flags, d.x.MinBlock, d.x.MaxBlock, d.x.Meta)
	}
	return nil
}

// dial makes one connection: connect, TLS and handshake within
// DialTimeout.
func (d *Device) dial() (*conn, error) {
	nd := net.Dialer{Timeout: d.opts.DialTimeout, KeepAlive: 15 * time.Second}
	nc, err := nd.Dial(d.uri.Network(), d.uri.Addr())
	if err != nil {
		return nil, err
	}
	nc.SetDeadline(time.Now().Add(d.opts.DialTimeout))
	ho := HandshakeOptions{Export: d.uri.Export, Structured: true}
	if d.uri.TLS {
		if ho.TLS, err = d.uri.tlsConfig(); err != nil {
			nc.Close()
			return nil, err
		}
	}
	tc, x, err := HandshakeConn(nc, ho)
	if err != nil {
		nc.Close()
		return nil, err
	}
	tc.SetDeadline(time.Time{})
	return newConn(d, tc, x), nil
}

// attach makes cn the live connection of slot. A connection made anew
// while the remote holds acknowledged, unflushed writes may be to a
// remote that restarted and lost them: no flush can vouch for them now.
func (d *Device) attach(slot int, cn *conn, initial bool) bool {
	cn.start()
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		cn.fail(errClosed)
		return false
	}
	if !initial {
		d.st.reconnects.Add(1)
		d.checkGapLocked("reconnected")
	}
	d.st.connects.Add(1)
	d.conns[slot] = cn
	d.publishLocked()
	return true
}

// lost is told by a connection's reader that the connection ended, before
// the requests on it are sent again.
func (d *Device) lost(cn *conn, cause error) {
	d.mu.Lock()
	for i, c := range d.conns {
		if c == cn {
			d.conns[i] = nil
		}
	}
	closed := d.closed
	if !closed {
		d.st.drops.Add(1)
		d.lastErr = fmt.Sprint(cause)
		d.checkGapLocked("connection lost")
	}
	d.publishLocked()
	d.mu.Unlock()
	if !closed {
		d.log.Warn("remote connection lost", "err", cause, "up_for", time.Since(cn.since).Round(time.Millisecond))
	}
}

// checkGapLocked fails the device's flushes from now on if the remote
// holds acknowledged writes that no flush covered. d.mu is held.
func (d *Device) checkGapLocked(what string) {
	acked, flushed := d.acked.Load(), d.flushed.Load()
	if acked <= flushed || d.gap.Load() != nil {
		return
	}
	err := fmt.Errorf("%s: %s with %d acknowledged writes unflushed: %w", d.name, what, acked-flushed, ErrUnflushedLost)
	d.gap.Store(&err)
	d.log.Error("remote writes may be lost: every later flush of this remote fails", "err", err)
}

func (d *Device) gapErr() error {
	if p := d.gap.Load(); p != nil {
		return *p
	}
	return nil
}

// flushedUpTo records a successful flush sent when acked was start.
func (d *Device) flushedUpTo(start uint64) {
	for {
		old := d.flushed.Load()
		if start <= old || d.flushed.CompareAndSwap(old, start) {
			return
		}
	}
}

// publishLocked makes the live connections visible to pick and wakes
// requests waiting for one. d.mu is held.
func (d *Device) publishLocked() {
	live := make([]*conn, 0, len(d.conns))
	for _, c := range d.conns {
		if c != nil {
			live = append(live, c)
		}
	}
	d.live.Store(&live)
	close(d.changed)
	d.changed = make(chan struct{})
}

func (d *Device) setErr(err error) {
	d.mu.Lock()
	d.lastErr = err.Error()
	d.mu.Unlock()
}

// keep keeps slot connected: once its connection is gone it reconnects,
// waiting BackoffMin, then twice as long after each failure up to
// BackoffMax (with jitter), until the device closes. Each attempt is
// bounded by DialTimeout; requests meanwhile wait within their own
// deadlines, on other connections or for this one.
func (d *Device) keep(slot int, cn *conn) {
	defer d.wg.Done()
	defer func() {
		// A panic here is a bug; the slot must not stay down for it.
		if v := recover(); v != nil {
			if d.opts.OnPanic != nil {
				d.opts.OnPanic(v, debug.Stack())
			}
			d.mu.Lock()
			closed := d.closed
			if !closed {
				d.wg.Add(1)
			}
			d.mu.Unlock()
			if !closed {
				go d.keep(slot, cn)
			}
		}
	}()
	backoff := d.opts.BackoffMin
	for {
		if cn != nil {
			select {
			case <-cn.gone:
			case <-d.closing:
				<-cn.gone
				return
			}
			if time.Since(cn.since) > d.opts.BackoffMax {
				backoff = d.opts.BackoffMin // it was up a while: start again from the shortest wait
			}
			cn = nil
		}
		wait := backoff/2 + rand.N(backoff/2+1)
		select {
		case <-d.closing:
			return
		case <-time.After(wait):
		}
		backoff = min(2*backoff, d.opts.BackoffMax)
		c, err := d.redial()
		if err != nil {
			d.st.dialErrors.Add(1)
			d.setErr(err)
			d.log.Debug("remote reconnection failed", "slot", slot, "err", err, "next_in", backoff)
			continue
		}
		if !d.attach(slot, c, false) {
			<-c.gone
			return
		}
		d.log.Info("remote reconnected", "slot", slot)
		cn = c
	}
}

// redial is dial plus the check that the export is unchanged, with a
// panic in either contained.
func (d *Device) redial() (cn *conn, err error) {
	defer func() {
		if v := recover(); v != nil {
			if d.opts.OnPanic != nil {
				d.opts.OnPanic(v, debug.Stack())
			}
			cn, err = nil, fmt.Errorf("%w: %v", backing.ErrPanic, v)
		}
	}()
	c, err := d.dial()
	if err != nil {
		return nil, err
	}
	if err := d.same(c.x); err != nil {
		c.nc.Close()
		return nil, err
	}
	return c, nil
}

// pick returns the live connection with the fewest requests in flight,
// waiting for one until deadline.
func (d *Device) pick(deadline time.Time) (*conn, error) {
	var timer *time.Timer
	for {
		var best *conn
		for _, c := range *d.live.Load() {
			if best == nil || c.inflight.Load() < best.inflight.Load() {
				best = c
			}
		}
		if best != nil {
			return best, nil
		}
		d.mu.Lock()
		closed, ch, up := d.closed, d.changed, len(*d.live.Load()) > 0
		d.mu.Unlock()
		if closed {
			return nil, errClosed
		}
		if up {
			continue
		}
		if timer == nil {
			timer = time.NewTimer(time.Until(deadline))
			defer timer.Stop()
		}
		select {
		case <-ch:
		case <-timer.C:
			return nil, ErrTimeout
		case <-d.closing:
		}
	}
}

var callPool = sync.Pool{New: func() any { return &call{done: make(chan struct{}, 1)} }}

func newCall(typ, flags uint16, off, n int64) *call {
	c := callPool.Get().(*call)
	c.req = wire.Request{Type: typ, Flags: flags, Offset: uint64(off), Length: uint32(n)}
	return c
}

func putCall(c *call) {
	c.payload, c.buf, c.deadline = nil, nil, time.Time{}
	c.reset()
	callPool.Put(c)
}

// do sends c and waits for its answer, sending it again on another
// connection each time the one it went out on drops, until its deadline.
func (d *Device) do(c *call) error {
	if c.deadline.IsZero() {
		c.deadline = time.Now().Add(d.opts.Timeout)
	}
	select {
	case d.sem <- struct{}{}:
	default:
		t := time.NewTimer(time.Until(c.deadline))
		select {
		case d.sem <- struct{}{}:
			t.Stop()
		case <-t.C:
			return d.failed(c, ErrTimeout)
		case <-d.closing:
			t.Stop()
			return d.failed(c, errClosed)
		}
	}
	defer func() { <-d.sem }()
	d.st.requests[c.req.Type].Add(1)
	for attempt := 0; ; attempt++ {
		if c.req.Type == wire.CmdFlush {
			if err := d.gapErr(); err != nil {
				return err
			}
			c.flushStart = d.acked.Load()
		}
		cn, err := d.pick(c.deadline)
		if err != nil {
			return d.failed(c, err)
		}
		if attempt > 0 {
			d.st.retries.Add(1)
		}
		c.reset()
		if !cn.send(c) {
			// Dead, and not yet taken out of the live set: wait for that.
			select {
			case <-cn.gone:
			case <-time.After(time.Until(c.deadline)):
			}
			if !time.Now().Before(c.deadline) {
				return d.failed(c, ErrTimeout)
			}
			continue
		}
		<-c.done
		switch {
		case c.err == nil && c.req.Type == wire.CmdFlush:
			if err := d.gapErr(); err != nil {
				return err // a connection dropped dirty while this flush ran
			}
			return d.replyErr(c)
		case c.err == nil:
			return d.replyErr(c)
		case !time.Now().Before(c.deadline):
			return d.failed(c, ErrTimeout)
		}
	}
}

func (d *Device) failed(c *call, err error) error {
	if errors.Is(err, ErrTimeout) {
		d.st.timeouts.Add(1)
	}
	return fmt.Errorf("%s: %s %d+%d: %w", d.name, cmdName(c.req.Type), c.req.Offset, c.req.Length, err)
}

// ReplyError is an error reply from the remote. It unwraps to the errno,
// so that the NBD client gets the same error (EIO for values NBD does not
// define).
type ReplyError struct {
	Device string
	Op     string
	Off    uint64
	Len    uint32
	Errno  syscall.Errno
	Msg    string
}

func (e *ReplyError) Error() string {
	s := fmt.Sprintf("%s: %s %d+%d: remote error %v", e.Device, e.Op, e.Off, e.Len, e.Errno)
	if e.Msg != "" {
		s += ": " + e.Msg
	}
	return s
}

func (e *ReplyError) Unwrap() error { return e.Errno }

func (d *Device) replyErr(c *call) error {
	if c.errno == 0 {
		return nil
	}
	errno := syscall.Errno(c.errno)
	switch c.errno {
	case wire.EPERM, wire.EIO, wire.ENOMEM, wire.EINVAL, wire.ENOSPC, wire.EOVERFLOW, wire.ENOTSUP, wire.ESHUTDOWN:
	default:
		errno = syscall.EIO
	}
	return &ReplyError{Device: d.name, Op: cmdName(c.req.Type), Off: c.req.Offset, Len: c.req.Length, Errno: errno, Msg: c.msg}
}

// roundTrip records a request's time from send to last reply.
func (d *Device) roundTrip(cmd uint16, took time.Duration) {
	d.st.roundTrips.Add(1)
	d.st.roundTripNanos.Add(int64(took))
	d.st.lastRoundTrip.Store(int64(took))
	if fn := d.observe.Load(); fn != nil {
		(*fn)(d.name, cmdName(cmd), took)
	}
}

// Close ends every connection (NBD_CMD_DISC first) and stops
// reconnecting; requests still waiting fail.
func (d *Device) Close() error {
	d.mu.Lock()
	if d.closed {
		d.mu.Unlock()
		return nil
	}
	d.closed = true
	close(d.closing)
	conns := append([]*conn(nil), d.conns...)
	d.mu.Unlock()
	for _, c := range conns {
		if c != nil {
			c.disconnect()
		}
	}
	d.wg.Wait()
	return nil
}

func (d *Device) isClosed() bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.closed
}

func (d *Device) Name() string   { return d.name }
func (d *Device) ID() backing.ID { return d.id }
func (d *Device) Size() int64    { return d.size }

// URI is the export's URI in normal form.
func (d *Device) URI() string { return d.id.URI }

// Limits are the remote's: trims aligned to its minimum block size and no
// longer than its maximum (or 4 GiB less 4 KiB, NBD's 32-bit length, when it
// states none). A request holds up to two of its blocks here.
func (d *Device) Limits() backing.Limits {
	return backing.Limits{Granularity: d.minBlock, MaxBytes: d.maxLen, RequestMemory: d.requestMemory()}
}

func (d *Device) writable() error {
	if d.readOnly || d.x.Flags&wire.TfReadOnly != 0 {
		return fmt.Errorf("%s: %w", d.name, syscall.EROFS)
	}
	return nil
}

func (d *Device) flag(f uint16) bool { return d.x.Flags&f != 0 }
