package nbdtarget

import (
	"bytes"
	"encoding/binary"
	"io"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nbdmapper/nbdmapper/backing"
	"github.com/nbdmapper/nbdmapper/internal/testing/nbdtest"
	"github.com/nbdmapper/nbdmapper/wire"
)

// Layout of the "long" export: room for reads and writes longer than
// MaxPayload, a device whose first 4 KiB fail every read and write, and
// more room after it.
//
//	0                     goodLen            goodLen+64K
//	| good (Mem)          | bad (fails @0..4K) | after (Mem, MaxPayload+1) |
const goodLen = 3*MaxPayload + 3*streamPiece/2

func newStreamFix(t *testing.T, srv *Server) (sock string, good *backing.Mem) {
	good = backing.NewMem("good", goodLen)
	bad := &failDev{Device: backing.NewMem("bad", 64*kb), from: 0, to: 4 * kb}
	after := backing.NewMem("after", MaxPayload+512)
	x := newExport(t, "long", seg{len: goodLen, dev: good}, seg{len: 64 * kb, dev: bad}, seg{len: MaxPayload + 512, dev: after})
	if srv == nil {
		srv = &Server{}
	}
	srv.Exports = []*Export{x}
	return nbdtest.ServeUnix(t, srv, ErrServerClosed), good
}

func pattern(n int, seed byte) []byte {
	p := make([]byte, n)
	for i := range p {
		p[i] = byte(i*7) ^ seed ^ byte(i>>13)
	}
	return p
}

