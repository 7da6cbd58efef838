// Package soak is a chaos soak of nbdmapper's server with a model: many
// pipelined connections issue random requests over a multi-segment table
// (linear, striped, snapshot) and a snapshot-origin, clients abort at
// random points, the disks fail (EIO, ENOSPC, failed syncs, delays, panics)
// and lose power with requests in flight; after every power cut the server
// is rebuilt on the same files. Every read, block status and post-crash
// sector is checked against a model of what the export may hold.
//
// `go test ./soak` runs a short soak; bench/soak.sh runs a long one with
// the flags below and prints the figures docs/soak.md records.
package soak

import (
	"context"
	"encoding/binary"
	"errors"
	"flag"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nbdmapper/nbdmapper/backing"
	"github.com/nbdmapper/nbdmapper/discard"
	"github.com/nbdmapper/nbdmapper/flush"
	"github.com/nbdmapper/nbdmapper/mapped"
	"github.com/nbdmapper/nbdmapper/nbdtarget"
	"github.com/nbdmapper/nbdmapper/table"
)

var (
	flagOps      = flag.Int64("soak.ops", 20000, "operations to complete in all")
	flagDuration = flag.Duration("soak.duration", 0, "stop after this long even if -soak.ops are not done (0: no limit)")
	flagCrashes  = flag.Int("soak.crashes", 8, "power cuts (each followed by a restart and a full check)")
	flagConns    = flag.Int("soak.conns", 8, "client connections at a time, over both exports")
	flagDepth    = flag.Int("soak.depth", 8, "requests each connection keeps in flight")
	flagPanics   = flag.Bool("soak.panics", true, "inject panics into device calls")
	flagFaults   = flag.Float64("soak.faults", 1.0/2000, "probability of each fault kind per device call")
	flagSyncFail = flag.Float64("soak.syncfaults", 1.0/200, "probability that a sync fails and loses what it was writing back")
	flagAborts   = flag.Float64("soak.aborts", 1.0/3000, "probability per request that the client aborts its connection")
	flagDir      = flag.String("soak.dir", "", "directory for the backing files (default: the test's temporary directory)")
	flagReport   = flag.String("soak.report", "", "file to write the figures to")
	flagNoPrune  = flag.Bool("soak.noprune", false, "keep every model entry (debugging: failures then show whole histories)")
	flagMaxDelay = flag.Duration("soak.maxdelay", 2*time.Millisecond, "longest injected device delay")
	flagHoleLag  = flag.Float64("soak.holelag", 1.0/20, "probability that a disk's hole answer is delayed after the disk computed it, so that writes race the hole map's query")
)

// bound turns a hang into a failure; see internal/testing/nbdtest.Bound.
const bound = 60 * time.Second

// The table of export "main" (sectors), and export "org", the origin of
// main's snapshot segment:
//
//	main: 0     2048  snapshot d e P 8       (1 MiB, a snapshot of d)
//	      2048  4096  linear a 0             (2 MiB)
//	      6144  4096  striped 2 8 b 0 c 0    (2 MiB, 4 KiB chunks)
//	      10240 2048  linear a 4096          (1 MiB)
//	org:  0     2048  snapshot-origin d      (1 MiB)
//
// The snapshot line starts at 0 because a snapshot's sectors are its
// origin's (as in dm): org's writes copy out the very chunks it maps.
//
// a, b and c inject every fault; d and e (the snapshot's origin and COW)
// only delays, so that the snapshot is not invalidated by an I/O error
// (dm's behaviour, which would end the check of that segment).
const (
	mainTable = `0 2048 snapshot d e P 8
2048 4096 linear a 0
6144 4096 striped 2 8 b 0 c 0
10240 2048 linear a 4096
`
	orgTable = "0 2048 snapshot-origin d\n"
)

var diskSizes = map[string]int64{"a": 3 << 20, "b": 1 << 20, "c": 1 << 20, "d": 1 << 20, "e": 2 << 20}

