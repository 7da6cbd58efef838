package nbdtarget

import (
	"bufio"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sync/semaphore"

	"github.com/nbdmapper/nbdmapper/wire"
)

// ErrServerClosed is returned by Serve after Shutdown.
var ErrServerClosed = errors.New("nbdtarget: server closed")

// Server serves Exports over NBD (fixed newstyle) on any number of
// listeners. Each connection negotiates one export and then runs requests
// concurrently on a bounded pool of goroutines, each of which reads a request,
// runs it and replies as it finishes, out of order.
//
// Exports are the exports served from the start; AddExport and
// RemoveExport change the set while serving.
type Server struct {
	Exports []*Export
	Logger  *slog.Logger

	// MaxInFlight bounds the requests one connection has in flight
	// (default 64). MaxInFlightBytes bounds the memory they hold (default
	// 64 MiB, at least the largest request's cost). When either is reached the server stops
	// reading from that connection until a request completes.
	MaxInFlight      int
	MaxInFlightBytes int64

	// Memory bounds the memory every request of every connection holds
	// together: payload and read buffers and each request's working set
	// (see cost). Default DefaultMemory; at least the largest request's
	// cost, a little over MaxPayload. A quarter of it is kept for exports
	// whose requests find the rest all taken, a request of each at a time
	// (reserve.go). A request that does not fit waits, in arrival order;
	// it is not failed.
	Memory int64

	// ExportMemory bounds the memory the requests of one export hold
	// together, so that an export whose device hangs (its requests keep
	// their buffers while they wait) or whose clients are many cannot hold
	// all of Memory and stall every other export. Default half of Memory;
	// at least the largest request's cost, at most Memory.
	ExportMemory int64

	// MaxConnections bounds the connections open at once, handshakes
	// included (default DefaultMaxConnections); the excess is closed at
	// once, before the greeting, and counted in Stats.Refused.
	MaxConnections int

	// HandshakeTimeout closes a connection that has not finished the
	// handshake in time (default DefaultHandshakeTimeout).
	HandshakeTimeout time.Duration

	// ReplyTimeout closes a connection whose client takes none of its
	// replies for this long (default DefaultReplyTimeout), or has not sent
	// the rest of a write's payload in this long, either of which would
	// otherwise pin the memory of its requests.
	ReplyTimeout time.Duration

	// OnPanic, if set, is called with every panic recovered from request
	// code (see Panicked), after it has been logged and turned into an EIO
	// reply.
	OnPanic func(v any, stack []byte)

	// Observe, if set, is called once per completed request (DISC excepted)
	// with the export name, the op name (see Ops), the bytes transferred
	// on success, the NBD errno sent (0 on success) and the time from
	// decoding the request to its completion, just before the reply is
	// written. It runs on the request's worker and must be cheap and safe
	// for concurrent use.
	Observe func(export, op string, bytes int64, errno uint32, d time.Duration)

	// TLSConfig, if set, is offered to clients through NBD_OPT_STARTTLS
	// (Certs.Config gives one whose certificates can be reloaded), and TLS
	// says whether they must take it. Without TLSConfig STARTTLS gets
	// ERR_UNSUP, so TLSRequire then admits nobody.
	TLSConfig *tls.Config
	TLS       TLSMode

	// NoSplice reads every request into a buffer; by default large reads
	// on plain sockets are spliced from the page cache into the socket
	// (see spliceMin). A benchmark baseline.
	NoSplice bool
	pipes    pipePool

	// OnActive, if set, is called with the number of connections in the
	// transmission phase, over all exports, each one writing in bulk
	// (conn.bulk) or waiting out of the network poller (conn.followPoller)
	// counted twice, each time it changes; the calls come one at a time, in
	// the order of the changes.
	OnActive func(conns int)
	activeMu sync.Mutex
	active   int
	// transmitting counts the connections in the transmission phase.
	transmitting atomic.Int32
	// crowded: more connections transmit (as OnActive counts them) than
	// there are Ps to run them, so the CPU is what they wait for.
	crowded atomic.Bool

	initOnce sync.Once
	exports  atomic.Pointer[[]*Export] // Exports, then as AddExport and RemoveExport leave it
	mem      *semaphore.Weighted       // Memory but the reserve
	reserve  *memReserve               // the rest, for exports that find mem all taken (reserve.go)
	budgets  map[*Export]*exportBudget // each export's (ExportMemory); under mu
	counters serverCounters

	// serialHandOver, a time.Duration, replaces handOverAfter when set:
	// tests set it long, since a loaded machine may stall a request past
	// 1 ms, and short where a request must hand reading on.
	serialHandOver atomic.Int64
	// afterSerialReply, set by tests before serving, runs after each reply
	// of a serial request, before the next request is read.
	afterSerialReply func()
	// beforeTransmit, set by tests before serving, runs after a
	// connection's handshake, before its transmission phase reads.
	beforeTransmit func(*conn)
	// inPoller, set by tests before serving, keeps every socket in the
	// poller (conn.followPoller), for tests of what else OnActive counts.
	inPoller bool

	ticks     atomic.Int64 // advanced by watchReplies every ReplyTimeout/4
	watchOnce sync.Once
	stopWatch chan struct{}

	mu        sync.Mutex
	listeners map[net.Listener]struct{}
	conns     map[*conn]struct{}
	closing   bool
	connWG    sync.WaitGroup
	connGone  sync.Cond // a connection to a removed export ended; with mu
}

