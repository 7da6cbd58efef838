package nbdtarget

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"runtime/debug"
	"strconv"
	"strings"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/nbdmapper/nbdmapper/backing"
	"github.com/nbdmapper/nbdmapper/internal/testing/nbdtest"
	"github.com/nbdmapper/nbdmapper/wire"
)

// A socket out of the poller reads, writes, times out and closes as one in
// it does (TestRawSocket's checks), on unix and TCP sockets, and so does
// one brought back.
func TestRawSocketOutOfPoller(t *testing.T) {
	for _, network := range []string{"unix", "tcp"} {
		for _, back := range []bool{false, true} {
			name := network + " out"
			if back {
				name += " and back"
			}
			t.Run(name, func(t *testing.T) {
				addr := "127.0.0.1:0"
				if network == "unix" {
					addr = filepath.Join(t.TempDir(), "s")
				}
				rs, client := rawSocketPairOn(t, network, addr)
				if !rs.leave() {
					t.Fatal("an idle socket did not leave the poller")
				}
				if back && !rs.rejoin() {
					t.Fatal("an idle socket out of the poller did not come back")
				}
				if rs.outside() == back {
					t.Fatalf("out of the poller: %v, want %v", rs.outside(), !back)
				}
				checkRawSocket(t, rs, client)
			})
		}
	}
}

// waitingRead starts a read of rs and returns its result's channel once
// the read waits for the socket.
func waitingRead(t *testing.T, rs *rawSocket) <-chan error {
	t.Helper()
	w := rs.waits.Load()
	errs := make(chan error, 1)
	go func() {
		_, err := rs.Read(make([]byte, 64))
		errs <- err
	}()
	nbdtest.Until(t, "the read to wait for the socket", func() bool { return rs.waits.Load() > w })
	return errs
}

// recvErr returns what errs gives, failing the test if it gives nothing.
func recvErr(t *testing.T, errs <-chan error, what string) error {
	t.Helper()
	select {
	case err := <-errs:
		return err
	case <-time.After(nbdtest.Bound):
		t.Fatalf("%s did not return", what)
		return nil
	}
}

// Out of the poller, a read that waits ends when a read deadline is set
// meanwhile (Shutdown stops a connection's reader so), and a waiting read
// and a write waiting for room both end when the socket is closed.
func TestOutOfPollerWakes(t *testing.T) {
	rs, client := outOfPoller(t, lingerTime)
	read := waitingRead(t, rs)
	rs.SetReadDeadline(time.Now())
	if err := recvErr(t, read, "a waiting read given a deadline"); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("a waiting read given a deadline: %v", err)
	}
	rs.SetReadDeadline(time.Time{})
	read = waitingRead(t, rs)
	if _, err := client.Write([]byte("x")); err != nil {
		t.Fatal(err)
	}
	if err := recvErr(t, read, "a read after its deadline was cleared"); err != nil {
		t.Fatalf("a read after its deadline was cleared: %v", err)
	}

	read = waitingRead(t, rs)
	write := fillingWrite(t, rs, client)
	rs.Close()
	for what, errs := range map[string]<-chan error{"a waiting read": read, "a waiting write": write} {
		if err := recvErr(t, errs, what+" of a socket closed"); !errors.Is(err, net.ErrClosed) {
			t.Fatalf("%s of a socket closed: %v", what, err)
		}
	}
}

// fillingWrite starts writes to rs until one fails, and returns that
// failure's channel once they have filled the socket: the client reads
// nothing, so the write under way waits for room.
func fillingWrite(t *testing.T, rs *rawSocket, client net.Conn) <-chan error {
	t.Helper()
	errs := make(chan error, 1)
	go func() {
		p := make([]byte, 1<<20)
		for {
			if _, err := rs.Write(p); err != nil {
				errs <- err
				return
			}
		}
	}()
	nbdtest.Until(t, "the socket to fill", func() bool { return queued(t, client) >= 64<<10 })
	return errs
}

// queued is how many bytes wait in nc's socket to be read (SIOCINQ).
func queued(t *testing.T, nc net.Conn) int {
	t.Helper()
	var n int32
	var errno unix.Errno
	rawConn(nc).Control(func(fd uintptr) {
		_, _, errno = unix.Syscall(unix.SYS_IOCTL, fd, unix.SIOCINQ, uintptr(unsafe.Pointer(&n)))
	})
	if errno != 0 {
		t.Fatal(errno)
	}
	return int(n)
}