// stats are the soak's figures.
type stats struct {
	ops, reads, writes, fua, trims, zeroes, flushes, blockStatus, caches atomic.Int64
	errnos                                                               [256]atomic.Int64
	aborts                                                               [3]atomic.Int64
	crashes, wrongReads, lostFlushed, badErrnos, protocol, panics        atomic.Int64
	tornReads                                                            atomic.Int64 // reads that saw a mix of concurrent writes
	holeChunks, holeReads                                                atomic.Int64 // OFFSET_HOLE chunks received, reads with any
	sweptSectors                                                         atomic.Int64
	latency, count                                                       [8]atomic.Int64 // by command

	mu       sync.Mutex
	failures []string
}

func (s *stats) fail(format string, args ...any) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.failures) < 20 {
		s.failures = append(s.failures, fmt.Sprintf(format, args...))
	}
}

// rig is the soak's files, disks and models, and the server of the
// current run.
type rig struct {
	t      *testing.T
	dir    string
	sock   string
	full   *faults // a, b, c
	slow   *faults // d, e
	models map[string]*model
	st     *stats
	opID   atomic.Uint64

	srv     *nbdtarget.Server
	disks   []*disk
	kill    bool        // the cut is a SIGKILL of the server, not a power cut
	cutting atomic.Bool // the cut has come: a client failing to dial stops
	logged  time.Time   // last progress line
	cut     func()      // the power cut (or kill) with requests in flight
	close   func()      // stops the server

	tables map[string]*table.Table // of the current run in this process, for probe
}

func TestSoak(t *testing.T) {
	ops, crashes := *flagOps, *flagCrashes
	if testing.Short() {
		ops, crashes = min(ops, 4000), min(crashes, 3)
	}
	dir := *flagDir
	if dir == "" {
		dir = t.TempDir()
	}
	sockDir, err := os.MkdirTemp("", "soak")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(sockDir)
	r := &rig{t: t, dir: dir, sock: filepath.Join(sockDir, "s"), st: new(stats),
		full:   &faults{eio: *flagFaults, enospc: *flagFaults, syncFail: *flagSyncFail, slow: *flagFaults, holeLag: *flagHoleLag, maxDelay: *flagMaxDelay},
		slow:   &faults{slow: *flagFaults, holeLag: *flagHoleLag, maxDelay: *flagMaxDelay},
		models: map[string]*model{"main": newModel("main", 1, 12288), "org": newModel("org", 2, 2048)}}
	if *flagPanics {
		r.full.panics = *flagFaults
	}
	createDisks(t, dir)
	start := time.Now()
	perCycle := max(ops/int64(crashes+1), 1)
	for cycle := 0; cycle <= crashes; cycle++ {
		last := cycle == crashes || (*flagDuration > 0 && time.Since(start) > *flagDuration)
		r.start()
		if cycle > 0 {
			r.sweep((*model).afterCrash)
		}
		r.full.on.Store(true)
		r.slow.on.Store(true)
		r.cutting.Store(false)
		r.run(perCycle, !last)
		if last {
			break
		}
		r.st.crashes.Add(1)
	}
	r.report(t, time.Since(start))
}

// createDisks creates the backing files, sparse, in dir.
func createDisks(t *testing.T, dir string) {
	for name, size := range diskSizes {
		if err := os.WriteFile(filepath.Join(dir, name), nil, 0o644); err != nil {
			t.Fatal(err)
		}
		if err := os.Truncate(filepath.Join(dir, name), size); err != nil {
			t.Fatal(err)
		}
	}
}

