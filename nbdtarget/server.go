package nbdtarget

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"sync"
	"sync/atomic"
	"time"
)

// ErrServerClosed is returned by Serve after Shutdown.
var ErrServerClosed = errors.New("nbdtarget: server closed")

// Server serves Exports over NBD (fixed newstyle) on any number of
// listeners. Each connection negotiates one export and then runs requests
// concurrently on a bounded pool of goroutines, each of which reads a request,
// runs it and replies as it finishes, out of order.
//
// Exports must not change once Serve has been called.
type Server struct {
	Exports []*Export
	Logger  *slog.Logger

	// MaxInFlight bounds the requests one connection has in flight
	// (default 64). MaxInFlightBytes bounds the payload and read buffers
	// they hold (default 64 MiB, at least MaxPayload). When either is
	// reached the server stops reading from that connection until a
	// request completes.
	MaxInFlight      int
	MaxInFlightBytes int64

	// Observe, if set, is called once per completed request (DISC excepted)
	// with the export name, the op name (see Ops), the bytes transferred
	// on success, the NBD errno sent (0 on success) and the time from
	// decoding the request to its completion, just before the reply is
	// written. It runs on the request's worker and must be cheap and safe
	// for concurrent use.
	Observe func(export, op string, bytes int64, errno uint32, d time.Duration)

	// OnPanic, if set, is called with the value and stack of every panic
	// the server recovers from, after it is logged. Fuzzers and soaks set
	// it to fail on a panic the server would otherwise survive silently.
	OnPanic func(v any, stack []byte)

	initOnce sync.Once
	stats    map[*Export]*exportStats

	mu        sync.Mutex
	listeners map[net.Listener]struct{}
	conns     map[*conn]struct{}
	closing   bool
	connWG    sync.WaitGroup
}

func (s *Server) init() {
	s.initOnce.Do(func() {
		s.stats = make(map[*Export]*exportStats, len(s.Exports))
		for _, x := range s.Exports {
			s.stats[x] = new(exportStats)
		}
		if s.Logger == nil {
			s.Logger = slog.New(slog.DiscardHandler)
		}
	})
}

func (s *Server) maxInFlight() int {
	if s.MaxInFlight > 0 {
		return s.MaxInFlight
	}
	return 64
}

func (s *Server) maxInFlightBytes() int64 {
	return max(s.MaxInFlightBytes, 64<<20, MaxPayload)
}

// lookup finds an export by name; "" is the first export (the default
// export that `nbd+unix:///?socket=...` asks for).
func (s *Server) lookup(name string) *Export {
	if name == "" && len(s.Exports) > 0 {
		return s.Exports[0]
	}
	for _, x := range s.Exports {
		if x.Name == name {
			return x
		}
	}
	return nil
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
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				// Out of file descriptors and the like: back off, as net/http does.
				delay = min(max(2*delay, 5*time.Millisecond), time.Second)
				s.Logger.Warn("nbd accept", "err", err, "retry", delay)
				time.Sleep(delay)
				continue
			}
			return fmt.Errorf("nbd accept: %w", err)
		}
		delay = 0
		c := s.newConn(nc)
		if c == nil {
			continue
		}
		go c.serve()
	}
}

func (s *Server) newConn(nc net.Conn) *conn {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closing {
		nc.Close()
		return nil
	}
	if s.conns == nil {
		s.conns = make(map[*conn]struct{})
	}
	c := &conn{
		srv: s,
		nc:  nc,
		br:  bufio.NewReaderSize(nc, 64<<10),
		bw:  bufio.NewWriterSize(nc, 64<<10),
		log: s.Logger.With("remote", nc.RemoteAddr().String()),
	}
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
	s.mu.Lock()
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
	select {
	case <-done:
		return nil
	case <-ctx.Done():
		s.mu.Lock()
		for c := range s.conns {
			c.nc.Close()
		}
		s.mu.Unlock()
		<-done
		return ctx.Err()
	}
}

// Stats is a snapshot of the server's counters, one entry per export in the
// order of Server.Exports.
type Stats struct {
	Exports []ExportStats
}

// ExportStats counts one export's traffic since the server started.
type ExportStats struct {
	Name             string
	Connections      int64 // connections in the transmission phase now
	ConnectionsTotal int64 // connections that ever reached transmission
	InFlight         int64 // requests decoded and not yet replied to
	Ops              map[string]OpStats
}

// OpStats counts completed requests of one op (see Ops).
type OpStats struct {
	Requests int64
	Bytes    int64            // bytes read, written, trimmed, zeroed, cached or queried, on success
	Errors   map[uint32]int64 // error replies by NBD errno; absent when none
	Duration time.Duration    // total time from decode to reply
}

// Ops are the op names used in Stats and Observe, indexed by NBD command;
// "unknown" counts commands the protocol does not define.
var Ops = [numCmds + 1]string{
	cmdRead:        "read",
	cmdWrite:       "write",
	cmdDisc:        "disc",
	cmdFlush:       "flush",
	cmdTrim:        "trim",
	cmdCache:       "cache",
	cmdWriteZeroes: "write_zeroes",
	cmdBlockStatus: "block_status",
	numCmds:        "unknown",
}

func opIndex(cmd uint16) int {
	if cmd < numCmds {
		return int(cmd)
	}
	return numCmds
}

// errnos are the values counted individually; anything else counts as EIO's
// neighbour slot "other" (which cannot happen: errnoOf only returns these).
var errnos = [...]uint32{EPERM, EIO, ENOMEM, EINVAL, ENOSPC, EOVERFLOW, ENOTSUP, ESHUTDOWN}

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
	ops                         [numCmds + 1]opCounters
}

// Stats returns a snapshot of the counters. Counters are read one by one,
// so a snapshot taken under load is not a single instant.
func (s *Server) Stats() Stats {
	s.init()
	out := Stats{Exports: make([]ExportStats, 0, len(s.Exports))}
	for _, x := range s.Exports {
		st := s.stats[x]
		es := ExportStats{
			Name:             x.Name,
			Connections:      st.conns.Load(),
			ConnectionsTotal: st.connsTotal.Load(),
			InFlight:         st.inFlight.Load(),
			Ops:              make(map[string]OpStats),
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
					e := EIO
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