func (s *Server) init() {
	s.initOnce.Do(func() {
		list := slices.Clone(s.Exports)
		s.exports.Store(&list)
		s.connGone.L = &s.mu
		if s.Logger == nil {
			s.Logger = slog.New(slog.DiscardHandler)
		}
		common, reserve := splitMemory(s.memory())
		s.mem = semaphore.NewWeighted(common)
		s.reserve = newMemReserve(reserve)
		s.stopWatch = make(chan struct{})
	})
}

// watchReplies closes connections that have been writing one hold of
// replies for ReplyTimeout, whose clients stopped reading, and those whose
// reader has waited that long for a payload, whose clients stopped
// sending. It ticks four times per ReplyTimeout and closes a connection
// once five ticks have passed since its write or its wait began, so
// between ReplyTimeout and 1.25 times it.
func (s *Server) watchReplies() {
	t := time.NewTicker(s.replyTimeout() / 4)
	defer t.Stop()
	for {
		select {
		case <-s.stopWatch:
			return
		case <-t.C:
		}
		now := s.ticks.Add(1)
		s.mu.Lock()
		for c := range s.conns {
			if since := c.writeSince.Load(); since != 0 && now-(since-1) >= 5 {
				c.replyStuck()
			}
			if since := c.payloadSince.Load(); since != 0 && now-(since-1) >= 5 {
				c.payloadStuck()
			}
		}
		s.mu.Unlock()
	}
}

// activeChanged adds d to the connections in transmission, tells
// OnActive and notes whether they now outnumber the Ps (crowded).
func (s *Server) activeChanged(d int) {
	s.activeMu.Lock()
	defer s.activeMu.Unlock()
	s.active += d
	if s.OnActive != nil {
		s.OnActive(s.active)
	}
	s.crowded.Store(s.active > runtime.GOMAXPROCS(0))
}

// Defaults for the Server's limits.
const (
	DefaultMemory           = 256 << 20
	DefaultMaxConnections   = 256
	DefaultHandshakeTimeout = 30 * time.Second
	DefaultReplyTimeout     = 60 * time.Second
)

func (s *Server) memory() int64 {
	if s.Memory > 0 {
		return max(s.Memory, maxCost)
	}
	return DefaultMemory
}

func (s *Server) exportMemory() int64 {
	if s.ExportMemory > 0 {
		return min(max(s.ExportMemory, maxCost), s.memory())
	}
	return max(s.memory()/2, maxCost)
}

func (s *Server) maxConnections() int {
	if s.MaxConnections > 0 {
		return s.MaxConnections
	}
	return DefaultMaxConnections
}

func (s *Server) replyTimeout() time.Duration {
	if s.ReplyTimeout > 0 {
		return s.ReplyTimeout
	}
	return DefaultReplyTimeout
}

func (s *Server) handshakeTimeout() time.Duration {
	if s.HandshakeTimeout > 0 {
		return s.HandshakeTimeout
	}
	return DefaultHandshakeTimeout
}

func (s *Server) handOverAfter() time.Duration {
	if d := time.Duration(s.serialHandOver.Load()); d > 0 {
		return d
	}
	return handOverAfter
}

func (s *Server) maxInFlight() int {
	if s.MaxInFlight > 0 {
		return s.MaxInFlight
	}
	return 64
}

func (s *Server) maxInFlightBytes() int64 {
	if s.MaxInFlightBytes > 0 {
		return max(s.MaxInFlightBytes, maxCost)
	}
	return 64 << 20
}

// lookup finds an export by name; "" is the first export (the default
// export that `nbd+unix:///?socket=...` asks for).
func (s *Server) lookup(name string) *Export {
	list := s.ExportList()
	if name == "" && len(list) > 0 {
		return list[0]
	}
	for _, x := range list {
		if x.Name == name {
			return x
		}
	}
	return nil
}