// start opens the disks, builds the tables and serves them.
func (r *rig) start() {
	t := r.t
	pool := &backing.Pool{}
	flusher, discarder := flush.New(), discard.New()
	pool.Wrap = flusher.Track
	r.disks = r.disks[:0]
	for _, name := range []string{"a", "b", "c", "d", "e"} {
		f, err := backing.OpenFile(filepath.Join(r.dir, name), false)
		if err != nil {
			t.Fatal(err)
		}
		fl := r.full
		if name == "d" || name == "e" {
			fl = r.slow
		}
		d := newDisk(f, fl)
		r.disks = append(r.disks, d)
		// A hole map in front, as the pool gives every file, so that the
		// model checks the hole chunks it lets reads send.
		pool.Add(name, backing.NewHoleMap(d))
	}
	var exports []*nbdtarget.Export
	r.tables = make(map[string]*table.Table)
	for _, x := range []struct{ name, text string }{{"main", mainTable}, {"org", orgTable}} {
		tb, err := table.Parse(x.name+".table", strings.NewReader(x.text), pool)
		if err != nil {
			t.Fatal(err)
		}
		r.tables[x.name] = tb
		exports = append(exports, &nbdtarget.Export{Name: x.name, Dev: mapped.New(x.name, tb, flusher, discarder)})
	}
	r.srv = &nbdtarget.Server{Exports: exports, OnPanic: func(v any, stack []byte) {
		if _, ok := v.(injectedPanic); ok {
			r.st.panics.Add(1)
			return
		}
		r.st.fail("server recovered from a panic that was not injected: %v\n%s", v, stack)
	}}
	os.Remove(r.sock)
	l, err := net.Listen("unix", r.sock)
	if err != nil {
		t.Fatal(err)
	}
	served := make(chan error, 1)
	go func() { served <- r.srv.Serve(l) }()
	r.cut = func() {
		for _, d := range r.disks {
			d.Crash()
		}
	}
	r.close = func() {
		ctx, cancel := context.WithTimeout(context.Background(), bound)
		defer cancel()
		if err := r.srv.Shutdown(ctx); err != nil {
			t.Errorf("Shutdown: %v", err)
		}
		select {
		case <-served:
		case <-time.After(bound):
			t.Fatalf("Serve did not return after Shutdown")
		}
		for _, tb := range r.tables {
			tb.Close()
		}
		pool.Close()
	}
}

// sweep reads both exports whole after a power cut (or a kill), checks
// every sector with after, which also makes what it found the model, and
// counts what after reports: "lost..." or any other failure.
func (r *rig) sweep(after func(m *model, s int64, val uint64) string) {
	t := r.t
	for name, m := range r.models {
		c, err := dialNBD(r.sock, name, false)
		if err != nil {
			t.Fatalf("sweep %s: %v", name, err)
		}
		const chunk = 256 << 10
		for off := int64(0); off < c.size; off += chunk {
			n := min(chunk, c.size-off)
			got := make(chan *call, 1)
			cl := &call{typ: cmdRead, off: off, n: n, done: func(cl *call) { got <- cl }}
			if err := c.send(cl, nil); err != nil {
				t.Fatalf("sweep %s: %v", name, err)
			}
			if err := c.flush(); err != nil {
				t.Fatalf("sweep %s: %v", name, err)
			}
			select {
			case cl = <-got:
			case <-time.After(bound):
				t.Fatalf("sweep %s: no reply in %v", name, bound)
			}
			if cl.lost || cl.errno != 0 {
				t.Fatalf("sweep %s at %d: read failed (errno %d, lost %v) with faults off", name, off, cl.errno, cl.lost)
			}
			for i := int64(0); i < n/sector; i++ {
				s := off/sector + i
				val, ok := decode(cl.data[i*sector:(i+1)*sector], m.export, s)
				why := ""
				if !ok {
					why = fmt.Sprintf("wrong: sector %d holds no stamp of this export: %x...", s, cl.data[i*sector:i*sector+32])
					after(m, s, 0)
				} else {
					why = after(m, s, val)
				}
				r.st.sweptSectors.Add(1)
				switch {
				case why == "":
				case strings.HasPrefix(why, "lost"):
					r.st.lostFlushed.Add(1)
					r.st.fail("after power cut %d, %s: %s", r.st.crashes.Load(), name, why)
				default:
					r.st.wrongReads.Add(1)
					r.st.fail("after power cut %d, %s: %s", r.st.crashes.Load(), name, why)
				}
			}
		}
		c.close()
		m.restart()
	}
}

