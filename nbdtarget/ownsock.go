package nbdtarget

import (
	"encoding/binary"
	"net"
	"os"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// ownSocket is a rawSocket's descriptor while it is out of Go's network
// poller: a duplicate of the accepted one, which is closed, so that the
// poller no longer watches the socket. Its calls wait for the socket on
// their own thread, as a thread-per-connection server's calls block,
// instead of parking in the poller: a lingering read (conn.serial's) in
// recv(2) itself, for up to rawSocket.ownLinger, and then, as every other
// call does, in poll(2).
//
// That is for a connection whose client waits for each reply, with
// flushes between (serial mode, see conn.serial), when it is the server's
// only one (conn.followPoller). In the poller, the P's of such a server
// cost more than the requests do: with one P, sysmon takes it from every
// fdatasync that outlasts one of its 20 µs ticks, hands it to a woken
// thread, and keeps polling; a second P would be left idle (sysmon leaves
// a P in a system call alone while another is idle), but its thread then
// waits in epoll_wait, and every request that arrives and every reply the
// client drains wakes it there for nothing, since no goroutine waits in
// the poller for this socket. Out of the poller nothing wakes it, and the
// connection is counted twice for --procs auto
// (docs/decisions/out-of-poller.md has the figures).
//
// A lone connection writing in bulk (conn.bulk) has its second P already;
// out of the poller its reader is woken by the socket itself rather than
// through epoll_wait and the scheduler. It waits for a whole payload in one
// recv(2) (ReadWhole), holding its P, where a wait in poll(2) for each
// piece of it made twice the system calls per 1M write.
//
// The lingering read waits in recv(2) because nothing takes the client's
// next request sooner: one blocking call, where a wait in poll(2) takes
// three (the read that finds the socket empty, the poll, and the read
// again), and the kernel wakes the thread straight into the copy. A bulk
// reader's 1M writes gained nothing from it, and it keeps poll(2). Nor
// does the lingering read look at the socket before the recv, which
// returns at once what the socket holds: that read found the socket empty
// for nearly every serial request (docs/decisions/out-of-poller.md has
// the figures for both).
// So the descriptor is blocking while out of the poller, with its recv
// timed out (SO_RCVTIMEO), and every other call on it is non-blocking by
// its flags (rawIO) or waits in poll(2); a splice into it, which no flag
// keeps from blocking, is timed out too (SO_SNDTIMEO), and then waits in
// poll(2) as before.
//
// Deadlines are poll(2)'s timeouts, taken when a wait begins; a read does
// not wait in recv(2) under one. A read deadline set while a read waits
// wakes it through kick, an eventfd the read polls too (Shutdown's
// stopReading sets one to stop the reader), or, while the read is still
// in recv(2), when the recv times out, at most ownLinger later. A write
// deadline set meanwhile applies from the write's next wait, which nothing
// here needs: write deadlines are set only in the handshake, before a
// socket leaves the poller. Close shuts the socket down, which wakes every
// wait.
type ownSocket struct {
	fd    int
	kick  int
	reads atomic.Int32 // reads in progress, which a read deadline set kicks
}

// leave takes s out of the poller, or returns false, leaving it as it was:
// when a call is in progress on it, when it is closed or out already, or
// when a descriptor cannot be had.
func (s *rawSocket) leave() bool {
	if !s.mu.TryLock() {
		return false
	}
	defer s.mu.Unlock()
	if s.own != nil || s.closed.Load() {
		return false
	}
	switch s.Conn.(type) {
	case *net.UnixConn, *net.TCPConn:
	default:
		return false // net.FileConn could not bring it back (vsock)
	}
	fd, err := -1, error(nil)
	if cerr := s.rc.Control(func(d uintptr) { fd, err = dupCloexec(int(d)) }); cerr != nil || err != nil {
		return false
	}
	kick, err := unix.Eventfd(0, unix.EFD_NONBLOCK|unix.EFD_CLOEXEC)
	if err != nil {
		unix.Close(fd)
		return false
	}
	if err := blockFor(fd, s.ownLinger); err != nil {
		unix.Close(kick)
		unix.Close(fd)
		return false
	}
	s.Conn.Close() // the poller forgets it; the socket lives on in fd
	s.own = &ownSocket{fd: fd, kick: kick}
	return true
}

// rejoin brings s back into the poller, or returns false, leaving it as it
// was: when a call is in progress on it, when it is closed or in the
// poller, or when the poller cannot take it.
func (s *rawSocket) rejoin() bool {
	if !s.mu.TryLock() {
		return false
	}
	defer s.mu.Unlock()
	if s.own == nil || s.closed.Load() {
		return false
	}
	// net.FileConn takes a duplicate of what f holds into the poller, and
	// f's descriptor is closed after: a duplicate too, so that own.fd
	// stays whatever happens.
	if err := unblock(s.own.fd); err != nil {
		return false
	}
	d, err := dupCloexec(s.own.fd)
	if err != nil {
		blockFor(s.own.fd, s.ownLinger)
		return false
	}
	f := os.NewFile(uintptr(d), "")
	nc, err := net.FileConn(f)
	f.Close()
	var rc syscall.RawConn
	if err == nil {
		if rc = rawConn(nc); rc == nil {
			nc.Close()
		}
	}
	if rc == nil {
		// Out it stays, and its reads wait in recv(2) again.
		blockFor(s.own.fd, s.ownLinger)
		return false
	}
	if d := s.rdl.Load(); d != 0 {
		nc.SetReadDeadline(time.Unix(0, d))
	}
	if d := s.wdl.Load(); d != 0 {
		nc.SetWriteDeadline(time.Unix(0, d))
	}
	unix.Close(s.own.kick)
	unix.Close(s.own.fd)
	s.Conn, s.rc, s.own = nc, rc, nil
	return true
}

// blockFor makes the socket fd blocking, with its receives and sends timed
// out after d (> 0), the timeouts set first: blocking without them, a read
// would see a deadline set meanwhile only when the client sends.
func blockFor(fd int, d time.Duration) error {
	if err := setTimeouts(fd, unix.NsecToTimeval(int64(d))); err != nil {
		return err
	}
	return unix.SetNonblock(fd, false)
}

// unblock makes the socket fd non-blocking and untimed again, as the
// poller has its sockets.
func unblock(fd int) error {
	if err := unix.SetNonblock(fd, true); err != nil {
		return err
	}
	return setTimeouts(fd, unix.Timeval{})
}

// setTimeouts sets the socket fd's receive and send timeouts (SO_RCVTIMEO,
// SO_SNDTIMEO) to tv, zero for none.
func setTimeouts(fd int, tv unix.Timeval) error {
	for _, opt := range []int{unix.SO_RCVTIMEO, unix.SO_SNDTIMEO} {
		if err := unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, opt, &tv); err != nil {
			return err
		}
	}
	return nil
}

