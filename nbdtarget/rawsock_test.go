package nbdtarget

import (
	"bytes"
	"errors"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/nbdmapper/nbdmapper/internal/testing/nbdtest"
)

// rawSocketPair returns the server end of a unix socket connection as the
// server reads and writes it (socketIO), and the client end.
func rawSocketPair(t *testing.T) (*rawSocket, net.Conn) {
	t.Helper()
	return rawSocketPairOn(t, "unix", filepath.Join(t.TempDir(), "s"))
}

// rawSocketPairOn is rawSocketPair on network at addr.
func rawSocketPairOn(t *testing.T, network, addr string) (*rawSocket, net.Conn) {
	t.Helper()
	l, err := net.Listen(network, addr)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	client, err := net.Dial(network, l.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { client.Close() })
	server, err := l.Accept()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { server.Close() })
	rs, ok := socketIO(server, rawConn(server)).(*rawSocket)
	if !ok {
		t.Fatalf("a %s socket is not read through a rawSocket", network)
	}
	return rs, client
}

// TestRawSocket moves more than a socket buffer holds each way in pieces,
// so that both directions wait in the poller (EAGAIN), and checks the ends
// of a connection: a deadline, EOF, and a write to a closed peer.
func TestRawSocket(t *testing.T) {
	rs, client := rawSocketPair(t)
	checkRawSocket(t, rs, client)
}

// checkRawSocket is TestRawSocket on rs, whose peer is client.
func checkRawSocket(t *testing.T, rs *rawSocket, client net.Conn) {
	t.Helper()
	data := make([]byte, 8<<20)
	for i := range data {
		data[i] = byte(rand.Uint32())
	}

	// Server to client: the client reads slowly, in small pieces.
	got := make(chan []byte)
	go func() {
		var b bytes.Buffer
		piece := make([]byte, 4096)
		for b.Len() < len(data) {
			n, err := client.Read(piece)
			if err != nil {
				break
			}
			b.Write(piece[:n])
		}
		got <- b.Bytes()
	}()
	if n, err := rs.Write(data); err != nil || n != len(data) {
		t.Fatalf("write: %d, %v", n, err)
	}
	if b := <-got; !bytes.Equal(b, data) {
		t.Fatalf("client read %d bytes, not what was written", len(b))
	}

	// Client to server, in pieces of every size.
	go func() {
		for p := data; len(p) > 0; {
			n := min(len(p), 1+rand.IntN(300<<10))
			if _, err := client.Write(p[:n]); err != nil {
				return
			}
			p = p[n:]
		}
	}()
	in := make([]byte, len(data))
	if _, err := io.ReadFull(rs, in); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(in, data) {
		t.Fatal("server read other bytes than the client wrote")
	}
	if n, err := rs.Read(nil); n != 0 || err != nil {
		t.Fatalf("empty read: %d, %v", n, err)
	}

	// Nothing to read before a deadline: the poller's deadline error.
	rs.SetReadDeadline(time.Now().Add(20 * time.Millisecond))
	if _, err := rs.Read(in); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("read past its deadline: %v", err)
	}
	rs.SetReadDeadline(time.Time{})

	// The client leaves: EOF, then EPIPE (or a reset) for a write.
	client.Close()
	if n, err := rs.Read(in); n != 0 || err != io.EOF {
		t.Fatalf("read after the peer closed: %d, %v", n, err)
	}
	var werr error
	for range 100 { // the first writes may land in the buffer
		if _, werr = rs.Write(data[:64<<10]); werr != nil {
			break
		}
	}
	if !errors.Is(werr, syscall.EPIPE) && !errors.Is(werr, syscall.ECONNRESET) {
		t.Fatalf("write to a closed peer: %v", werr)
	}

	// Our own end closed: the poller's error.
	rs.Close()
	if _, err := rs.Read(in); !errors.Is(err, net.ErrClosed) {
		t.Fatalf("read of a closed socket: %v", err)
	}
	if _, err := rs.Write(in[:1]); !errors.Is(err, net.ErrClosed) {
		t.Fatalf("write to a closed socket: %v", err)
	}
}

// TestSocketIOWithoutDescriptor: a connection with no descriptor (a
// net.Pipe) is read and written as it is.
func TestSocketIOWithoutDescriptor(t *testing.T) {
	a, b := net.Pipe()
	defer a.Close()
	defer b.Close()
	if got := socketIO(a, rawConn(a)); got != a {
		t.Fatalf("socketIO(net.Pipe) = %T, want the pipe itself", got)
	}
}