// ExportList is the exports served now, in the order they were added. The
// slice must not be modified.
func (s *Server) ExportList() []*Export {
	s.init()
	return *s.exports.Load()
}

// Errors of AddExport and RemoveExport.
var (
	ErrExportExists = errors.New("an export of that name exists")
	ErrNoExport     = errors.New("no such export")
	ErrExportBusy   = errors.New("clients are connected to the export")
)

// AddExport serves x from now on.
func (s *Server) AddExport(x *Export) error {
	s.init()
	s.mu.Lock()
	defer s.mu.Unlock()
	list := *s.exports.Load()
	if slices.ContainsFunc(list, func(y *Export) bool { return y.Name == x.Name }) {
		return fmt.Errorf("%w: %q", ErrExportExists, x.Name)
	}
	list = append(slices.Clone(list), x)
	s.exports.Store(&list)
	return nil
}

// RemoveExport stops serving the export called name and returns it. With
// clients connected it fails with ErrExportBusy, unless force: then their
// connections stop reading requests, finish those in flight, reply, and
// close, and RemoveExport returns once they have finished. A connection
// counts out of its export before it closes its socket, so a client that
// has seen its connection end finds the export free (`nbdsh ...; remove`).
func (s *Server) RemoveExport(name string, force bool) (*Export, error) {
	s.init()
	s.mu.Lock()
	defer s.mu.Unlock()
	list := *s.exports.Load()
	i := slices.IndexFunc(list, func(x *Export) bool { return x.Name == name })
	if i < 0 {
		return nil, fmt.Errorf("%w: %q", ErrNoExport, name)
	}
	x := list[i]
	if x.st.conns.Load() > 0 && !force {
		return nil, fmt.Errorf("%w: %d connected to %q", ErrExportBusy, x.st.conns.Load(), name)
	}
	list = slices.Delete(slices.Clone(list), i, i+1)
	s.exports.Store(&list)
	x.removed.Store(true)
	for c := range s.conns {
		if c.x == x {
			c.stopReading()
		}
	}
	for x.st.conns.Load() > 0 {
		s.connGone.Wait()
	}
	delete(s.budgets, x)
	return x, nil
}

// budget returns x's share of the memory (ExportMemory), made when its
// first connection joins. s.mu must be held.
func (s *Server) budget(x *Export) *exportBudget {
	b := s.budgets[x]
	if b == nil {
		if s.budgets == nil {
			s.budgets = make(map[*Export]*exportBudget)
		}
		b = newExportBudget(s.exportMemory())
		s.budgets[x] = b
	}
	return b
}

// Serve accepts connections on l until l fails or Shutdown is called, and
// serves each on its own goroutines. After Shutdown it returns
// ErrServerClosed.
func (s *Server) Serve(l net.Listener) error {
	s.init()
	s.mu.Lock()
	if s.closing {
		s.mu.Unlock()
		return ErrServerClosed
	}
	if s.listeners == nil {
		s.listeners = make(map[net.Listener]struct{})
	}
	s.listeners[l] = struct{}{}
	s.mu.Unlock()
	s.watchOnce.Do(func() { go s.watchReplies() })
	defer func() {
		s.mu.Lock()
		delete(s.listeners, l)
		s.mu.Unlock()
	}()

	var delay time.Duration
	for {
		nc, err := l.Accept()
		if err != nil {
			s.mu.Lock()
			closing := s.closing
			s.mu.Unlock()
			if closing {
				return ErrServerClosed
			}
			if !temporary(err) {
				return fmt.Errorf("nbd accept: %w", err)
			}
			// Out of descriptors or memory, or a client gone before we
			// took it: none of it is the listener's fault. Back off and
			// retry, as net/http does; the backlog keeps waiting clients.
			s.counters.acceptRetries.Add(1)
			delay = min(max(2*delay, 5*time.Millisecond), time.Second)
			s.Logger.Warn("nbd accept", "err", err, "retry", delay)
			time.Sleep(delay)
			continue
		}
		delay = 0
		c := s.newConn(nc)
		if c == nil {
			continue
		}
		go c.serve()
	}
}

// temporary reports whether an Accept error is a passing condition of the
// process or of one client rather than a failed listener.
func temporary(err error) bool {
	var ne net.Error
	if errors.As(err, &ne) && ne.Timeout() {
		return true
	}
	for _, e := range []syscall.Errno{syscall.EMFILE, syscall.ENFILE, syscall.ENOBUFS, syscall.ENOMEM, syscall.ECONNABORTED, syscall.EINTR, syscall.EAGAIN, syscall.EPROTO, syscall.EPERM} {
		if errors.Is(err, e) {
			return true
		}
	}
	return false
}