// dupCloexec duplicates fd, close-on-exec.
func dupCloexec(fd int) (int, error) {
	return unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0)
}

// outside reports whether s is out of the poller.
func (s *rawSocket) outside() bool {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.own != nil
}

// io runs f on the descriptor until it returns true, waiting between for
// the socket to be readable (or, for a write, to have room): what
// syscall.RawConn's Read and Write do, in or out of the poller.
func (s *rawSocket) io(write bool, f func(fd uintptr) bool) error {
	s.mu.RLock()
	defer s.mu.RUnlock()
	if s.closed.Load() {
		return net.ErrClosed
	}
	o := s.own
	if o == nil {
		if write {
			return s.rc.Write(f)
		}
		return s.rc.Read(f)
	}
	ev, dl := int16(unix.POLLIN), &s.rdl
	if write {
		ev, dl = unix.POLLOUT, &s.wdl
	} else {
		// Counted before the deadline is first looked at, so that a
		// deadline set meanwhile is either seen below or kicks.
		o.reads.Add(1)
		defer o.reads.Add(-1)
	}
	for {
		// As in the poller, a deadline that has passed fails the call
		// before it is tried (tlsRecords relies on that).
		d := dl.Load()
		var left time.Duration
		if d != 0 {
			if left = time.Until(time.Unix(0, d)); left <= 0 {
				return os.ErrDeadlineExceeded
			}
		}
		if f(uintptr(o.fd)) {
			return nil
		}
		if err := o.wait(ev, d != 0, left); err != nil {
			return err
		}
		if s.closed.Load() {
			return net.ErrClosed
		}
	}
}

