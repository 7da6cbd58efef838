package nbdtarget

import (
	"errors"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/nbdmapper/nbdmapper/internal/nbdtest"
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
	rs, client := rawSocketPair(t)
	t.Cleanup(func() { rs.Close() })
	if !rs.leave() {
		t.Fatal("an idle socket did not leave the poller")
	}
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
	write := make(chan error, 1)
	go func() {
		p := make([]byte, 1<<20)
		for {
			if _, err := rs.Write(p); err != nil {
				write <- err
				return
			}
		}
	}()
	// The client reads nothing: the write fills its socket and waits.
	nbdtest.Until(t, "the socket to fill", func() bool { return queued(t, client) >= 64<<10 })
	rs.Close()
	for what, errs := range map[string]<-chan error{"a waiting read": read, "a waiting write": write} {
		if err := recvErr(t, errs, what+" of a socket closed"); !errors.Is(err, net.ErrClosed) {
			t.Fatalf("%s of a socket closed: %v", what, err)
		}
	}
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