func (s *Server) newConn(nc net.Conn) *conn {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closing {
		nc.Close()
		return nil
	}
	if len(s.conns) >= s.maxConnections() {
		// Closed before the greeting: the client sees the connection end
		// and may retry; nothing about it is kept.
		s.counters.refused.Add(1)
		nc.Close()
		return nil
	}
	if s.conns == nil {
		s.conns = make(map[*conn]struct{})
	}
	raw := rawConn(nc)
	growSendBuffer(nc, raw)
	sock := socketIO(nc, raw)
	if rs, ok := sock.(*rawSocket); ok {
		// Everything goes through it, so that it can leave the poller.
		nc, raw = rs, rs.rawConn()
	}
	c := &conn{
		srv:  s,
		nc:   nc,
		raw:  raw,
		sock: sock,
		br:   bufio.NewReaderSize(sock, 64<<10),
		bw:   bufio.NewWriterSize(sock, 64<<10),
		log:  s.Logger.With("remote", nc.RemoteAddr().String()),
	}
	c.stopCtx, c.stop = context.WithCancel(context.Background())
	s.conns[c] = struct{}{}
	s.connWG.Add(1)
	return c
}

func (s *Server) dropConn(c *conn) {
	s.mu.Lock()
	delete(s.conns, c)
	s.mu.Unlock()
	s.connWG.Done()
}

// Shutdown stops accepting connections, stops reading new requests on every
// connection, lets requests already read finish and be replied to, closes the
// connections and returns. If ctx ends first, connections are closed at once
// and ctx's error is returned.
func (s *Server) Shutdown(ctx context.Context) error {
	s.init()
	s.mu.Lock()
	if !s.closing {
		close(s.stopWatch)
	}
	s.closing = true
	for l := range s.listeners {
		l.Close()
	}
	for c := range s.conns {
		c.stopReading()
	}
	s.mu.Unlock()

	done := make(chan struct{})
	go func() {
		s.connWG.Wait()
		close(done)
	}()
	var err error
	select {
	case <-done:
	case <-ctx.Done():
		s.mu.Lock()
		for c := range s.conns {
			c.nc.Close()
		}
		s.mu.Unlock()
		<-done
		err = ctx.Err()
	}
	s.pipes.close() // no connection is left to splice
	return err
}

// Panicked logs a panic recovered from device or request code with its
// stack, counts it in Stats.Panics and passes it to OnPanic. The request
// path calls it; give it to the flush and discard engines as their OnPanic
// so that panics on their goroutines are logged and counted the same way.
//
// It may be called before Serve (while tables load).
func (s *Server) Panicked(v any, stack []byte) {
	s.counters.panics.Add(1)
	log := s.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	log.Error("panic in device or request code, answered with EIO", "panic", v, "stack", string(stack))
	if h := s.OnPanic; h != nil {
		h(v, stack)
	}
}

// Stats is a snapshot of the server's counters, one entry per export in the
// order of ExportList.
type Stats struct {
	Exports []ExportStats

	Connections       int64 // connections open now, handshakes included
	Refused           int64 // connections closed at once: MaxConnections reached
	HandshakeTimeouts int64 // connections closed for not finishing the handshake
	ReplyTimeouts     int64 // connections closed for not taking their replies
	PayloadTimeouts   int64 // connections closed for not sending a write's payload
	AcceptRetries     int64 // Accept errors (EMFILE, ...) backed off and retried
	Panics            int64 // panics recovered and turned into EIO
	MemoryInUse       int64 // bytes of Memory held by requests now
	MemoryLimit       int64 // Memory, as in force
	MemoryWaits       int64 // requests that waited for Memory
}

type serverCounters struct {
	refused, handshakeTimeouts, replyTimeouts atomic.Int64
	payloadTimeouts                           atomic.Int64
	acceptRetries, panics                     atomic.Int64
	memInUse, memWaits                        atomic.Int64
}