// TestLongReadWrite moves READ and WRITE longer than MaxPayload, which
// clients that negotiated no block size may send, through every reply form,
// with the server's memory budget set to its minimum so that nothing longer
// than a piece can be held.
func TestLongReadWrite(t *testing.T) {
	srv := &Server{Memory: 1, MaxInFlightBytes: 1}
	sock, good := newStreamFix(t, srv)
	const n = 2*MaxPayload + 12345
	const off = 4096 + 3
	data := pattern(n, 0x5c)

	c := dialRaw(t, sock)
	c.connect("long", true, false)
	c.request(wire.CmdWrite, 0, 1, off, n, data)
	if r := c.any(); !r.simple || r.errno != 0 || r.handle != 1 {
		t.Fatalf("long write: %+v", r)
	}
	got := make([]byte, n)
	good.ReadAt(got, off)
	if !bytes.Equal(got, data) {
		t.Fatal("long write: device bytes differ")
	}

	t.Run("a MaxPayload read fits the smallest budget", func(t *testing.T) {
		c.t = t
		c.nc.SetReadDeadline(time.Now().Add(60 * time.Second)) // a hang fails
		defer c.nc.SetReadDeadline(time.Time{})
		c.request(wire.CmdRead, wire.CfDF, 10, off, MaxPayload, nil)
		if ch := c.chunk(); ch.handle != 10 || ch.typ != wire.ChunkOffsetData || !bytes.Equal(ch.payload[8:], data[:MaxPayload]) {
			t.Fatalf("chunk handle %d type %d", ch.handle, ch.typ)
		}
	})
	t.Run("structured: one OFFSET_DATA chunk per piece", func(t *testing.T) {
		c.t = t
		c.request(wire.CmdRead, 0, 2, off, n, nil)
		var all []byte
		for {
			ch := c.chunk()
			if ch.handle != 2 || ch.typ != wire.ChunkOffsetData {
				t.Fatalf("chunk handle %d type %d", ch.handle, ch.typ)
			}
			if o := binary.BigEndian.Uint64(ch.payload); o != uint64(off+len(all)) {
				t.Fatalf("chunk at %d, want %d", o, off+len(all))
			}
			all = append(all, ch.payload[8:]...)
			if ch.flags&wire.ReplyFlagDone != 0 {
				break
			}
		}
		if !bytes.Equal(all, data) {
			t.Fatal("chunks differ from what was written")
		}
	})
	t.Run("structured with DF: too long for one chunk is EOVERFLOW", func(t *testing.T) {
		// One chunk could not end in an error once a later piece failed,
		// and one of 4 GiB or more would overflow its length field. The
		// connection goes on: the subtests after this one use it.
		c.t = t
		for _, length := range []uint32{MaxPayload + 1, n, 0xffffffff} {
			c.request(wire.CmdRead, wire.CfDF, 3, off, length, nil)
			ch := c.chunk()
			errno, _, _, err := chunkErrno(ch)
			if err != nil || errno != wire.EOVERFLOW || ch.handle != 3 || ch.flags != wire.ReplyFlagDone {
				t.Fatalf("DF read of %d bytes: chunk type %#x handle %d flags %d errno %d (%v), want EOVERFLOW",
					length, ch.typ, ch.handle, ch.flags, errno, err)
			}
		}
	})
	t.Run("structured: a failure after the first piece ends with ERROR_OFFSET", func(t *testing.T) {
		c.t = t
		start := uint64(goodLen - MaxPayload - 100)
		c.request(wire.CmdRead, 0, 4, start, MaxPayload+4096, nil)
		var sent int
		for {
			ch := c.chunk()
			if ch.typ == wire.ChunkOffsetData {
				sent += len(ch.payload) - 8
				continue
			}
			errno, msg, at, err := chunkErrno(ch)
			if err != nil || errno != wire.EIO || at != goodLen || ch.flags != wire.ReplyFlagDone {
				t.Fatalf("final chunk: errno %d at %d flags %d (%v)", errno, at, ch.flags, err)
			}
			if msg != errMessage(wire.EIO) {
				t.Fatalf("error message %q", msg)
			}
			break
		}
		if sent == 0 {
			t.Fatal("no data chunk before the error")
		}
	})
	t.Run("a failure in the first piece is an ordinary error reply", func(t *testing.T) {
		c.t = t
		c.request(wire.CmdRead, 0, 5, goodLen-100, MaxPayload+1, nil)
		errno, _, at, err := chunkErrno(c.chunk())
		if err != nil || errno != wire.EIO || at != goodLen {
			t.Fatalf("errno %d at %d (%v)", errno, at, err)
		}
	})

	t.Run("simple: a long read, then a failure after the header closes the connection", func(t *testing.T) {
		s := dialRaw(t, sock)
		s.connect("long", false, false)
		s.request(wire.CmdRead, 0, 6, off, n, nil)
		if h, errno, got := s.simple(n); h != 6 || errno != 0 || !bytes.Equal(got, data) {
			t.Fatalf("simple long read: handle %d errno %d", h, errno)
		}
		s.request(wire.CmdRead, 0, 7, goodLen-MaxPayload-100, MaxPayload+4096, nil)
		if h, errno, _ := s.simple(0); h != 7 || errno != 0 {
			t.Fatalf("header: handle %d errno %d", h, errno)
		}
		s.nc.SetReadDeadline(time.Now().Add(60 * time.Second))
		buf := make([]byte, 1<<20)
		var read int
		for {
			m, err := s.nc.Read(buf)
			read += m
			if err != nil {
				break
			}
		}
		if read >= MaxPayload+4096 {
			t.Fatalf("read %d bytes: the broken reply was completed", read)
		}
	})

	t.Run("a long write that fails consumes its whole payload", func(t *testing.T) {
		s := dialRaw(t, sock)
		s.connect("long", false, false)
		// Pieces before the bad device are written; the stream stays in sync.
		start := uint64(goodLen - MaxPayload - 1000)
		p := pattern(MaxPayload+8192, 0x33)
		s.request(wire.CmdWrite, 0, 8, start, uint32(len(p)), p)
		if h, errno, _ := s.simple(0); h != 8 || errno != wire.EIO {
			t.Fatalf("write over a failing device: handle %d errno %d", h, errno)
		}
		s.request(wire.CmdRead, 0, 9, 0, 512, nil)
		if h, errno, _ := s.simple(512); h != 9 || errno != 0 {
			t.Fatalf("follow-up read: handle %d errno %d", h, errno)
		}
	})
	// Memory goes back just after each reply leaves.
	waitFor(t, "every request's memory to be given back", func() bool { return srv.Stats().MemoryInUse == 0 })
}

