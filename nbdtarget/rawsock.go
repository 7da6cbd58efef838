package nbdtarget

import (
	"io"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// rawSocket is a connection whose reads and writes are system calls the
// Go scheduler is not told about (RawSyscall), for the read and write
// buffers and for TLS.
//
// The calls are recv(2) and send(2) with MSG_DONTWAIT, so a read or write
// never blocks, whether the socket is non-blocking, as every socket in
// Go's network poller is, or blocking, as one out of it is (ownSocket):
// when it cannot go on it returns EAGAIN, and the goroutine waits in the
// poller (syscall.RawConn, under the connection's deadlines) just as
// net.Conn's Read and Write wait. What those add is the scheduler's entry
// and exit around each call, so that it can hand the P to another thread
// if the call blocks. For a call that cannot block that costs only time,
// and one thing more: entering a system call wakes sysmon if it had gone
// to sleep because every P was idle, and a woken sysmon polls every 20 µs
// while the server is busy; at queue depth 1 the server goes idle between
// requests (docs/decisions/raw-socket-calls.md has what this saves). Device calls, which can block (a page-cache miss,
// dirty-page throttling, fdatasync), stay ordinary system calls, and so
// does the wait of a read out of the poller in recv(2) (recvWait).
//
// The race detector does not see the kernel fill a read buffer here, as it
// does for syscall.Read; the buffers are the conn's own (bufio), used
// under the read token and the write lock.
//
// A read that finds the socket empty is counted (waits). While linger is
// set (a duration: conn.serial sets lingerTime), such a read first waits
// for the socket in poll(2) on its own thread, up to that long and
// without looking at the deadline, and only then in the network poller,
// under the deadline. The reader of a connection whose client waits for
// each reply (conn.serial) then takes the next request as a thread-per-connection server takes it
// from recv(2), woken by the socket itself, with no wake-up through
// epoll_wait and the scheduler, and with its P busy in the call, so sysmon
// does not go to sleep between requests only to be woken by the next
// device call. poll(2) is an ordinary system call: if anything else needs
// the P, sysmon hands it on after 20 µs, as for any blocking call.
//
// A rawSocket can also leave the poller altogether (leave, and rejoin to
// come back): see ownSocket. There a lingering read goes straight into
// recv(2) (recvWait), counted as a wait only if that times out, a
// ReadWhole waits in one recv(2) for all it reads (recvAll), and any other
// read waits in poll(2).
type rawSocket struct {
	net.Conn                 // as accepted, or as rejoin made it; closed while out of the poller
	rc       syscall.RawConn // Conn's descriptor
	laddr    net.Addr
	raddr    net.Addr
	linger   atomic.Int64 // a time.Duration; 0: wait in the poller at once
	waits    atomic.Uint64
	// ownLinger is how long a lingering read out of the poller waits in
	// recv(2) before it waits in poll(2) (recvWait): lingerTime, which
	// tests change before the socket leaves the poller.
	ownLinger time.Duration

	// mu is held shared by every call on the socket, and exclusively to
	// move it out of the poller or back (never waited for: TryLock, so
	// that a call waiting for the client holds up nothing) and by Close
	// to release a socket out of the poller once its calls have ended.
	mu     sync.RWMutex
	own    *ownSocket // non-nil while out of the poller
	closed atomic.Bool
	// The deadlines as Unix nanoseconds (0: none), kept for a socket out
	// of the poller and for its return.
	rdl, wdl atomic.Int64

	rd, wr, inq sockCall // Read's, Write's and drained's state
}

// lingerTime is the longest a lingering read waits on its thread.
const lingerTime = time.Millisecond

// socketIO returns what reads and writes nc for the connection: a
// rawSocket when nc has a descriptor (unix and TCP sockets), else nc.
func socketIO(nc net.Conn, rc syscall.RawConn) net.Conn {
	if rc == nil {
		return nc
	}
	s := &rawSocket{Conn: nc, rc: rc, laddr: nc.LocalAddr(), raddr: nc.RemoteAddr(), ownLinger: lingerTime}
	s.rd.s, s.rd.fn = s, s.rd.read
	s.wr.fn = s.wr.write
	s.inq.ctl = s.inq.ioctl
	return s
}

// LocalAddr and RemoteAddr are the accepted connection's, which rejoin
// replaces.
func (s *rawSocket) LocalAddr() net.Addr  { return s.laddr }
func (s *rawSocket) RemoteAddr() net.Addr { return s.raddr }

func (s *rawSocket) Read(p []byte) (int, error) {
	if len(p) == 0 {
		return 0, nil
	}
	r := &s.rd
	r.mu.Lock()
	defer r.mu.Unlock()
	return s.read(p, false)
}

// ReadWhole reads all of p, as io.ReadFull does. Out of the poller it
// waits for the whole of p in one recv(2) (recvAll), where Read would take
// what has come and wait again for the rest: a 1 MiB payload comes in
// pieces of what the client's send buffer holds (about 200 KiB for a unix
// socket), and each piece would cost a read, a wait in poll(2) and a
// wake-up.
func (s *rawSocket) ReadWhole(p []byte) error {
	r := &s.rd
	r.mu.Lock()
	defer r.mu.Unlock()
	for done := 0; done < len(p); {
		n, err := s.read(p[done:], true)
		switch {
		case err == io.EOF && done > 0:
			return io.ErrUnexpectedEOF
		case err != nil:
			return err
		}
		done += n
	}
	return nil
}

// read is Read, or one call of ReadWhole, with s.rd.mu held.
func (s *rawSocket) read(p []byte, whole bool) (int, error) {
	r := &s.rd
	r.p, r.n, r.errno, r.waited, r.whole = p, 0, 0, false, whole
	err := s.io(false, r.fn)
	n, errno := r.n, r.errno
	r.p = nil
	switch {
	case err != nil:
		return 0, err
	case (errno != 0 || n == 0) && s.closed.Load():
		return 0, net.ErrClosed // shut down by Close under the call
	case errno != 0:
		return 0, os.NewSyscallError("read", errno)
	case n == 0:
		return 0, io.EOF
	}
	return n, nil
}

// read is a Read's attempt, which the socket's RawConn runs (fn).
func (r *sockCall) read(fd uintptr) bool {
	if r.whole && r.s.own != nil && r.s.rdl.Load() == 0 {
		return r.recvAll(fd) // false: wait in poll(2)
	}
	if !r.waited && r.s.own != nil && r.s.linger.Load() > 0 && r.s.rdl.Load() == 0 {
		// Out of the poller a lingering read goes straight into recv(2),
		// which returns at once what the socket holds: a probe first would
		// cost a system call per request and tell serial mode nothing it
		// does not know from replyFirst. Timed out, it counts as a wait.
		r.waited = true
		if r.recvWait(fd) {
			return true
		}
		r.s.waits.Add(1)
		return false // wait in poll(2)
	}
	for {
		r.n, r.errno = rawIO(unix.SYS_RECVFROM, fd, r.p, unix.MSG_DONTWAIT)
		switch r.errno {
		case unix.EINTR:
			continue
		case unix.EAGAIN:
			if !r.waited {
				r.waited = true
				r.s.waits.Add(1)
				// In the poller a lingering read waits in poll(2) on its
				// thread first; out of it, it waited in recv(2) above.
				if d := time.Duration(r.s.linger.Load()); d > 0 && r.s.own == nil && readable(fd, d) {
					continue
				}
			}
			return false // wait until the socket is readable
		}
		return true
	}
}

// recvWait is a lingering read's wait out of the poller: a blocking
// recv(2), an ordinary system call, which returns what the socket holds or
// what comes as soon as it comes: no other wait takes a request from the
// client with fewer system calls (ownSocket). The descriptor times the
// recv out after ownLinger (SO_RCVTIMEO); then, or with a read deadline
// set, recvWait returns false and the read waits in poll(2), under the
// deadline and the kick.
func (r *sockCall) recvWait(fd uintptr) bool {
	for r.s.rdl.Load() == 0 {
		n, _, e := unix.Syscall6(unix.SYS_RECVFROM, fd, uintptr(unsafe.Pointer(&r.p[0])), uintptr(len(r.p)), 0, 0, 0)
		switch e {
		case unix.EINTR:
			// A signal ends a recv that has a timeout whatever
			// SA_RESTART says (signal(7)), and Go preempts with
			// signals: look at the deadline again and go on.
			continue
		case unix.EAGAIN:
			return false // timed out
		}
		r.n, r.errno = int(n), e
		return true
	}
	return false
}

// recvAll is ReadWhole's read out of the poller: one blocking recv(2) with
// MSG_WAITALL, which returns when all of p has come, or after ownLinger
// (SO_RCVTIMEO) with what has, or on a signal; it returns false, to wait
// in poll(2), when nothing came (a wait, counted) or a signal came first.
//
// Unlike recvWait's, the call is raw: the Go scheduler does not learn
// that the thread blocks, and the thread keeps its P. conn.readWhole asks
// for it only where the reader has a P of its own (a connection out of the
// poller counts twice in Server.OnActive). An ordinary call's P, idle in
// the wait while the other P copied the last payload into the file, was
// handed to another thread by sysmon and had to be taken back after the
// call, at a cost in MiB/s and CPU (docs/decisions/out-of-poller.md). A
// raw call holds up the garbage collector's stop of the world until it
// returns; Go's preemption signal ends it (a socket with a timeout is
// never restarted after a signal, signal(7)), and a read so ended waits in
// poll(2), an ordinary call, instead of going straight back.
func (r *sockCall) recvAll(fd uintptr) bool {
	n, _, e := unix.RawSyscall6(unix.SYS_RECVFROM, fd, uintptr(unsafe.Pointer(&r.p[0])), uintptr(len(r.p)), unix.MSG_WAITALL, 0, 0)
	switch e {
	case unix.EINTR:
		return false
	case unix.EAGAIN:
		r.s.waits.Add(1)
		return false // timed out
	}
	r.n, r.errno = int(n), e
	return true
}

func (s *rawSocket) Write(p []byte) (int, error) {
	w := &s.wr
	w.mu.Lock()
	defer w.mu.Unlock()
	w.p, w.n, w.errno = p, 0, 0
	err := s.io(true, w.fn)
	done, errno := w.n, w.errno
	w.p = nil
	switch {
	case err != nil:
		return done, err
	case errno != 0 && s.closed.Load():
		return done, net.ErrClosed // shut down by Close under the call (EPIPE)
	case errno != 0:
		return done, os.NewSyscallError("write", errno)
	}
	return done, nil
}

// write is a Write's attempt, which the socket's RawConn runs (fn): it
// adds what it writes to n.
func (w *sockCall) write(fd uintptr) bool {
	for w.n < len(w.p) {
		n, e := rawIO(unix.SYS_SENDTO, fd, w.p[w.n:], unix.MSG_DONTWAIT|unix.MSG_NOSIGNAL)
		switch e {
		case 0:
			w.n += n
			continue
		case unix.EINTR:
			continue
		case unix.EAGAIN:
			return false // wait until the socket has room
		}
		w.errno = e
		return true
	}
	return true
}

// A sockCall is the state of a rawSocket's Read, Write or drained while it
// runs: its arguments and results, and its attempt bound once as fn, the
// function the socket's RawConn runs. A call so allocates nothing, where a
// closure over its variables would escape to the heap through the RawConn
// on every call. mu serializes the calls of one kind, as the network
// poller's read and write locks serialize a net.Conn's.
type sockCall struct {
	mu     sync.Mutex
	s      *rawSocket            // for a read
	fn     func(fd uintptr) bool // read or write
	ctl    func(fd uintptr)      // ioctl
	p      []byte
	n      int
	errno  syscall.Errno
	waited bool  // a read found the socket empty
	whole  bool  // ReadWhole's read
	inq    int32 // drained's answer
}

// rawIO is recv(2) or send(2) (trap: recvfrom or sendto) of p on fd with
// flags, p not empty.
func rawIO(trap, fd uintptr, p []byte, flags int) (int, syscall.Errno) {
	n, _, errno := unix.RawSyscall6(trap, fd, uintptr(unsafe.Pointer(&p[0])), uintptr(len(p)), uintptr(flags), 0, 0)
	return int(n), errno
}

// drained reports whether the socket holds nothing that no read has taken
// yet (SIOCINQ reads 0); it is false when the socket holds bytes or the
// question fails. ioctl(SIOCINQ) cannot block, so it is a raw call too.
func (s *rawSocket) drained() bool {
	q := &s.inq
	q.mu.Lock()
	defer q.mu.Unlock()
	q.inq, q.errno = 0, 0
	if err := s.control(q.ctl); err != nil {
		return false
	}
	return q.errno == 0 && q.inq == 0
}

// ioctl is drained's call, which the socket's RawConn runs (ctl).
func (q *sockCall) ioctl(fd uintptr) {
	_, _, q.errno = unix.RawSyscall(unix.SYS_IOCTL, fd, unix.SIOCINQ, uintptr(unsafe.Pointer(&q.inq)))
}

// readable waits up to d in poll(2) for fd to be readable (or closed by the
// peer, or in error: the read that follows says which).
func readable(fd uintptr, d time.Duration) bool {
	fds := [1]unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
	n, err := unix.Poll(fds[:], int(d/time.Millisecond))
	return err == nil && n > 0
}

// unixSendBuffer is the send buffer asked of a unix socket: room for the
// largest spliced reply at once (the kernel doubles what is asked, which
// covers the header and its own bookkeeping). A unix socket gets
// net.core.wmem_default, 208 KiB on Linux, and takes a 1 MiB reply in
// about five pieces, each a wait in the poller for the client to drain the
// last and a wake-up (docs/decisions/unix-send-buffer.md has the figures).
// TCP sockets are left alone: Linux grows their buffers as
// the connection needs, up to net.ipv4.tcp_wmem's limit (4 MiB by
// default), and a buffer set by hand would end that. The kernel caps it
// at net.core.wmem_max. It is a bound, not an allocation: a socket holds only what is waiting for the client, and a
// client that takes no reply is closed after ReplyTimeout.
const unixSendBuffer = spliceMax

// growSendBuffer raises a unix socket's send buffer to unixSendBuffer if
// it is smaller; a failure leaves the socket as it was, which costs only
// speed.
func growSendBuffer(nc net.Conn, rc syscall.RawConn) {
	if _, ok := nc.(*net.UnixConn); !ok || rc == nil {
		return
	}
	rc.Control(func(fd uintptr) {
		if n, err := unix.GetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_SNDBUF); err == nil && n < 2*unixSendBuffer {
			unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_SNDBUF, unixSendBuffer)
		}
	})
}