// run drives the clients until n operations have completed, then cuts the
// power with requests in flight (or, for the last run, stops cleanly).
func (r *rig) run(n int64, crash bool) {
	t := r.t
	var done atomic.Int64
	stop := make(chan struct{})
	reached := make(chan struct{})
	var once sync.Once
	var wg sync.WaitGroup
	var connsMu sync.Mutex
	conns := map[*nbdConn]bool{}
	for w := range *flagConns {
		export := "main"
		if w%4 == 3 {
			export = "org"
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			r.worker(export, stop, &connsMu, conns, func() {
				if done.Add(1) == n {
					once.Do(func() { close(reached) })
				}
			})
		}()
	}
	last, lastAt := int64(-1), time.Now()
	for waiting := true; waiting; {
		select {
		case <-reached:
			waiting = false
		case <-time.After(time.Second):
			if time.Since(r.logged) > 30*time.Second {
				r.logged = time.Now()
				t.Logf("progress: %d operations, %d cuts, %d wrong reads, %d lost writes",
					r.st.ops.Load(), r.st.crashes.Load(), r.st.wrongReads.Load(), r.st.lostFlushed.Load())
			}
			if d := done.Load(); d != last {
				last, lastAt = d, time.Now()
			} else if time.Since(lastAt) > bound {
				buf := make([]byte, 8<<20)
				t.Fatalf("no request completed for %v (%d of %d done):\n%s", bound, d, n, buf[:runtime.Stack(buf, true)])
			}
		}
	}
	if crash {
		r.cutting.Store(true)
		r.cut()
	}
	close(stop)
	connsMu.Lock()
	for c := range conns {
		c.nc.Close()
	}
	connsMu.Unlock()
	finished := make(chan struct{})
	go func() { wg.Wait(); close(finished) }()
	select {
	case <-finished:
	case <-time.After(bound):
		t.Fatalf("clients did not stop in %v", bound)
	}
	r.full.on.Store(false)
	r.slow.on.Store(false)
	r.close()
}

// worker keeps one connection busy with random requests, and now and then
// aborts it and dials another.
func (r *rig) worker(export string, stop chan struct{}, connsMu *sync.Mutex, conns map[*nbdConn]bool, completed func()) {
	m := r.models[export]
	for {
		select {
		case <-stop:
			return
		default:
		}
		structured := rand.N(4) != 0
		c, err := dialNBD(r.sock, export, structured)
		if err != nil {
			if !r.cutting.Load() {
				r.st.fail("dial %s: %v", export, err)
			}
			return
		}
		connsMu.Lock()
		conns[c] = true
		connsMu.Unlock()
		r.drive(c, m, stop, completed)
		c.close()
		if errors.Is(c.err, errProtocol) {
			r.st.protocol.Add(1)
			r.st.fail("%s: %v", export, c.err)
		}
		connsMu.Lock()
		delete(conns, c)
		connsMu.Unlock()
	}
}

// drive issues requests on c until it breaks, the client aborts it, or stop.
func (r *rig) drive(c *nbdConn, m *model, stop chan struct{}, completed func()) {
	sem := make(chan struct{}, *flagDepth)
	sectors := c.size / sector
	for {
		select {
		case <-stop:
			return
		case sem <- struct{}{}:
		}
		if rand.Float64() < *flagAborts {
			r.abort(c, m, sectors)
			return
		}
		cl, payload := r.request(c, m, sectors, func() { <-sem; completed() })
		if err := c.send(cl, payload); err != nil {
			return
		}
		if len(sem) == cap(sem) || rand.N(8) == 0 {
			if err := c.flush(); err != nil {
				return
			}
		}
	}
}