// TestMemoryBudgetWaits fills a small budget with reads held at a gate:
// the next request waits for memory instead of failing, and runs once the
// gate opens.
func TestMemoryBudgetWaits(t *testing.T) {
	srv := &Server{Memory: MaxPayload + 2*requestBase}
	f := newTFix(t, srv)
	c := dialRaw(t, f.sock)
	c.connect("t", false, false)
	c.request(wire.CmdRead, 0, 1, offGate, 4096, nil) // held at the gate
	<-f.gate.entered
	d := dialRaw(t, f.sock)
	d.connect("t", false, false)
	d.request(wire.CmdRead, 0, 2, 0, MaxPayload, nil) // needs the whole budget
	waitFor(t, "the second request to wait for memory", func() bool { return srv.Stats().MemoryWaits > 0 })
	close(f.gate.release)
	if h, errno, _ := c.simple(4096); h != 1 || errno != 0 {
		t.Fatalf("gated read: handle %d errno %d", h, errno)
	}
	if h, errno, _ := d.simple(0); h != 2 || errno != wire.EINVAL {
		// MaxPayload is past the end of "t": the point is that it got a
		// reply once memory was free.
		t.Fatalf("waiting request: handle %d errno %d", h, errno)
	}
}

// countingZeroDev reads as zeros, with no holes, and counts what it reads.
type countingZeroDev struct {
	backing.Device
	read atomic.Int64
}

func (d *countingZeroDev) ReadAt(p []byte, off int64) (int, error) {
	clear(p)
	d.read.Add(int64(len(p)))
	return len(p), nil
}

func (d *countingZeroDev) Holes(off, n int64) ([]backing.Range, error) { return nil, nil }

// A long structured read stops reading the export once its client has
// gone: the pieces after a failed write would be read for nobody.
func TestLongReadStopsWhenClientGoes(t *testing.T) {
	dev := &countingZeroDev{Device: backing.NewMem("z", 4096)}
	x := newExport(t, "big", seg{len: 8 << 30, dev: dev})
	srv := &Server{Exports: []*Export{x}}
	sock := nbdtest.ServeUnix(t, srv, ErrServerClosed)
	c := dialRaw(t, sock)
	c.connect("big", true, false)
	c.request(wire.CmdRead, 0, 1, 0, 0xffffffff, nil)
	if ch := c.chunk(); ch.typ != wire.ChunkOffsetData {
		t.Fatalf("first chunk type %d", ch.typ)
	}
	c.nc.Close()
	waitFor(t, "the connection to end", func() bool { return srv.Stats().Connections == 0 })
	if n := dev.read.Load(); n > 64<<20 {
		t.Fatalf("the server read %d bytes of a 4 GiB read whose client had gone", n)
	}
}

// A simple reply's pieces are read from the device while the reply is
// under way; a device slower than ReplyTimeout is not a client that
// stopped reading, and the client that reads all along gets its reply.
func TestLongReadSlowDeviceIsNotStuckClient(t *testing.T) {
	const size = MaxPayload + 2*streamPiece
	g := &gateDev{Device: backing.NewMem("g", size), at: streamPiece, entered: make(chan struct{}), release: make(chan struct{})}
	x := newExport(t, "slow", seg{len: size, dev: g})
	srv := &Server{Exports: []*Export{x}, ReplyTimeout: 200 * time.Millisecond}
	sock := nbdtest.ServeUnix(t, srv, ErrServerClosed)
	c := dialRaw(t, sock)
	c.connect("slow", false, false)
	const n = MaxPayload + 1
	c.request(wire.CmdRead, 0, 1, 0, n, nil)
	done := make(chan error, 1)
	go func() {
		_, err := io.ReadFull(c.nc, make([]byte, 16+n))
		done <- err
	}()
	<-g.entered
	// Hold the device for longer than watchReplies takes to close a
	// stuck connection (five of its ticks).
	from := srv.ticks.Load()
	waitFor(t, "ReplyTimeout to pass", func() bool { return srv.ticks.Load() >= from+7 })
	close(g.release)
	if err := <-done; err != nil {
		t.Fatalf("a client reading its reply all along lost it: %v (ReplyTimeouts %d)", err, srv.Stats().ReplyTimeouts)
	}
}