// A lingering read (rawSocket.linger) that finds the socket empty waits on
// its thread and then in the poller: it returns what arrives meanwhile,
// keeps the connection's read deadline and sees the peer's close. Each
// read that finds the socket empty is counted once; one that finds data is
// not.
func TestRawSocketLinger(t *testing.T) {
	rs, client := rawSocketPair(t)
	rs.linger.Store(int64(lingerTime))
	buf := make([]byte, 16)
	read := func() <-chan string {
		got := make(chan string, 1)
		go func() {
			n, err := rs.Read(buf)
			if err != nil {
				got <- err.Error()
				return
			}
			got <- string(buf[:n])
		}()
		return got
	}
	waits := func(want uint64) {
		t.Helper()
		nbdtest.Until(t, "the read to find the socket empty", func() bool { return rs.waits.Load() == want })
	}

	if _, err := client.Write([]byte("a")); err != nil {
		t.Fatal(err)
	}
	if got := nbdtest.Recv(t, read(), "a read of buffered data"); got != "a" {
		t.Fatalf("read %q, want a", got)
	}
	if n := rs.waits.Load(); n != 0 {
		t.Fatalf("a read that found data counted %d waits", n)
	}

	rs.SetReadDeadline(time.Now().Add(20 * lingerTime))
	if _, err := rs.Read(buf); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("read of an empty socket past its deadline: %v", err)
	}
	if n := rs.waits.Load(); n != 1 {
		t.Fatalf("%d waits counted for one read, want 1", n)
	}
	rs.SetReadDeadline(time.Time{})

	got := read()
	waits(2)
	if _, err := client.Write([]byte("bc")); err != nil {
		t.Fatal(err)
	}
	if g := nbdtest.Recv(t, got, "the waiting read"); g != "bc" {
		t.Fatalf("read %q, want bc", g)
	}

	got = read()
	waits(3)
	client.Close()
	if g := nbdtest.Recv(t, got, "the waiting read"); g != io.EOF.Error() {
		t.Fatalf("read after the peer closed: %q, want EOF", g)
	}
}

// A lingering read waits on its own thread, where the poller's deadline is
// not looked at: one that lingers longer than its deadline still returns
// what arrives after the deadline, where a read that waits in the poller
// would have failed at it.
func TestRawSocketLingersOnItsThread(t *testing.T) {
	rs, client := rawSocketPair(t)
	rs.linger.Store(int64(nbdtest.Bound))
	rs.SetReadDeadline(time.Now().Add(5 * time.Millisecond))
	got := readString(rs)
	nbdtest.Until(t, "the read to find the socket empty", func() bool { return rs.waits.Load() == 1 })
	time.Sleep(50 * time.Millisecond) // past the deadline: only a read still in poll(2) can take what comes now
	if _, err := client.Write([]byte("late")); err != nil {
		t.Fatal(err)
	}
	if g := nbdtest.Recv(t, got, "the lingering read"); g != "late" {
		t.Fatalf("lingering read: %q, want late (it did not wait on its thread)", g)
	}
}

// readString starts a read of up to 16 bytes from rs and returns the
// channel that gets what it read, or its error's text.
func readString(rs *rawSocket) <-chan string {
	got := make(chan string, 1)
	go func() {
		buf := make([]byte, 16)
		n, err := rs.Read(buf)
		if err != nil {
			got <- err.Error()
			return
		}
		got <- string(buf[:n])
	}()
	return got
}

// drained says whether the socket holds bytes no read has taken, on a unix
// socket and on TCP, and says no once the socket is closed.
func TestRawSocketDrained(t *testing.T) {
	tcp := func(t *testing.T) (*rawSocket, net.Conn) { return rawSocketPairOn(t, "tcp", "127.0.0.1:0") }
	for name, pair := range map[string]func(*testing.T) (*rawSocket, net.Conn){"unix": rawSocketPair, "tcp": tcp} {
		t.Run(name, func(t *testing.T) {
			rs, client := pair(t)
			if !rs.drained() {
				t.Fatal("a fresh socket is not drained")
			}
			if _, err := client.Write([]byte("abc")); err != nil {
				t.Fatal(err)
			}
			nbdtest.Until(t, "the bytes to arrive", func() bool { return !rs.drained() })
			buf := make([]byte, 2)
			if _, err := io.ReadFull(rs, buf); err != nil {
				t.Fatal(err)
			}
			if rs.drained() {
				t.Fatal("drained with a byte still unread")
			}
			if _, err := io.ReadFull(rs, buf[:1]); err != nil {
				t.Fatal(err)
			}
			if !rs.drained() {
				t.Fatal("not drained once every byte was read")
			}
			rs.Close()
			if rs.drained() {
				t.Fatal("a closed socket says it is drained")
			}
		})
	}
}

// A rawSocket's Read, Write and drained allocate nothing, in the poller
// and out of it: each call's state is the socket's own (sockCall), where a
// closure handed to the RawConn would escape to the heap on every call.
func TestRawSocketAllocs(t *testing.T) {
	for _, out := range []bool{false, true} {
		rs, client := rawSocketPair(t)
		if out && !rs.leave() {
			t.Fatal("the socket did not leave the poller")
		}
		p, q := bytes.Repeat([]byte{7}, 16), make([]byte, 16)
		allocs := nbdtest.AllocsPerRun(100, func() {
			if _, err := rs.Write(p); err != nil {
				t.Fatal(err)
			}
			if _, err := io.ReadFull(client, q); err != nil {
				t.Fatal(err)
			}
			if _, err := client.Write(p); err != nil {
				t.Fatal(err)
			}
			if _, err := io.ReadFull(rs, q); err != nil {
				t.Fatal(err)
			}
			if !rs.drained() {
				t.Fatal("not drained once every byte was read")
			}
		})
		if allocs != 0 {
			t.Errorf("out of the poller %v: a write, a read and drained allocated %v times, want 0", out, allocs)
		}
	}
}
