package main

import (
	"flag"
	"fmt"
	"log/slog"
	"os"
	"runtime"
	"runtime/debug"
	"strings"
	"sync"
	"time"

	"github.com/nbdmapper/nbdmapper/nbdtarget"
)

// limitFlags are serve's bounds on what clients can make the server hold.
type limitFlags struct {
	memory           byteSize
	exportMemory     byteSize
	maxConnections   int
	handshakeTimeout time.Duration
	replyTimeout     time.Duration
	descriptions     descriptions
}

func (f *limitFlags) register(fs *flag.FlagSet) {
	f.memory = nbdtarget.DefaultMemory
	fs.Var(&f.memory, "memory", "memory budget for all requests together: buffers and working sets, a quarter kept in reserve for exports that find the rest taken (bytes, or with K, M, G suffix)")
	fs.Var(&f.exportMemory, "export-memory", "memory budget for one export's requests, so that an export whose device hangs leaves the rest to the others (default half of --memory)")
	fs.IntVar(&f.maxConnections, "max-connections", nbdtarget.DefaultMaxConnections, "connections open at once; more are closed at once and counted")
	fs.DurationVar(&f.handshakeTimeout, "handshake-timeout", nbdtarget.DefaultHandshakeTimeout, "close clients that have not finished the NBD handshake by then")
	fs.DurationVar(&f.replyTimeout, "reply-timeout", nbdtarget.DefaultReplyTimeout, "close clients that take none of their replies for this long")
	fs.Var(&f.descriptions, "description", "NAME=TEXT: the description clients see for export NAME (repeatable; default none)")
}

func (f *limitFlags) apply(s *nbdtarget.Server) {
	s.Memory = int64(f.memory)
	s.ExportMemory = int64(f.exportMemory)
	s.MaxConnections = f.maxConnections
	s.HandshakeTimeout = f.handshakeTimeout
	s.ReplyTimeout = f.replyTimeout
}

// byteSize is a flag value in bytes, written plainly or with a binary
// suffix: 268435456, 256M, 1G.
type byteSize int64

func (b *byteSize) String() string { return fmt.Sprint(int64(*b)) }

func (b *byteSize) Set(s string) error {
	mult := int64(1)
	switch {
	case strings.HasSuffix(s, "K"):
		mult = 1 << 10
	case strings.HasSuffix(s, "M"):
		mult = 1 << 20
	case strings.HasSuffix(s, "G"):
		mult = 1 << 30
	}
	if mult > 1 {
		s = s[:len(s)-1]
	}
	var n int64
	if _, err := fmt.Sscan(s, &n); err != nil || n <= 0 {
		return fmt.Errorf("want a positive size such as 256M, got %q", s)
	}
	*b = byteSize(n * mult)
	return nil
}

// rate is a flag value in bytes per second, as byteSize, where 0 means
// no limit.
type rate int64

func (r *rate) String() string { return fmt.Sprint(int64(*r)) }

func (r *rate) Set(s string) error {
	if s == "0" {
		*r = 0
		return nil
	}
	var b byteSize
	if err := b.Set(s); err != nil {
		return fmt.Errorf("want a rate such as 64M (bytes per second) or 0 for no limit, got %q", s)
	}
	*r = rate(b)
	return nil
}

// descriptions are --description NAME=TEXT flags.
type descriptions map[string]string

func (d *descriptions) String() string { return fmt.Sprint(map[string]string(*d)) }

func (d *descriptions) Set(s string) error {
	name, text, ok := strings.Cut(s, "=")
	if !ok || name == "" {
		return fmt.Errorf("want NAME=TEXT, got %q", s)
	}
	if *d == nil {
		*d = make(descriptions)
	}
	(*d)[name] = text
	return nil
}

// memoryHeadroom is what the process may hold beyond its tables and the
// request budget: runtime, stacks and connection buffers, and garbage not
// yet collected. docs/limits.md states it.
const memoryHeadroom = 16 << 20

// limitMemory sets the Go runtime's soft memory limit to what the process
// holds besides requests (its tables, the runtime), plus the request
// budget and memoryHeadroom, so that garbage from requests is collected
// before the heap grows past the budget. Without it the heap of a server
// with a large table (a million segments) may double before a collection,
// whatever the budget. inUse is what requests hold now (counted in the
// budget, not twice). Serve calls it at start-up and again whenever a
// table is created, loaded, swapped or removed, so that the limit follows
// the tables. An operator's GOMEMLIMIT wins.
func limitMemory(log *slog.Logger, budget int64, inUse func() int64) {
	if os.Getenv("GOMEMLIMIT") != "" {
		return
	}
	limitMu.Lock()
	defer limitMu.Unlock()
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	held := int64(ms.Sys-ms.HeapReleased) - inUse()
	limit := held + budget + memoryHeadroom
	debug.SetMemoryLimit(limit)
	log.Info("memory", "tables_and_runtime", held, "request_budget", budget, "limit", limit)
}

// limitMu orders the limits set from start-up and control requests.
var limitMu sync.Mutex