// A socket moves into or out of the poller only when no call is in
// progress on it: a read that waits holds it where it is.
func TestMovesWaitForNoCall(t *testing.T) {
	rs, client := rawSocketPair(t)
	t.Cleanup(func() { rs.Close() })
	for _, move := range []struct {
		name string
		do   func() bool
	}{{"leave", rs.leave}, {"rejoin", rs.rejoin}} {
		read := waitingRead(t, rs)
		if move.do() {
			t.Fatalf("%s under a waiting read", move.name)
		}
		if _, err := client.Write([]byte("x")); err != nil {
			t.Fatal(err)
		}
		if err := recvErr(t, read, "the read"); err != nil {
			t.Fatal(err)
		}
		if !move.do() {
			t.Fatalf("no %s once the read returned", move.name)
		}
	}
	if rs.outside() {
		t.Fatal("out of the poller after leave and rejoin")
	}
}

// onlySocket is the server's end of its one connection.
func onlySocket(t *testing.T, srv *Server) *rawSocket {
	t.Helper()
	srv.mu.Lock()
	defer srv.mu.Unlock()
	if len(srv.conns) != 1 {
		t.Fatalf("%d connections, want one", len(srv.conns))
	}
	for c := range srv.conns {
		return c.sock.(*rawSocket)
	}
	return nil
}

// Deadlines go with the socket: one set in the poller holds out of it,
// and one set out of it holds once the socket is back.
func TestDeadlinesFollowTheSocket(t *testing.T) {
	rs, _ := rawSocketPair(t)
	t.Cleanup(func() { rs.Close() })
	buf := make([]byte, 64)
	rs.SetReadDeadline(longAgo)
	if !rs.leave() {
		t.Fatal("an idle socket did not leave the poller")
	}
	if _, err := rs.Read(buf); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("out of the poller, a read past the deadline set in it: %v", err)
	}
	rs.SetReadDeadline(time.Time{})
	rs.SetWriteDeadline(longAgo)
	if !rs.rejoin() {
		t.Fatal("an idle socket out of the poller did not come back")
	}
	if _, err := rs.Write(buf); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("back in the poller, a write past the deadline set out of it: %v", err)
	}
	rs.SetReadDeadline(longAgo)
	if _, err := rs.Read(buf); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("back in the poller, a read past its deadline: %v", err)
	}
}

// Out of the poller, a lingering read that finds the socket empty waits
// in recv(2) on the blocking descriptor, timed out after ownLinger, and a
// signal to its thread does not end it; one that does not linger waits in
// poll(2). Back in the poller the descriptor is non-blocking and untimed
// again.
func TestOutOfPollerReadWaitsInRecv(t *testing.T) {
	rs, client := outOfPoller(t, nbdtest.Bound)
	fd := rs.own.fd
	if nonblock, timeout := descriptorMode(t, fd); nonblock || timeout != nbdtest.Bound {
		t.Fatalf("out of the poller: non-blocking %v, recv timeout %v; want blocking, %v", nonblock, timeout, nbdtest.Bound)
	}

	read := waitingRead(t, rs)
	nbdtest.Until(t, "the read that does not linger to wait", func() bool { return threadIn(t, unix.SYS_PPOLL, -1) != 0 })
	if threadIn(t, unix.SYS_RECVFROM, fd) != 0 {
		t.Fatal("a read that does not linger waits in recvfrom")
	}
	if _, err := client.Write([]byte("x")); err != nil {
		t.Fatal(err)
	}
	if err := recvErr(t, read, "the read that does not linger"); err != nil {
		t.Fatal(err)
	}

	rs.linger.Store(int64(lingerTime)) // as conn.serial has it
	got := readString(rs)
	var tid int
	nbdtest.Until(t, "the read to wait in recvfrom", func() bool {
		tid = threadIn(t, unix.SYS_RECVFROM, fd)
		return tid != 0
	})
	// The recv has a timeout, so a signal ends it with EINTR (Go's
	// preemption signal here), and the read goes on waiting.
	if err := unix.Tgkill(os.Getpid(), tid, unix.SIGURG); err != nil {
		t.Fatal(err)
	}
	nbdtest.Until(t, "the signal to be taken", func() bool { return !signalPending(t, tid, unix.SIGURG) })
	nbdtest.Until(t, "the read to wait in recvfrom again", func() bool { return threadIn(t, unix.SYS_RECVFROM, fd) != 0 })
	if _, err := client.Write([]byte("x")); err != nil {
		t.Fatal(err)
	}
	if g := nbdtest.Recv(t, got, "the read"); g != "x" {
		t.Fatalf("read out of the poller: %q, want x", g)
	}
	if !rs.rejoin() {
		t.Fatal("an idle socket out of the poller did not come back")
	}
	rawConn(rs.Conn).Control(func(d uintptr) { fd = int(d) })
	if nonblock, timeout := descriptorMode(t, fd); !nonblock || timeout != 0 {
		t.Fatalf("back in the poller: non-blocking %v, recv timeout %v; want non-blocking, none", nonblock, timeout)
	}
}

