package nbdtarget

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/nbdmapper/nbdmapper/backing"
	"github.com/nbdmapper/nbdmapper/internal/testing/nbdtest"
	"github.com/nbdmapper/nbdmapper/wire"
)

// fileDev writes data to a new file of size bytes (a hole after data) and
// opens it behind a hole map, as the pool opens a table's files.
func fileDev(t *testing.T, name string, data []byte, size int64) *backing.HoleMap {
	t.Helper()
	path := filepath.Join(t.TempDir(), name)
	if err := os.WriteFile(path, data, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(path, size); err != nil {
		t.Fatal(err)
	}
	f, err := backing.OpenFile(path, false)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	return backing.NewHoleMap(f)
}

// brokenSplice splices half of what it is asked for and then fails, as a
// disk failing in the middle of a read would.
type brokenSplice struct{ *backing.File }

func (b brokenSplice) SpliceTo(pipe int, off int64, n int) (bool, error) {
	if _, err := b.File.SpliceTo(pipe, off, n/2); err != nil {
		return true, err
	}
	return true, syscall.EIO
}

// pipesSettled waits until every pipe the server made is back in its pool
// and reports how many there are.
func pipesSettled(t *testing.T, srv *Server) int {
	t.Helper()
	deadline := time.Now().Add(nbdtest.Bound)
	for {
		pp := &srv.pipes
		pp.mu.Lock()
		made, free := pp.made, len(pp.free)
		pp.mu.Unlock()
		if made == free {
			return made
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d pipes made, %d back in the pool", made, free)
		}
		time.Sleep(time.Millisecond)
	}
}

// Large reads of a file are spliced, and carry the file's bytes in every
// reply form: simple replies, one data chunk, several reads in flight at
// once over the pool's pipes. Reads below spliceMin, and reads that touch
// a hole the map knows, are read into buffers as before.
func TestSplicedReads(t *testing.T) {
	const size = 4 << 20
	data := pattern(size, 9)
	x := newExport(t, "f", seg{len: size, dev: fileDev(t, "f.img", data, size)},
		seg{len: 2 << 20, dev: fileDev(t, "sparse.img", data[:64*kb], 2<<20)})
	srv := &Server{Exports: []*Export{x}}
	sock := nbdtest.ServeUnix(t, srv, ErrServerClosed)
	spliced := func() int64 { return srv.Stats().Exports[0].ReadSplicedBytes }
	// A reply is counted once it has all gone into the socket, so its
	// client can have it first: wait for the count, do not just read it.
	splicedReach := func(want int64, what string) {
		t.Helper()
		nbdtest.Until(t, what, func() bool { return spliced() >= want })
	}

	c := dialRaw(t, sock)
	c.connect("f", false, false)
	c.request(wire.CmdRead, 0, 1, 4096, spliceMax, nil)
	if _, errno, got := c.simple(spliceMax); errno != 0 || !bytes.Equal(got, data[4096:4096+spliceMax]) {
		t.Fatalf("simple reply: errno %d, or other bytes than the file's", errno)
	}
	splicedReach(spliceMax, "the 1 MiB read to be counted as spliced")
	if n := spliced(); n != spliceMax {
		t.Fatalf("%d bytes spliced after one 1 MiB read, want %d", n, spliceMax)
	}

	s := dialRaw(t, sock)
	s.connect("f", true, false)
	const depth = 8
	offs := make(map[uint64]uint64)
	for h := range uint64(depth) {
		offs[h] = h*(size/depth) + h*512
		s.request(wire.CmdRead, 0, h, offs[h], spliceMin+uint32(h)*4096, nil)
	}
	want := int64(spliceMax)
	for range depth {
		ch := s.chunk()
		off := offs[ch.handle]
		n := spliceMin + int(ch.handle)*4096
		if ch.typ != wire.ChunkOffsetData || ch.flags&wire.ReplyFlagDone == 0 || !bytes.Equal(ch.payload[8:], data[off:off+uint64(n)]) {
			t.Fatalf("read %d+%d: chunk type %d flags %#x, or other bytes than the file's", off, n, ch.typ, ch.flags)
		}
		want += int64(n)
	}
	splicedReach(want, "the reads in flight to be counted as spliced")
	if n := spliced(); n != want {
		t.Fatalf("%d bytes spliced, want %d", n, want)
	}

	s.request(wire.CmdRead, 0, 99, 0, spliceMin-4096, nil)
	if ch := s.chunk(); ch.typ != wire.ChunkOffsetData || !bytes.Equal(ch.payload[8:], data[:spliceMin-4096]) {
		t.Fatalf("short read: chunk type %d, or other bytes", ch.typ)
	}
	if n := spliced(); n != want {
		t.Fatalf("a read below spliceMin was spliced: %d bytes, want %d", n, want)
	}
	// Over the sparse file's hole: a data chunk and a hole chunk; with DF,
	// one data chunk with the hole's zeros. Neither is spliced.
	if got := describe(t, readChunks(s, 0, 100, size, spliceMax)); got != fmt.Sprintf("DATA %d+%d HOLE %d+%d!", size, 64*kb, size+64*kb, spliceMax-64*kb) {
		t.Fatalf("read over a hole: %s", got)
	}
	s.request(wire.CmdRead, wire.CfDF, 101, size, spliceMax, nil)
	if ch := s.chunk(); ch.typ != wire.ChunkOffsetData || !bytes.Equal(ch.payload[8:], append(data[:64*kb:64*kb], make([]byte, spliceMax-64*kb)...)) {
		t.Fatalf("DF read over a hole: chunk type %d, or other bytes", ch.typ)
	}
	if n := spliced(); n != want {
		t.Fatalf("a read over a hole was spliced: %d bytes, want %d", n, want)
	}
	if made := pipesSettled(t, srv); made < 1 || made > maxPipes {
		t.Fatalf("%d pipes made", made)
	}
	// Shutdown closes the pool's pipes once no connection is left.
	c.nc.Close()
	s.nc.Close()
	if err := srv.Shutdown(context.Background()); err != nil {
		t.Fatal(err)
	}
	if made := pipesSettled(t, srv); made != 0 {
		t.Fatalf("%d pipes open after Shutdown", made)
	}
}

// With NoSplice every read goes through a buffer, with the same bytes.
func TestNoSplice(t *testing.T) {
	data := pattern(2<<20, 7)
	srv := &Server{Exports: []*Export{newExport(t, "f", seg{len: 2 << 20, dev: fileDev(t, "f.img", data, 2<<20)})}, NoSplice: true}
	c := dialRaw(t, nbdtest.ServeUnix(t, srv, ErrServerClosed))
	c.connect("f", true, false)
	c.request(wire.CmdRead, 0, 1, 4096, spliceMax, nil)
	if ch := c.chunk(); ch.typ != wire.ChunkOffsetData || !bytes.Equal(ch.payload[8:], data[4096:4096+spliceMax]) {
		t.Fatalf("read: chunk type %d, or other bytes", ch.typ)
	}
	if n := srv.Stats().Exports[0].ReadSplicedBytes; n != 0 {
		t.Fatalf("%d bytes spliced with NoSplice", n)
	}
	if made := pipesSettled(t, srv); made != 0 {
		t.Fatalf("%d pipes made with NoSplice", made)
	}
}

// seg1 is the length of each segment of badSpliceFix's export.
const seg1 = 2 << 20

// badSpliceFix serves an export of two files, the first behind bad (a
// device whose splice fails), the second good, and connects a client with
// structured replies. It returns the server's socket and the good file's
// bytes.
func badSpliceFix(t *testing.T, bad func(*backing.File) backing.Device) (srv *Server, sock string, c *rawClient, good []byte) {
	t.Helper()
	good = pattern(seg1, 3)
	f := fileDev(t, "bad.img", pattern(seg1, 4), seg1).Unwrap().(*backing.File)
	x := newExport(t, "f", seg{len: seg1, dev: bad(f)}, seg{len: seg1, dev: fileDev(t, "good.img", good, seg1)})
	srv = &Server{Exports: []*Export{x}}
	sock = nbdtest.ServeUnix(t, srv, ErrServerClosed)
	c = dialRaw(t, sock)
	c.connect("f", true, false)
	return srv, sock, c, good
}

// A read whose splice fails gets the spec's error reply and the
// connection goes on; the pipe holding part of it is closed, not reused.
// So is the pipe of a reply whose client is gone.
func TestSplicedReadFailures(t *testing.T) {
	srv, sock, c, good := badSpliceFix(t, func(f *backing.File) backing.Device { return brokenSplice{f} })
	for i := range 3 {
		c.request(wire.CmdRead, 0, 1, 0, spliceMax, nil)
		ch := c.chunk()
		errno, _, off, err := chunkErrno(ch)
		if err != nil || errno != wire.EIO || off != 0 || ch.flags&wire.ReplyFlagDone == 0 {
			t.Fatalf("read %d of the failing file: chunk type %d errno %d at %d (%v), want EIO at 0", i, ch.typ, errno, off, err)
		}
		c.request(wire.CmdRead, 0, 2, seg1, spliceMax, nil)
		if ch := c.chunk(); ch.typ != wire.ChunkOffsetData || !bytes.Equal(ch.payload[8:], good[:spliceMax]) {
			t.Fatalf("read %d of the good file after a failed one: chunk type %d, or other bytes", i, ch.typ)
		}
	}
	if made := pipesSettled(t, srv); made != 1 {
		t.Errorf("%d pipes in the pool, want the one the good reads share", made)
	}

	gone := dialRaw(t, sock)
	gone.connect("f", true, false)
	for h := range uint64(4) {
		gone.request(wire.CmdRead, 0, h, seg1, spliceMax, nil)
	}
	gone.nc.Close()
	deadline := time.Now().Add(nbdtest.Bound)
	for srv.Stats().Connections > 1 {
		if time.Now().After(deadline) {
			t.Fatal("the connection whose client left is still open")
		}
		time.Sleep(time.Millisecond)
	}
	pipesSettled(t, srv)
	c.request(wire.CmdRead, 0, 3, seg1, spliceMax, nil)
	if ch := c.chunk(); ch.typ != wire.ChunkOffsetData || !bytes.Equal(ch.payload[8:], good[:spliceMax]) {
		t.Fatalf("read after a client left mid-reply: chunk type %d, or other bytes", ch.typ)
	}
}

// panicSplice panics in the middle of a splice.
type panicSplice struct{ *backing.File }

func (p panicSplice) SpliceTo(pipe int, off int64, n int) (bool, error) {
	p.File.SpliceTo(pipe, off, n/2)
	panic("device bug: splice")
}

// A panic in a device's splice is an EIO reply like any panic below the
// protocol edge, and the pipe it left half full is closed, not pooled.
func TestSplicePanic(t *testing.T) {
	srv, _, c, good := badSpliceFix(t, func(f *backing.File) backing.Device { return panicSplice{f} })
	c.request(wire.CmdRead, 0, 1, 0, spliceMax, nil)
	if errno, _, _, err := chunkErrno(c.chunk()); err != nil || errno != wire.EIO {
		t.Fatalf("read through a panicking splice: errno %d (%v), want EIO", errno, err)
	}
	if n := srv.Stats().Panics; n != 1 {
		t.Fatalf("%d panics counted, want 1", n)
	}
	if made := pipesSettled(t, srv); made != 0 {
		t.Fatalf("%d pipes left after the panic, want the half-full one closed", made)
	}
	c.request(wire.CmdRead, 0, 2, seg1, spliceMax, nil)
	if ch := c.chunk(); ch.typ != wire.ChunkOffsetData || !bytes.Equal(ch.payload[8:], good[:spliceMax]) {
		t.Fatalf("read after the panic: chunk type %d, or other bytes", ch.typ)
	}
}

// TestPipePoolNoRoom: a pipe that cannot get room for spliceMax stops the
// pool making pipes for noRoomWait, not for good, and free pipes are lent
// all along; running out of descriptors stops nothing.
func TestPipePoolNoRoom(t *testing.T) {
	var pp pipePool
	defer pp.close()
	spare := pp.get()
	if spare == nil {
		t.Fatal("the pool made no pipe")
	}
	tries := 0
	fail := func(err error) func() (*pipe, error) {
		return func() (*pipe, error) { tries++; return nil, err }
	}

	pp.newPipe = fail(syscall.EMFILE)
	if pp.get() != nil || pp.get() != nil || tries != 2 {
		t.Fatalf("out of descriptors: %d tries for two gets, want 2 and no pipe", tries)
	}

	tries = 0
	pp.newPipe = fail(errNoRoom)
	if pp.get() != nil || pp.get() != nil || tries != 1 {
		t.Fatalf("no room: %d tries for two gets, want 1 and no pipe", tries)
	}
	pp.put(spare)
	if p := pp.get(); p != spare {
		t.Fatal("a free pipe was not lent while no new one could be made")
	}

	// noRoomWait later, the pool makes pipes again.
	pp.newPipe = nil
	pp.noRoom = time.Now().Add(-noRoomWait)
	p := pp.get()
	if p == nil {
		t.Fatal("no pipe made after noRoomWait")
	}
	if !pp.noRoom.IsZero() {
		t.Fatal("a pipe was made and the pool still counts from its failure")
	}
	pp.put(p)
	pp.put(spare)
}

// A unix socket takes a whole 1 MiB spliced reply at once (unixSendBuffer):
// the splice completes while the client has read nothing yet, instead of
// waiting for it to drain each 208 KiB.
func TestUnixSocketTakesWholeReply(t *testing.T) {
	if b, err := os.ReadFile("/proc/sys/net/core/wmem_max"); err != nil {
		t.Skip(err)
	} else if n, err := strconv.Atoi(strings.TrimSpace(string(b))); err != nil || n < unixSendBuffer {
		t.Skipf("net.core.wmem_max is %s, below %d: the kernel caps the send buffer there", strings.TrimSpace(string(b)), unixSendBuffer)
	}
	data := pattern(2<<20, 5)
	srv := &Server{Exports: []*Export{newExport(t, "f", seg{len: 2 << 20, dev: fileDev(t, "f.img", data, 2<<20)})}}
	c := dialRaw(t, nbdtest.ServeUnix(t, srv, ErrServerClosed))
	c.connect("f", false, false)
	c.request(wire.CmdRead, 0, 1, 0, spliceMax, nil)
	nbdtest.Until(t, "the whole reply in the socket with nothing read", func() bool {
		return srv.Stats().Exports[0].ReadSplicedBytes == spliceMax
	})
	if _, errno, got := c.simple(spliceMax); errno != 0 || !bytes.Equal(got, data[:spliceMax]) {
		t.Fatalf("reply: errno %d, or other bytes than the file's", errno)
	}
}

// A read that starts inside a page spans one page more than its length
// fills, and a pipe's room is counted in pages: such reads get a head read
// into a buffer up to the first page boundary, and the rest is spliced.
// Every alignment gives the file's bytes, in simple and structured
// replies, and only the head goes through a buffer.
func TestSplicedUnalignedReads(t *testing.T) {
	const size = 4 << 20
	data := pattern(size, 5)
	srv := &Server{Exports: []*Export{newExport(t, "f", seg{len: size, dev: fileDev(t, "f.img", data, size)})}}
	sock := nbdtest.ServeUnix(t, srv, ErrServerClosed)
	spliced := func() int64 { return srv.Stats().Exports[0].ReadSplicedBytes }
	page := uint64(pageSize)
	offs := []uint64{0, 512, page - 512, page, page + 512, spliceMax + 512, size - spliceMax - 512}
	lens := []uint32{spliceMin, spliceMin + 512, spliceMax - 512, uint32(spliceMax - page + 512), spliceMax}
	for _, structured := range []bool{false, true} {
		c := dialRaw(t, sock)
		c.connect("f", structured, false)
		var h uint64
		for _, off := range offs {
			for _, n := range lens {
				h++
				before := spliced()
				c.request(wire.CmdRead, 0, h, off, n, nil)
				var got []byte
				if structured {
					ch := c.chunk()
					if ch.typ != wire.ChunkOffsetData || ch.flags&wire.ReplyFlagDone == 0 {
						t.Fatalf("structured read %d+%d: chunk type %d flags %#x", off, n, ch.typ, ch.flags)
					}
					got = ch.payload[8:]
				} else {
					var errno uint32
					if _, errno, got = c.simple(int(n)); errno != 0 {
						t.Fatalf("simple read %d+%d: errno %d", off, n, errno)
					}
				}
				if !bytes.Equal(got, data[off:off+uint64(n)]) {
					t.Fatalf("read %d+%d (structured %v): other bytes than the file's", off, n, structured)
				}
				want := before + int64(n) - head(int64(off), int64(n), spliceMax/pageSize)
				nbdtest.Until(t, "the read to be counted as spliced", func() bool { return spliced() >= want })
				if got := spliced(); got != want {
					t.Fatalf("read %d+%d: %d bytes spliced, want %d", off, n, got-before, want-before)
				}
			}
		}
	}
}

func TestHead(t *testing.T) {
	const pages = spliceMax / 4096
	for _, tc := range []struct {
		name   string
		off, n int64
		want   int64
	}{
		{"aligned, whole pipe", 0, spliceMax, 0},
		{"aligned, short", 8192, spliceMin, 0},
		{"unaligned, fits", 512, spliceMax - 512, 0},
		{"unaligned, fits to the last byte", 4095, spliceMax - 4095, 0},
		{"unaligned, one byte over", 4095, spliceMax - 4094, 1},
		{"unaligned, whole pipe", 512, spliceMax, 4096 - 512},
		{"last sector of a page", 4096 + 3584, spliceMax, 512},
	} {
		if pageSize != 4096 {
			t.Skipf("cases are for 4 KiB pages, not %d", pageSize)
		}
		if got := head(tc.off, tc.n, pages); got != tc.want {
			t.Errorf("%s: head(%d, %d, %d) = %d, want %d", tc.name, tc.off, tc.n, pages, got, tc.want)
		}
	}
}

// failHead fails reads (the head of an unaligned spliced read) and
// splices as the file does.
type failHead struct{ *backing.File }

func (f failHead) ReadAt(p []byte, off int64) (int, error) { return 0, syscall.EIO }

// A head read that fails is an error reply at the read's offset, and the
// next read is spliced as before.
func TestSplicedHeadFailure(t *testing.T) {
	srv, _, c, good := badSpliceFix(t, func(f *backing.File) backing.Device { return failHead{f} })
	c.request(wire.CmdRead, 0, 1, 512, spliceMax, nil)
	ch := c.chunk()
	if errno, _, off, err := chunkErrno(ch); err != nil || errno != wire.EIO || off != 512 {
		t.Fatalf("read whose head fails: chunk type %d errno %d at %d (%v), want EIO at 512", ch.typ, errno, off, err)
	}
	c.request(wire.CmdRead, 0, 2, seg1+512, spliceMax, nil)
	if ch := c.chunk(); ch.typ != wire.ChunkOffsetData || !bytes.Equal(ch.payload[8:], good[512:512+spliceMax]) {
		t.Fatalf("read of the good file after a failed head: chunk type %d, or other bytes", ch.typ)
	}
	if made := pipesSettled(t, srv); made != 1 {
		t.Errorf("%d pipes in the pool, want the good read's", made)
	}
}
