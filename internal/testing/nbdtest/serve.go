package nbdtest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// Build compiles cmd/nbdmapper into dir and returns the binary's path. It
// is for TestMain, which has no *testing.T; tests call Binary.
func Build(dir string) (string, error) {
	bin := filepath.Join(dir, "nbdmapper")
	out, err := exec.Command("go", "build", "-o", bin, "github.com/nbdmapper/nbdmapper/cmd/nbdmapper").CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("go build: %w\n%s", err, out)
	}
	return bin, nil
}

// Binary builds the nbdmapper binary into the test's temporary directory,
// or skips the test if there is no go toolchain in PATH to build it with.
func Binary(t testing.TB) string {
	t.Helper()
	Tool(t, "go")
	bin, err := Build(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	return bin
}

// Server is a running `nbdmapper serve`, started by Start.
type Server struct {
	Socket string // the unix socket it listens on

	cmd    *exec.Cmd
	stdout SyncBuffer
	stderr SyncBuffer
	exited chan struct{}
	err    error // cmd.Wait's result, once exited is closed
}

// Start runs `bin serve --socket dir/nbd.sock args...` with dir as its
// working directory (so relative table and device paths resolve there), and
// returns once the socket accepts connections. It fails the test if the
// server exits first, and kills the server when the test ends.
func Start(t testing.TB, bin, dir string, args ...string) *Server {
	t.Helper()
	s := &Server{Socket: filepath.Join(dir, "nbd.sock"), exited: make(chan struct{})}
	s.cmd = exec.Command(bin, append([]string{"serve", "--socket", s.Socket}, args...)...)
	s.cmd.Dir = dir
	s.cmd.Stdout, s.cmd.Stderr = &s.stdout, &s.stderr
	if err := s.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { s.err = s.cmd.Wait(); close(s.exited) }()
	t.Cleanup(func() { s.cmd.Process.Kill(); <-s.exited })
	s.WaitListening(t, "unix", s.Socket)
	return s
}

// WaitListening waits until the server accepts connections on addr, or
// fails the test if the server exits first. Start already waits for the
// NBD socket; this is for other listeners, such as --metrics.
func (s *Server) WaitListening(t testing.TB, network, addr string) {
	t.Helper()
	deadline := time.Now().Add(Bound)
	for {
		if time.Now().After(deadline) {
			t.Fatalf("nbdmapper serve not listening on %s after %v\n%s", addr, Bound, s.Stderr())
		}
		if c, err := net.Dial(network, addr); err == nil {
			c.Close()
			return
		}
		select {
		case <-s.exited:
			t.Fatalf("nbdmapper serve exited (%v) before listening on %s\n%s", s.err, addr, s.Stderr())
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// URI is the NBD URI of one of the server's exports.
func (s *Server) URI(export string) string { return URI(s.Socket, export) }

// PID is the server's process id.
func (s *Server) PID() int { return s.cmd.Process.Pid }

// PeakRSS is the server's peak resident set size so far (VmHWM), in bytes.
func (s *Server) PeakRSS(t testing.TB) int64 {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", s.PID()))
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "VmHWM:"); ok {
			var kb int64
			if _, err := fmt.Sscanf(strings.TrimSpace(v), "%d kB", &kb); err != nil {
				t.Fatalf("VmHWM %q: %v", v, err)
			}
			return kb << 10
		}
	}
	t.Fatal("no VmHWM in /proc/PID/status")
	return 0
}

// Signal sends sig to the server; it is safe to call from any goroutine.
func (s *Server) Signal(sig os.Signal) { s.cmd.Process.Signal(sig) }

// Wait waits for the server to exit and returns how it ended, as
// exec.Cmd.Wait does. It may be called more than once.
func (s *Server) Wait() error {
	<-s.exited
	return s.err
}

// Stop sends SIGTERM and fails the test unless the server exits cleanly.
func (s *Server) Stop(t testing.TB) {
	t.Helper()
	s.Signal(syscall.SIGTERM)
	if err := s.Wait(); err != nil {
		t.Fatalf("nbdmapper serve exited with %v after SIGTERM\n%s", err, s.Stderr())
	}
}

// Stdout is what the server has printed on its standard output so far.
func (s *Server) Stdout() string { return s.stdout.String() }

// Stderr is what the server has logged so far.
func (s *Server) Stderr() string { return s.stderr.String() }

// SyncBuffer is a bytes.Buffer that a process's output copier may write
// while the test reads it.
type SyncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (b *SyncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.Write(p)
}

func (b *SyncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.String()
}

// Servable is an in-process server, such as *nbdtarget.Server.
type Servable interface {
	Serve(l net.Listener) error
	Shutdown(ctx context.Context) error
}

// ServeUnix serves srv on a fresh unix socket and returns the socket's
// path. When the test ends it shuts srv down and fails the test unless
// Shutdown succeeds and Serve returns an error that is closed (the
// server's ErrServerClosed). The socket lives in a new directory under the
// system's temporary directory, not t.TempDir(), because a unix socket's
// path is limited to 108 bytes and test names are long.
func ServeUnix(t testing.TB, srv Servable, closed error) string {
	t.Helper()
	sock := filepath.Join(ShortDir(t), "s")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- srv.Serve(l) }()
	t.Cleanup(func() {
		if err := srv.Shutdown(context.Background()); err != nil {
			t.Errorf("Shutdown: %v", err)
		}
		if err := <-done; !errors.Is(err, closed) {
			t.Errorf("Serve returned %v, want %v", err, closed)
		}
	})
	return sock
}

// ShortDir is a new directory under the system's temporary directory,
// removed when the test ends, for unix sockets: a socket's path is limited
// to 108 bytes, and t.TempDir's paths, named after the test, are long.
func ShortDir(t testing.TB) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "nbdt")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}