// abort ends the connection at a random point: inside a request header,
// inside a WRITE's payload, or with replies in flight.
func (r *rig) abort(c *nbdConn, m *model, sectors int64) {
	kind := rand.N(3)
	r.st.aborts[kind].Add(1)
	switch kind {
	case 0:
		var h [28]byte
		c.writeRaw(h[:1+rand.N(27)])
	case 1:
		s, n := span(sectors, 64)
		op := r.opID.Add(1)
		m.startWrite(op, op, s, n) // it may be written in part: never resolved
		p := payload(m.export, s, n, op)
		var h [28]byte
		putHeader(h[:], cmdWrite, 0, s*sector, n*sector)
		c.writeRaw(append(h[:], p[:rand.N(len(p))]...))
	default:
		c.flush()
	}
}

func putHeader(h []byte, typ, flags uint16, off, n int64) {
	binary.BigEndian.PutUint32(h[0:], reqMagic)
	binary.BigEndian.PutUint16(h[4:], flags)
	binary.BigEndian.PutUint16(h[6:], typ)
	binary.BigEndian.PutUint64(h[8:], 1<<63)
	binary.BigEndian.PutUint64(h[16:], uint64(off))
	binary.BigEndian.PutUint32(h[24:], uint32(n))
}

// span picks a random sector range of the export, usually short.
func span(sectors, short int64) (s, n int64) {
	s = rand.N(sectors)
	if rand.N(20) == 0 {
		return s, 1 + rand.N(sectors-s)
	}
	return s, 1 + rand.N(min(short, sectors-s))
}

func payload(export uint8, s, n int64, op uint64) []byte {
	p := make([]byte, n*sector)
	for i := range n {
		stamp(p[i*sector:], export, s+i, op)
	}
	return p
}