// wait waits in poll(2) until the socket has ev, until the socket is shut
// down, for a read until a read deadline is set (kick), or, when timed,
// for at most left.
func (o *ownSocket) wait(ev int16, timed bool, left time.Duration) error {
	fds := [2]unix.PollFd{{Fd: int32(o.fd), Events: ev}, {Fd: int32(o.kick), Events: unix.POLLIN}}
	n := 1
	if ev == unix.POLLIN {
		n = 2
	}
	ms := -1
	if timed {
		ms = int((left + time.Millisecond - 1) / time.Millisecond)
	}
	if _, err := unix.Poll(fds[:n], ms); err != nil && err != unix.EINTR {
		return os.NewSyscallError("poll", err)
	}
	if n == 2 && fds[1].Revents != 0 {
		// Drained by the one read that waits (the read token, or the
		// handshake's one goroutine), which then looks at its deadline
		// again.
		var b [8]byte
		unix.Read(o.kick, b[:])
	}
	return nil
}

// control runs f on the descriptor, in or out of the poller.
func (s *rawSocket) control(f func(fd uintptr)) error {
	s.mu.RLock()
	defer s.mu.RUnlock()
	if s.closed.Load() {
		return net.ErrClosed
	}
	if s.own != nil {
		f(uintptr(s.own.fd))
		return nil
	}
	return s.rc.Control(f)
}

// rawConn is s's descriptor for splicing, in or out of the poller.
func (s *rawSocket) rawConn() syscall.RawConn { return sockRaw{s} }

type sockRaw struct{ s *rawSocket }

func (r sockRaw) Control(f func(fd uintptr)) error    { return r.s.control(f) }
func (r sockRaw) Read(f func(fd uintptr) bool) error  { return r.s.io(false, f) }
func (r sockRaw) Write(f func(fd uintptr) bool) error { return r.s.io(true, f) }

func (s *rawSocket) SetDeadline(t time.Time) error {
	return s.setDeadline(t, true, true)
}

func (s *rawSocket) SetReadDeadline(t time.Time) error {
	return s.setDeadline(t, true, false)
}

func (s *rawSocket) SetWriteDeadline(t time.Time) error {
	return s.setDeadline(t, false, true)
}

func (s *rawSocket) setDeadline(t time.Time, read, write bool) error {
	d := int64(0)
	if !t.IsZero() {
		d = t.UnixNano()
	}
	s.mu.RLock()
	defer s.mu.RUnlock()
	if read {
		s.rdl.Store(d)
	}
	if write {
		s.wdl.Store(d)
	}
	switch {
	case s.own == nil:
		if read && write {
			return s.Conn.SetDeadline(t)
		} else if read {
			return s.Conn.SetReadDeadline(t)
		}
		return s.Conn.SetWriteDeadline(t)
	case s.closed.Load():
		return net.ErrClosed
	case read && s.own.reads.Load() > 0:
		// Only then: tlsRecords sets and clears a deadline around
		// every request, from the reader, between its reads.
		var one [8]byte
		binary.NativeEndian.PutUint64(one[:], 1)
		unix.Write(s.own.kick, one[:]) // wake the read
	}
	return nil
}

// Close closes the socket. Out of the poller it shuts it down first, so
// that the calls waiting on it return, and releases the descriptors once
// they have.
func (s *rawSocket) Close() error {
	if s.closed.Swap(true) {
		return net.ErrClosed
	}
	s.mu.RLock()
	o := s.own
	if o == nil {
		err := s.Conn.Close()
		s.mu.RUnlock()
		return err
	}
	unix.Shutdown(o.fd, unix.SHUT_RDWR)
	s.mu.RUnlock()
	s.mu.Lock() // the woken calls have returned
	defer s.mu.Unlock()
	unix.Close(o.kick)
	return unix.Close(o.fd)
}