// A lingering read out of the poller goes straight into recv(2), whether
// the socket holds something or not: no probe finds it empty first, which
// cost serial mode a system call per request. It counts a wait only once
// the recv has timed out, and then waits in poll(2).
func TestOutOfPollerReadSkipsTheProbe(t *testing.T) {
	rs, client := outOfPoller(t, nbdtest.Bound)
	rs.linger.Store(int64(lingerTime)) // as conn.serial has it
	fd := rs.own.fd
	send := func(c net.Conn, s string) {
		t.Helper()
		if _, err := c.Write([]byte(s)); err != nil {
			t.Fatal(err)
		}
	}
	for i := range 10 {
		var got <-chan string
		if i%2 == 0 { // the request comes while the read waits
			got = readString(rs)
			nbdtest.Until(t, "the read to wait in recvfrom", func() bool { return threadIn(t, unix.SYS_RECVFROM, fd) != 0 })
			send(client, "x")
		} else { // the request is there before the read
			send(client, "x")
			got = readString(rs)
		}
		if g := nbdtest.Recv(t, got, "the read"); g != "x" {
			t.Fatalf("read %d: %q, want x", i, g)
		}
	}
	if n := rs.waits.Load(); n != 0 {
		t.Fatalf("%d reads found the socket empty before waiting in recv, want none", n)
	}

	// With the receive timeout the socket has out of the poller.
	rs2, client2 := outOfPoller(t, lingerTime)
	rs2.linger.Store(int64(lingerTime))
	got := readString(rs2)
	nbdtest.Until(t, "the read to time out of recv and wait in ppoll", func() bool { return threadIn(t, unix.SYS_PPOLL, -1) != 0 })
	if n := rs2.waits.Load(); n != 1 {
		t.Fatalf("a read whose recv timed out counted %d waits, want 1", n)
	}
	send(client2, "y")
	if g := nbdtest.Recv(t, got, "the read"); g != "y" {
		t.Fatalf("read after the timeout: %q, want y", g)
	}
}