// request builds a random request and what to do with its reply.
func (r *rig) request(c *nbdConn, m *model, sectors int64, release func()) (*call, []byte) {
	st := r.st
	cl := &call{}
	var payloadBytes []byte
	allowed := []uint32{0, 5} // EIO: injected faults and recovered panics
	sent := time.Now()
	finish := func(cl *call) bool {
		release()
		if cl.lost {
			return false
		}
		st.ops.Add(1)
		st.latency[cl.typ].Add(int64(time.Since(sent)))
		st.count[cl.typ].Add(1)
		st.errnos[min(cl.errno, 255)].Add(1)
		ok := false
		for _, e := range allowed {
			ok = ok || cl.errno == e
		}
		if !ok {
			st.badErrnos.Add(1)
			st.fail("request type %d flags %#x at sector %d+%d: errno %d, allowed %v", cl.typ, cl.flags, cl.off/sector, cl.n/sector, cl.errno, allowed)
		}
		return cl.errno == 0
	}
	// reading registers a read or block status with the model and checks
	// its answer, if it succeeded, while the read is still registered.
	reading := func(check func(r0, r1 uint64)) func(*call) {
		r0 := m.startRead()
		return func(cl *call) {
			r1 := m.answered()
			defer m.doneRead(r0)
			if finish(cl) {
				check(r0, r1)
			}
		}
	}
	pick := rand.N(100)
	switch {
	case pick < 30: // READ
		st.reads.Add(1)
		s, n := span(sectors, 256)
		cl.typ, cl.off, cl.n = cmdRead, s*sector, n*sector
		cl.done = reading(func(r0, r1 uint64) {
			if cl.holes > 0 {
				st.holeChunks.Add(cl.holes)
				st.holeReads.Add(1)
			}
			for i := range n {
				val, ok := decode(cl.data[i*sector:(i+1)*sector], m.export, s+i)
				why := "no stamp of this export"
				if ok {
					ok, why = m.readOK(s+i, val, r0, r1)
				}
				if !ok && m.readTornOK(s+i, cl.data[i*sector:], r0, r1) {
					st.tornReads.Add(1)
					ok = true
				}
				if !ok {
					st.wrongReads.Add(1)
					st.fail("%s: read of sector %d (issued %d, answered %d, %d sectors from %d, hole chunks at %v) got op %d; %s; %s",
						m.name, s+i, r0, r1, n, s, cl.holeAt, val, why, r.probe(m, s+i))
				}
			}
		})
	case pick < 60: // WRITE
		st.writes.Add(1)
		s, n := span(sectors, 128)
		n = min(n, 2048)
		op := r.opID.Add(1)
		cl.typ, cl.off, cl.n = cmdWrite, s*sector, n*sector
		if rand.N(4) == 0 {
			cl.flags = flagFUA
			st.fua.Add(1)
		}
		allowed = append(allowed, 28)
		payloadBytes = payload(m.export, s, n, op)
		m.startWrite(op, op, s, n)
		cl.done = func(cl *call) {
			if cl.lost {
				release()
				return
			}
			ok := finish(cl)
			m.endWrite(op, s, n, ok, cl.flags&flagFUA != 0)
		}
	case pick < 68, pick < 76: // TRIM, WRITE_ZEROES
		s, n := span(sectors, 256)
		op := r.opID.Add(1)
		cl.off, cl.n = s*sector, n*sector
		cl.typ = cmdTrim
		if pick >= 68 {
			cl.typ = cmdZeroes
			st.zeroes.Add(1)
			if rand.N(2) == 0 {
				cl.flags |= flagNoHole
			}
			if rand.N(10) == 0 {
				cl.flags |= flagFastZero
				allowed = append(allowed, errENOTSUP)
			}
		} else {
			st.trims.Add(1)
		}
		if rand.N(10) == 0 {
			cl.flags |= flagFUA
		}
		allowed = append(allowed, 28)
		m.startWrite(op, 0, s, n)
		cl.done = func(cl *call) {
			if cl.lost {
				release()
				return
			}
			ok := finish(cl)
			m.endWrite(op, s, n, ok && cl.typ == cmdZeroes, cl.flags&flagFUA != 0)
		}
	case pick < 84: // FLUSH
		st.flushes.Add(1)
		cl.typ = cmdFlush
		t0 := m.startFlush()
		cl.done = func(cl *call) {
			if finish(cl) {
				m.endFlush(t0)
			}
		}
	case pick < 94 && c.structured: // BLOCK_STATUS
		st.blockStatus.Add(1)
		s, n := span(sectors, 1024)
		cl.typ, cl.off, cl.n = cmdBlockStat, s*sector, n*sector
		if rand.N(5) == 0 {
			cl.flags = flagReqOne
		}
		cl.done = reading(func(r0, r1 uint64) {
			at := cl.off
			for _, x := range cl.exts {
				end := at + int64(x[0])
				if x[1]&stateZero != 0 {
					for sec := (at + sector - 1) / sector; (sec+1)*sector <= min(end, cl.off+cl.n); sec++ {
						if ok, why := m.readOK(sec, 0, r0, r1); !ok {
							st.wrongReads.Add(1)
							st.fail("%s: block status (issued %d, answered %d) says sector %d reads zeros; %s", m.name, r0, r1, sec, why)
						}
					}
				}
				at = end
			}
		})
	default: // CACHE
		st.caches.Add(1)
		s, n := span(sectors, 1024)
		cl.typ, cl.off, cl.n = cmdCache, s*sector, n*sector
		cl.done = func(cl *call) { finish(cl) }
	}
	return cl, payloadBytes
}

func peakRSS() string {
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		return "unknown"
	}
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, "VmHWM:"); ok {
			return strings.TrimSpace(v)
		}
	}
	return "unknown"
}