// Clients that announce writes and withhold their payloads hold at most
// payloadFirst of the server's memory each: eight MaxPayload headers,
// which used to take the whole default Memory and stall every client of
// the server behind them, leave an honest client's requests to run.
func TestWithheldPayloadsLeaveMemory(t *testing.T) {
	srv := &Server{ReplyTimeout: time.Hour} // only the bound frees the honest client
	f := newTFix(t, srv)
	for i := range 8 {
		s := dialRaw(t, f.sock)
		s.connect("t", false, false)
		s.request(wire.CmdWrite, 0, uint64(i), 0, MaxPayload, nil) // and no payload
	}
	waitFor(t, "the withheld writes to be charged", func() bool {
		return srv.Stats().MemoryInUse >= 8*(requestBase+payloadFirst)
	})
	if st := srv.Stats(); st.MemoryInUse > 8*(requestBase+payloadFirst) {
		t.Fatalf("eight withheld payloads hold %d bytes, more than payloadFirst each", st.MemoryInUse)
	}
	c := dialRaw(t, f.sock)
	c.connect("t", false, false)
	p := bytes.Repeat([]byte{0x42}, 4096)
	c.request(wire.CmdWrite, 0, 1, 0, 4096, p)
	if h, errno, _ := c.simple(0); h != 1 || errno != 0 {
		t.Fatalf("honest write: handle %d errno %d", h, errno)
	}
	// Sent once the write is answered: two requests in flight together may
	// be answered in either order.
	c.request(wire.CmdRead, 0, 2, 0, 4096, nil)
	if h, errno, got := c.simple(4096); h != 2 || errno != 0 || !bytes.Equal(got, p) {
		t.Fatalf("honest read: handle %d errno %d", h, errno)
	}
}

// A client that stops sending a payload it announced is closed after
// ReplyTimeout, its memory goes back, and the server serves the next.
func TestPayloadTimeout(t *testing.T) {
	srv := &Server{ReplyTimeout: 200 * time.Millisecond}
	f := newTFix(t, srv)
	s := dialRaw(t, f.sock)
	s.connect("t", false, false)
	s.request(wire.CmdWrite, 0, 1, 0, 8192, make([]byte, 100)) // 100 of 8192 bytes
	if !s.closed() {
		t.Fatal("the connection got a reply instead of being closed")
	}
	st := srv.Stats()
	if st.PayloadTimeouts != 1 || st.ReplyTimeouts != 0 {
		t.Fatalf("PayloadTimeouts %d, ReplyTimeouts %d; want 1 and 0", st.PayloadTimeouts, st.ReplyTimeouts)
	}
	servesNext(t, f)
}

// A write longer than payloadFirst whose rest does not fit the memory
// left is written as it arrives, one payloadFirst piece at a time, instead
// of waiting, holding its first part, for memory others hold.
func TestLongWriteStreamsWhenMemoryIsShort(t *testing.T) {
	const held = MaxPayload - payloadFirst - payloadFirst/2 // leaves 1.5 MiB
	gate := &gateDev{Device: backing.NewMem("g", held), at: 0, entered: make(chan struct{}), release: make(chan struct{})}
	dst := backing.NewMem("d", 4*payloadFirst)
	x := newExport(t, "m", seg{len: held, dev: gate}, seg{len: 4 * payloadFirst, dev: dst})
	srv := &Server{Exports: []*Export{x}, Memory: 1} // the least: maxCost
	sock := nbdtest.ServeUnix(t, srv, ErrServerClosed)
	c := dialRaw(t, sock)
	c.connect("m", false, false)
	c.request(wire.CmdRead, 0, 1, 0, held, nil) // holds all but 1.5 MiB of memory at the gate
	<-gate.entered
	w := dialRaw(t, sock)
	w.connect("m", false, false)
	p := pattern(2*payloadFirst+4096, 0x77)
	w.request(wire.CmdWrite, 0, 2, held, uint32(len(p)), p)
	if h, errno, _ := w.simple(0); h != 2 || errno != 0 {
		t.Fatalf("write: handle %d errno %d", h, errno)
	}
	got := make([]byte, len(p))
	dst.ReadAt(got, 0)
	if !bytes.Equal(got, p) {
		t.Fatal("the streamed write's bytes differ")
	}
	close(gate.release)
	if h, errno, _ := c.simple(int(held)); h != 1 || errno != 0 {
		t.Fatalf("gated read: handle %d errno %d", h, errno)
	}
	waitFor(t, "the memory to come back", func() bool { return srv.Stats().MemoryInUse == 0 })
}