// ExportStats counts one export's traffic since the server started.
type ExportStats struct {
	Name             string
	Connections      int64 // connections in the transmission phase now
	ConnectionsTotal int64 // connections that ever reached transmission
	InFlight         int64 // requests decoded and not yet replied to
	Ops              map[string]OpStats

	// Structured read replies' content chunks sent, and the bytes the
	// hole chunks covered (sent as holes, not as data).
	ReadDataChunks, ReadHoleChunks, ReadHoleBytes int64

	// ReadSplicedBytes is the bytes of reads sent by splice(2), from the
	// page cache to the socket without a copy in between. A reply is
	// counted once all of it is in the socket, so a client that has it may
	// find it not counted yet.
	ReadSplicedBytes int64

	// SerialRequests counts requests run in serial mode: read and run by
	// one goroutine, with no other reading ahead, for a client that waits
	// for each reply and flushes (conn).
	SerialRequests int64
}

// OpStats counts completed requests of one op (see Ops).
type OpStats struct {
	Requests int64
	Bytes    int64            // bytes read, written, trimmed, zeroed, cached or queried, on success
	Errors   map[uint32]int64 // error replies by NBD errno; absent when none
	Duration time.Duration    // total time from decode to reply
}

// Ops are the op names used in Stats and Observe, indexed by NBD command
// (wire.CmdNames); "unknown" counts commands the protocol does not define.
var Ops = func() (ops [wire.NumCmds + 1]string) {
	copy(ops[:], wire.CmdNames[:])
	ops[wire.NumCmds] = "unknown"
	return ops
}()

func opIndex(cmd uint16) int {
	if cmd < wire.NumCmds {
		return int(cmd)
	}
	return wire.NumCmds
}

// errnos are the values counted individually; anything else counts as EIO's
// neighbour slot "other" (which cannot happen: errnoOf only returns these).
var errnos = [...]uint32{wire.EPERM, wire.EIO, wire.ENOMEM, wire.EINVAL, wire.ENOSPC, wire.EOVERFLOW, wire.ENOTSUP, wire.ESHUTDOWN}

func errnoIndex(e uint32) int {
	for i, v := range errnos {
		if v == e {
			return i
		}
	}
	return len(errnos)
}

type opCounters struct {
	requests, bytes, nanos atomic.Int64
	errors                 [len(errnos) + 1]atomic.Int64
}

type exportStats struct {
	conns, connsTotal, inFlight atomic.Int64
	ops                         [wire.NumCmds + 1]opCounters
	readChunks                  [2]atomic.Int64 // OFFSET_DATA, OFFSET_HOLE
	readHoleBytes               atomic.Int64
	splicedBytes                atomic.Int64
	serial                      atomic.Int64
}

// Stats returns a snapshot of the counters. Counters are read one by one,
// so a snapshot taken under load is not a single instant.
func (s *Server) Stats() Stats {
	s.init()
	s.mu.Lock()
	conns := int64(len(s.conns))
	s.mu.Unlock()
	list := s.ExportList()
	out := Stats{
		Exports:           make([]ExportStats, 0, len(list)),
		Connections:       conns,
		Refused:           s.counters.refused.Load(),
		HandshakeTimeouts: s.counters.handshakeTimeouts.Load(),
		ReplyTimeouts:     s.counters.replyTimeouts.Load(),
		PayloadTimeouts:   s.counters.payloadTimeouts.Load(),
		AcceptRetries:     s.counters.acceptRetries.Load(),
		Panics:            s.counters.panics.Load(),
		MemoryInUse:       s.counters.memInUse.Load(),
		MemoryLimit:       s.memory(),
		MemoryWaits:       s.counters.memWaits.Load(),
	}
	for _, x := range list {
		st := &x.st
		es := ExportStats{
			Name:             x.Name,
			Connections:      st.conns.Load(),
			ConnectionsTotal: st.connsTotal.Load(),
			InFlight:         st.inFlight.Load(),
			Ops:              make(map[string]OpStats),
			ReadDataChunks:   st.readChunks[0].Load(),
			ReadHoleChunks:   st.readChunks[1].Load(),
			ReadHoleBytes:    st.readHoleBytes.Load(),
			ReadSplicedBytes: st.splicedBytes.Load(),
			SerialRequests:   st.serial.Load(),
		}
		for i := range st.ops {
			oc := &st.ops[i]
			n := oc.requests.Load()
			if n == 0 {
				continue
			}
			os := OpStats{Requests: n, Bytes: oc.bytes.Load(), Duration: time.Duration(oc.nanos.Load())}
			for k := range oc.errors {
				if v := oc.errors[k].Load(); v != 0 {
					if os.Errors == nil {
						os.Errors = make(map[uint32]int64)
					}
					e := wire.EIO
					if k < len(errnos) {
						e = errnos[k]
					}
					os.Errors[e] += v
				}
			}
			es.Ops[Ops[i]] = os
		}
		out.Exports = append(out.Exports, es)
	}
	return out
}