// Out of the poller, ReadWhole waits for all of its bytes in one recv(2)
// with MSG_WAITALL: a 1 MiB write from a client whose send buffer lets it
// through in pieces of 128 KiB at most is taken by one call. A signal
// ends the call, which then waits in poll(2), not counted as a wait
// (nothing was found missing); so does a recv that times out with
// nothing, counted. Bytes taken before a timeout are kept, and the read
// goes on for the rest; a stream that ends short of p is an unexpected
// EOF. In the poller ReadWhole reads what comes until p is full.
//
// The garbage collector is off: its stop of the world signals the thread
// too. Go's sysmon signals a goroutine that has run for 10 ms, as a raw
// call counts, so a 1 MiB write that takes the client longer than that is
// tried again.
func TestOutOfPollerReadWhole(t *testing.T) {
	defer debug.SetGCPercent(debug.SetGCPercent(-1))
	want := make([]byte, 1<<20)
	for i := range want {
		want[i] = byte(i * 7 / 4096)
	}
	half := len(want) / 2
	readWhole := func(rs *rawSocket, p []byte) <-chan error {
		errs := make(chan error, 1)
		go func() { errs <- rs.ReadWhole(p) }()
		return errs
	}
	write := func(c net.Conn, p []byte) {
		t.Helper()
		if _, err := c.Write(p); err != nil {
			t.Fatal(err)
		}
	}
	check := func(done <-chan error, p, want []byte, what string) {
		t.Helper()
		if err := recvErr(t, done, what); err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		if !bytes.Equal(p, want) {
			t.Fatalf("%s: other bytes than were sent", what)
		}
	}

	rs, client := outOfPoller(t, nbdtest.Bound)
	rawConn(client).Control(func(fd uintptr) {
		if err := unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_SNDBUF, 64<<10); err != nil {
			t.Fatal(err)
		}
	})
	p := make([]byte, len(want))
	var whole, tries int
	for ; whole == 0 && tries < 20; tries++ {
		clear(p)
		sent := make(chan error, 1)
		go func() { _, err := client.Write(want); sent <- err }()
		rs.rd.mu.Lock()
		n, err := rs.read(p, true) // one call of ReadWhole's
		rs.rd.mu.Unlock()
		if err != nil {
			t.Fatal(err)
		}
		if n == len(p) {
			whole++
		} else if err := rs.ReadWhole(p[n:]); err != nil {
			t.Fatal(err)
		}
		check(sent, p, want, "the 1 MiB write")
	}
	if whole == 0 {
		t.Fatalf("in %d tries no read took a 1 MiB write in one call", tries)
	}
	fd := rs.own.fd
	done := readWhole(rs, p)
	nbdtest.Until(t, "the read ended by a signal to wait in ppoll", func() bool {
		if tid := threadAt(t, recvCall(fd, p, unix.MSG_WAITALL)); tid != 0 {
			unix.Tgkill(os.Getpid(), tid, unix.SIGURG) // or sysmon's, after 10 ms
		}
		return threadIn(t, unix.SYS_PPOLL, -1) != 0
	})
	write(client, want)
	check(done, p, want, "the read after a signal")
	if n := rs.waits.Load(); n != 0 {
		t.Fatalf("ReadWhole counted %d waits, want none: its recv never timed out", n)
	}

	// With the receive timeout the socket has out of the poller. A recv
	// that times out with nothing counts a wait; one that a signal ends
	// does not, and sysmon's may come at any time to a goroutine that
	// inherited a time slice, so the read is tried until one times out.
	rs2, client2 := outOfPoller(t, lingerTime)
	p2 := make([]byte, half)
	for tries := 1; ; tries++ {
		w := rs2.waits.Load()
		done = readWhole(rs2, p2[:1])
		nbdtest.Until(t, "the read to leave recv and wait in ppoll", func() bool { return threadIn(t, unix.SYS_PPOLL, -1) != 0 })
		n := rs2.waits.Load() - w
		write(client2, want[:1])
		check(done, p2[:1], want[:1], "a read that waited in ppoll")
		if n == 1 {
			break
		}
		if n > 1 || tries == 20 {
			t.Fatalf("a read that left its recv counted %d waits, want 1 once it timed out (%d tries)", n, tries)
		}
	}
	done = readWhole(rs2, p2)
	write(client2, want[:half/2])
	nbdtest.Until(t, "the read to take the first part and wait in ppoll again", func() bool {
		inq, err := unix.IoctlGetInt(rs2.own.fd, unix.SIOCINQ)
		return err == nil && inq == 0 && threadIn(t, unix.SYS_PPOLL, -1) != 0
	})
	write(client2, want[half/2:half])
	check(done, p2, want[:half], "the read across timeouts")
	done = readWhole(rs2, p2)
	write(client2, want[:100])
	client2.Close()
	if err := recvErr(t, done, "the read of a stream that ends"); !errors.Is(err, io.ErrUnexpectedEOF) {
		t.Fatalf("ReadWhole of a stream that ends short: %v, want %v", err, io.ErrUnexpectedEOF)
	}

	rs3, client3 := rawSocketPair(t)
	done = readWhole(rs3, p2)
	for i := 0; i < half; i += half / 4 {
		write(client3, want[i:i+half/4])
	}
	check(done, p2, want[:half], "the read in the poller")
}