// A request waiting for memory that other connections hold stops waiting
// when its connection is stopped: a forced RemoveExport of its export
// returns while the memory is still held elsewhere.
func TestMemoryWaitEndsWhenStopped(t *testing.T) {
	srv := &Server{Memory: MaxPayload + 2*requestBase}
	f := newTFix(t, srv)
	c := dialRaw(t, f.sock)
	c.connect("t", false, false)
	c.request(wire.CmdRead, 0, 1, offGate, 4096, nil) // held at the gate, with its memory
	<-f.gate.entered
	d := dialRaw(t, f.sock)
	d.connect("ro", false, false)
	d.request(wire.CmdRead, 0, 2, 0, MaxPayload, nil) // needs the whole budget
	waitFor(t, "the request on ro to wait for memory", func() bool { return srv.Stats().MemoryWaits > 0 })
	removed := make(chan error, 1)
	go func() { _, err := srv.RemoveExport("ro", true); removed <- err }()
	if err := nbdtest.Recv(t, removed, "the forced removal of ro, while t's read holds the memory"); err != nil {
		t.Fatal(err)
	}
	close(f.gate.release)
	if h, errno, _ := c.simple(4096); h != 1 || errno != 0 {
		t.Fatalf("gated read: handle %d errno %d", h, errno)
	}
}

// hungDev holds every read until release, as a device that stops
// answering does, and counts the reads it holds.
type hungDev struct {
	backing.Device
	held    atomic.Int64
	release chan struct{}
}

func (d *hungDev) ReadAt(p []byte, off int64) (int, error) {
	d.held.Add(1)
	<-d.release
	return d.Device.ReadAt(p, off)
}

// TestHungExportLeavesMemoryForOthers: the clients of an export whose
// device hangs keep sending reads, whose buffers stay charged while they
// wait. They hold at most ExportMemory, their other requests wait for it,
// and another export's client is served meanwhile; without the export's
// budget they would take all of Memory and that client would wait for the
// hung device.
func TestHungExportLeavesMemoryForOthers(t *testing.T) {
	const piece, size = 4 << 20, 64 << 20
	hung := &hungDev{Device: backing.NewMem("h", size), release: make(chan struct{})}
	srv := &Server{Memory: 4 * maxCost, Exports: []*Export{
		newExport(t, "hung", seg{len: size, dev: hung}),
		newExport(t, "ok", seg{len: size, dev: backing.NewMem("ok", size)}),
	}}
	sock := nbdtest.ServeUnix(t, srv, ErrServerClosed)
	var unhang sync.Once
	release := func() { unhang.Do(func() { close(hung.release) }) }
	t.Cleanup(release)         // before the server's: its shutdown waits for the reads
	const conns, reads = 4, 12 // 48 MiB a connection, 192 MiB in all
	var clients []*rawClient
	for range conns {
		c := dialRaw(t, sock)
		c.connect("hung", false, false)
		for h := range reads {
			c.request(wire.CmdRead, 0, uint64(h+1), uint64(h)*piece, piece, nil)
		}
		clients = append(clients, c)
	}
	fit := srv.exportMemory() / (requestBase + piece)
	waitFor(t, "the hung export's budget to fill and its next read to wait", func() bool {
		return hung.held.Load() >= fit && srv.Stats().MemoryWaits > 0
	})

	d := dialRaw(t, sock)
	d.connect("ok", false, false)
	d.request(wire.CmdRead, 0, 1, 0, piece, nil)
	if h, errno, _ := d.simple(piece); h != 1 || errno != 0 {
		t.Fatalf("read on the other export: handle %d errno %d", h, errno)
	}
	if n := hung.held.Load(); n != fit {
		t.Fatalf("%d reads reached the hung device; its budget has room for %d", n, fit)
	}

	release()
	// Each connection's replies are taken on their own goroutine: the
	// requests still waiting for the budget get it as the replies of every
	// connection leave.
	errs := make(chan uint32, conns*reads)
	var wg sync.WaitGroup
	for _, c := range clients {
		wg.Go(func() {
			for range reads {
				_, errno, _ := c.simple(piece)
				errs <- errno
			}
		})
	}
	wg.Wait()
	close(errs)
	for errno := range errs {
		if errno != 0 {
			t.Fatalf("read of the hung export, once released: errno %d", errno)
		}
	}
	waitFor(t, "every request's memory to come back", func() bool { return srv.Stats().MemoryInUse == 0 })
}