func (r *rig) report(t *testing.T, d time.Duration) {
	st := r.st
	var b strings.Builder
	fmt.Fprintf(&b, "operations            %d in %v (%.0f/s)\n", st.ops.Load(), d.Round(time.Millisecond), float64(st.ops.Load())/d.Seconds())
	fmt.Fprintf(&b, "  reads %d, writes %d (FUA %d), trims %d, write-zeroes %d, flushes %d, block status %d, cache %d\n",
		st.reads.Load(), st.writes.Load(), st.fua.Load(), st.trims.Load(), st.zeroes.Load(), st.flushes.Load(), st.blockStatus.Load(), st.caches.Load())
	fmt.Fprintf(&b, "  errors by errno:")
	for e := range st.errnos {
		if v := st.errnos[e].Load(); v > 0 && e != 0 {
			fmt.Fprintf(&b, " %d:%d", e, v)
		}
	}
	fmt.Fprintf(&b, "\n  mean latency by command:")
	for i, name := range []string{"read", "write", "", "flush", "trim", "cache", "write-zeroes", "block-status"} {
		if n := st.count[i].Load(); n > 0 {
			fmt.Fprintf(&b, " %s %v", name, (time.Duration(st.latency[i].Load()) / time.Duration(n)).Round(time.Microsecond))
		}
	}
	fmt.Fprintf(&b, "\nfaults injected       EIO %d, ENOSPC %d, failed sync %d, delay %d, panic %d (recovered by the server: %d)\n",
		r.full.nEIO.Load()+r.slow.nEIO.Load(), r.full.nENOSPC.Load(), r.full.nSyncFail.Load(),
		r.full.nSlow.Load()+r.slow.nSlow.Load(), r.full.nPanic.Load(), st.panics.Load())
	fmt.Fprintf(&b, "device syncs          %d\n", r.full.nSync.Load()+r.slow.nSync.Load())
	fmt.Fprintf(&b, "hole answers delayed  %d\n", r.full.nHoleLag.Load()+r.slow.nHoleLag.Load())
	fmt.Fprintf(&b, "client aborts         mid-header %d, mid-payload %d, replies in flight %d\n",
		st.aborts[0].Load(), st.aborts[1].Load(), st.aborts[2].Load())
	cuts, lost := "power cuts         ", "lost flushed writes   "
	if r.kill {
		cuts, lost = "SIGKILLs of serve  ", "lost answered writes  "
	}
	fmt.Fprintf(&b, "%s   %d (sectors checked after them: %d)\n", cuts, st.crashes.Load(), st.sweptSectors.Load())
	fmt.Fprintf(&b, "wrong reads           %d (and %d reads of sectors torn between concurrent writes, which NBD allows)\n", st.wrongReads.Load(), st.tornReads.Load())
	fmt.Fprintf(&b, "%s%d\n", lost, st.lostFlushed.Load())
	fmt.Fprintf(&b, "hole chunks           %d, in %d of %d reads (all checked against the model)\n", st.holeChunks.Load(), st.holeReads.Load(), st.reads.Load())
	fmt.Fprintf(&b, "protocol violations   %d\n", st.protocol.Load())
	fmt.Fprintf(&b, "disallowed errnos     %d\n", st.badErrnos.Load())
	if r.kill {
		fmt.Fprintf(&b, "peak RSS (test process: clients, model; not the server)  %s\n", peakRSS())
	} else {
		fmt.Fprintf(&b, "peak RSS (test process: server, clients, model)  %s\n", peakRSS())
	}
	t.Logf("soak:\n%s", b.String())
	if *flagReport != "" {
		if err := os.WriteFile(*flagReport, []byte(b.String()), 0o644); err != nil {
			t.Error(err)
		}
	}
	for _, f := range st.failures {
		t.Error(f)
	}
	if st.reads.Load() > 1000 && st.holeChunks.Load() == 0 {
		t.Error("no read was answered with a hole chunk: the sparse read path went unchecked")
	}
}