// The reader of a lone connection writing in bulk, whose socket is then
// out of the poller, waits for a payload's rest in recv(2) with
// MSG_WAITALL (conn.readWhole): with half of a 1 MiB payload sent, it
// counts no wait, where a read that takes what has come finds the socket
// empty, and counts one, before it waits in poll(2). On a crowded server
// it does not hold its P waiting, and so waits that way. (Crowded is set
// by hand here, as more connections than Ps would set it, so that the test
// keeps a P to watch the reader from; the socket's receive timeout is
// long, so that the recv ends only at a signal.)
func TestBulkPayloadInOneRecv(t *testing.T) {
	const mb = 1 << 20
	for _, crowded := range []bool{false, true} {
		t.Run(fmt.Sprintf("crowded %v", crowded), func(t *testing.T) {
			defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(2))
			srv := &Server{
				Exports:        []*Export{newExport(t, "s", seg{len: mb, dev: backing.NewMem("s", mb)})},
				OnActive:       func(int) {},
				beforeTransmit: func(c *conn) { c.sock.(*rawSocket).ownLinger = nbdtest.Bound },
			}
			c := dialRaw(t, nbdtest.ServeUnix(t, srv, ErrServerClosed))
			c.connect("s", false, false)
			payload := make([]byte, mb)
			h := uint64(0)
			write := func() {
				t.Helper()
				h++
				c.request(wire.CmdWrite, 0, h, 0, mb, payload)
				if got, errno, _ := c.simple(0); got != h || errno != 0 {
					t.Fatalf("write %d: reply %d, errno %d", h, got, errno)
				}
			}
			for range bulkScore {
				write()
			}
			rs := onlySocket(t, srv)
			for tries := 0; !rs.outside(); tries++ {
				// A move out of the poller is skipped while a call is on
				// the socket, such as the last reply's send, and tried
				// again at the next request.
				if tries == 10 {
					t.Fatal("a lone connection writing in bulk stays in the poller")
				}
				write()
			}
			if srv.crowded.Load() {
				t.Fatal("one connection crowds a server with two Ps")
			}
			srv.crowded.Store(crowded)

			nbdtest.Until(t, "the reader to wait for the next request", func() bool { return threadIn(t, unix.SYS_PPOLL, -1) != 0 })
			waits := rs.waits.Load()
			for i := range payload {
				payload[i] = byte(i / 4096)
			}
			h++
			half := mb / 2
			c.write(append(wire.AppendRequest(nil, wire.Request{Type: wire.CmdWrite, Handle: h, Length: mb}), payload[:half]...))
			fd := rs.own.fd
			nbdtest.Until(t, "the reader to take the first half and wait", func() bool {
				inq, err := unix.IoctlGetInt(fd, unix.SIOCINQ)
				if err != nil || inq != 0 {
					return false
				}
				if crowded {
					return threadIn(t, unix.SYS_PPOLL, -1) != 0
				}
				if tid := threadIn(t, unix.SYS_RECVFROM, fd); tid != 0 {
					unix.Tgkill(os.Getpid(), tid, unix.SIGURG) // or sysmon's, after 10 ms
				}
				return threadIn(t, unix.SYS_PPOLL, -1) != 0
			})
			switch n := rs.waits.Load() - waits; {
			case crowded && n == 0:
				t.Fatal("crowded, the reader waits for the payload in recv, holding its P")
			case !crowded && n != 0:
				t.Fatalf("the reader found the socket empty %d times before the payload's second half, want none: it waits in recv", n)
			}
			c.write(payload[half:])
			if got, errno, _ := c.simple(0); got != h || errno != 0 {
				t.Fatalf("the write sent in halves: reply %d, errno %d", got, errno)
			}
			h++
			c.request(wire.CmdRead, 0, h, 0, mb, nil)
			if got, errno, data := c.simple(mb); got != h || errno != 0 || !bytes.Equal(data, payload) {
				t.Fatalf("read back: reply %d, errno %d, same bytes %v", got, errno, bytes.Equal(data, payload))
			}
		})
	}
}

// A write out of the poller that finds the socket full waits in poll(2),
// though the descriptor is blocking: its send(2) does not block (rawIO's
// MSG_DONTWAIT). One that blocked would hold its P, a raw call, until the
// client read, and the garbage collector would wait for it to stop the
// world.
func TestOutOfPollerWriteWaitsInPoll(t *testing.T) {
	rs, client := outOfPoller(t, lingerTime)
	fd := rs.own.fd
	write := fillingWrite(t, rs, client)
	var sending bool
	nbdtest.Until(t, "the write to wait", func() bool {
		sending = threadIn(t, unix.SYS_SENDTO, fd) != 0
		return sending || threadIn(t, unix.SYS_PPOLL, -1) != 0
	})
	if sending {
		t.Fatal("the write waits in sendto, holding its P")
	}
	rs.Close()
	if err := recvErr(t, write, "the write"); !errors.Is(err, net.ErrClosed) {
		t.Fatalf("the write of a socket closed: %v", err)
	}
}

// outOfPoller returns a connected rawSocket taken out of the poller, whose
// lingering reads wait in recv(2) for up to ownLinger, and its client.
func outOfPoller(t *testing.T, ownLinger time.Duration) (*rawSocket, net.Conn) {
	t.Helper()
	rs, client := rawSocketPair(t)
	t.Cleanup(func() { rs.Close() })
	rs.ownLinger = ownLinger
	if !rs.leave() {
		t.Fatal("an idle socket did not leave the poller")
	}
	return rs, client
}

// descriptorMode is whether the socket fd is non-blocking, and its
// receive timeout (SO_RCVTIMEO), failing the test unless its send timeout
// (SO_SNDTIMEO) is the same.
func descriptorMode(t *testing.T, fd int) (nonblock bool, timeout time.Duration) {
	t.Helper()
	fl, err := unix.FcntlInt(uintptr(fd), unix.F_GETFL, 0)
	if err != nil {
		t.Fatal(err)
	}
	rcv, err := unix.GetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO)
	if err != nil {
		t.Fatal(err)
	}
	snd, err := unix.GetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_SNDTIMEO)
	if err != nil {
		t.Fatal(err)
	}
	if *rcv != *snd {
		t.Fatalf("receive timeout %+v, send timeout %+v", *rcv, *snd)
	}
	return fl&unix.O_NONBLOCK != 0, time.Duration(rcv.Nano())
}

// threadIn is a thread of this process that waits in system call nr with
// fd its first argument (any first argument for fd -1), or 0 if none does.
func threadIn(t *testing.T, nr, fd int) int {
	t.Helper()
	if fd < 0 {
		return threadAt(t, fmt.Sprintf("%d ", nr))
	}
	return threadAt(t, fmt.Sprintf("%d 0x%x ", nr, fd))
}

// recvCall is how /proc shows a thread in recvfrom(fd, p, len(p), flags).
func recvCall(fd int, p []byte, flags int) string {
	return fmt.Sprintf("%d 0x%x 0x%x 0x%x 0x%x ", unix.SYS_RECVFROM, fd, uintptr(unsafe.Pointer(&p[0])), len(p), flags)
}

// threadAt is a thread of this process whose system call and arguments
// begin with call, as /proc shows them (threadSyscall), or 0 if none.
func threadAt(t *testing.T, call string) int {
	t.Helper()
	tasks, err := os.ReadDir("/proc/self/task")
	if err != nil {
		t.Fatal(err)
	}
	for _, task := range tasks {
		tid, err := strconv.Atoi(task.Name())
		if err == nil && strings.HasPrefix(threadSyscall(t, tid), call) {
			return tid
		}
	}
	return 0
}

// threadSyscall is /proc/self/task/tid/syscall: the system call the thread
// waits in and its arguments, "running", or "" for a thread gone.
func threadSyscall(t *testing.T, tid int) string {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/self/task/%d/syscall", tid))
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		t.Fatal(err)
	}
	return strings.TrimSpace(string(b))
}

// signalPending is whether sig waits to be delivered to thread tid.
func signalPending(t *testing.T, tid int, sig unix.Signal) bool {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/self/task/%d/status", tid))
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		if mask, ok := strings.CutPrefix(line, "SigPnd:"); ok {
			m, err := strconv.ParseUint(strings.TrimSpace(mask), 16, 64)
			if err != nil {
				t.Fatal(err)
			}
			return m&(1<<(sig-1)) != 0
		}
	}
	t.Fatalf("no SigPnd in thread %d's status", tid)
	return false
}
