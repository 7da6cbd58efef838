package main

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/nbdmapper/nbdmapper/internal/testing/nbdtest"
	"github.com/nbdmapper/nbdmapper/internal/testing/sparse"
	"github.com/nbdmapper/nbdmapper/nbdtarget"
)

// TestSocketActivation runs `serve --tables DIR` the way systemd would,
// under systemd-socket-activate (no systemd as PID 1): it is started by the
// first connection, serves NBD on a unix socket and a loopback TCP port and
// metrics on a third socket, all passed to it, and tells the test's own
// NOTIFY_SOCKET that it is ready, that it feeds the watchdog, and that it
// stops.
func TestSocketActivation(t *testing.T) {
	activate := nbdtest.Tool(t, "systemd-socket-activate")
	nbdinfo := nbdtest.Tool(t, "nbdinfo")

	// A short directory: unix socket paths are limited to 108 bytes.
	dir, err := os.MkdirTemp("", "nbdsd")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	sparse.Create(t, filepath.Join(dir, "disk.img"), 4<<20)
	tables := filepath.Join(dir, "tables")
	for name, text := range map[string]string{
		"base.table":    "0 8192 linear disk.img 0\n",
		"top.table":     "0 2048 linear /dev/mapper/base 1024\n", // stacked on base
		"README":        "not a table\n",
		"dir.table/x":   "a directory, not a table\n",
		"base.table.gz": "not a table either\n",
	} {
		p := filepath.Join(tables, name)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(text), 0o644); err != nil {
			t.Fatal(err)
		}
	}

	notify := listenNotify(t, filepath.Join(dir, "notify"))
	nbdSock, metricsSock, ctlSock := filepath.Join(dir, "nbd.sock"), filepath.Join(dir, "metrics.sock"), filepath.Join(dir, "control")

	// systemd-socket-activate cannot bind port 0, but it passes on sockets
	// it was given (LISTEN_FDS, checked against LISTEN_PID, which the
	// shell sets to its own pid before exec) ahead of its own. So the test
	// binds a free loopback port and hands it down as fd 3.
	tcp, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	tcpAddr := tcp.Addr().String()
	tcpFile, err := tcp.(*net.TCPListener).File()
	tcp.Close()
	if err != nil {
		t.Fatal(err)
	}
	logPath := filepath.Join(dir, "serve.log")
	logFile, err := os.Create(logPath)
	if err != nil {
		t.Fatal(err)
	}
	defer logFile.Close()
	cmd := exec.Command("sh", "-c", `LISTEN_PID=$$ exec "$@"`, "sh",
		activate, "-l", nbdSock, "-l", metricsSock, "-l", ctlSock, "--fdname=nbd:nbd:"+metricsFDName+":"+controlFDName,
		"-E", "NOTIFY_SOCKET="+notify.path, "-E", "WATCHDOG_USEC=400000",
		bin, "serve", "--tables", "tables")
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "LISTEN_FDS=1")
	cmd.ExtraFiles = []*os.File{tcpFile}
	cmd.Stdout, cmd.Stderr = logFile, logFile
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	// Only the child holds the TCP socket now: if serve dies, a client's
	// connection is refused instead of waiting in a listener's backlog.
	tcpFile.Close()
	exited := make(chan struct{})
	var waitErr error
	go func() { waitErr = cmd.Wait(); close(exited) }()
	t.Cleanup(func() { cmd.Process.Kill(); <-exited })
	serveLog := func() string { b, _ := os.ReadFile(logPath); return string(b) }

	size := func(uri string) string {
		t.Helper()
		out, err := exec.Command(nbdinfo, "--size", uri).CombinedOutput()
		if err != nil {
			t.Fatalf("nbdinfo --size %s: %v\n%s\nserve log:\n%s", uri, err, out, serveLog())
		}
		return strings.TrimSpace(string(out))
	}
	// The first connection starts serve, which then accepts it.
	if got := size("nbd://" + tcpAddr + "/base"); got != "4194304" {
		t.Errorf("base over TCP: size %s, want 4194304", got)
	}
	ready := notify.await(t, "READY=1", exited, serveLog)
	if want := "STATUS=2 exports (base, top); "; !strings.Contains(ready, want) {
		t.Errorf("READY message %q lacks %q", ready, want)
	}
	if got := size(nbdtest.URI(nbdSock, "top")); got != "1048576" {
		t.Errorf("top over the unix socket: size %s, want 1048576", got)
	}
	notify.await(t, "WATCHDOG=1", exited, serveLog)

	metrics := http.Client{Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		return (&net.Dialer{}).DialContext(ctx, "unix", metricsSock)
	}}}
	resp, err := metrics.Get("http://systemd/table")
	if err != nil {
		t.Fatalf("GET /table on the passed metrics socket: %v", err)
	}
	body, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil || !strings.Contains(string(body), "base: 0 8192 linear disk.img 0\n") {
		t.Errorf("/table: %v\n%s", err, body)
	}
	metrics.CloseIdleConnections()

	// The passed control socket is serve's, though not named by --control.
	if out, err := exec.Command(bin, "ls", "--control", ctlSock).CombinedOutput(); err != nil ||
		string(out) != "base\t(4194304 bytes)\ntop\t(1048576 bytes)\n" {
		t.Errorf("nbdmapper ls on the passed control socket: %v\n%s", err, out)
	}

	cmd.Process.Signal(syscall.SIGTERM)
	notify.await(t, "STOPPING=1", exited, serveLog)
	<-exited
	if waitErr != nil {
		t.Fatalf("serve exited with %v after SIGTERM\n%s", waitErr, serveLog())
	}
	for _, sock := range []string{nbdSock, ctlSock} {
		if _, err := os.Stat(sock); err != nil {
			t.Errorf("serve removed a socket it was passed: %v", err)
		}
	}
}

// TestSocketActivationConflict: sockets from systemd and --socket together
// are refused rather than one silently preferred.
func TestSocketActivationConflict(t *testing.T) {
	activate := nbdtest.Tool(t, "systemd-socket-activate")
	dir, err := os.MkdirTemp("", "nbdsd")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	sock := filepath.Join(dir, "nbd.sock")
	cmd := exec.Command(activate, "-l", sock, bin, "serve", "--socket", filepath.Join(dir, "other.sock"), "--metrics=off")
	cmd.Dir = dir // no tables: serve makes its demo in ./demo first
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill() })
	// systemd-socket-activate says "Listening on PATH" once it listens;
	// the first connection then starts serve, which must refuse to run.
	var out strings.Builder
	sc := bufio.NewScanner(stderr)
	for sc.Scan() {
		out.WriteString(sc.Text() + "\n")
		if strings.HasPrefix(sc.Text(), "Listening on "+sock) {
			c, err := net.Dial("unix", sock)
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
		}
	}
	err = cmd.Wait()
	if ee, ok := err.(*exec.ExitError); !ok || ee.ExitCode() != 1 || !strings.Contains(out.String(), errSocketConflict.Error()) {
		t.Fatalf("serve with --socket and passed sockets: %v\n%s", err, out.String())
	}
}

// notifySocket is a NOTIFY_SOCKET as the service manager provides it: a
// unixgram socket whose datagrams are sd_notify messages.
type notifySocket struct {
	path string
	conn *net.UnixConn
	msgs chan string
}

func listenNotify(t *testing.T, path string) *notifySocket {
	t.Helper()
	conn, err := net.ListenUnixgram("unixgram", &net.UnixAddr{Name: path, Net: "unixgram"})
	if err != nil {
		t.Fatal(err)
	}
	n := &notifySocket{path: path, conn: conn, msgs: make(chan string, 1024)}
	go func() {
		defer close(n.msgs)
		buf := make([]byte, 4096)
		for {
			k, err := conn.Read(buf)
			if err != nil {
				return
			}
			n.msgs <- string(buf[:k])
		}
	}()
	t.Cleanup(func() { conn.Close() })
	return n
}

// endOfQueue is a datagram the test sends itself once the server has
// exited: it lands behind everything the server sent.
const endOfQueue = "TEST-END-OF-QUEUE"

// await returns the first message containing want. If the server exits
// first, await still sees the messages it sent before exiting, and fails
// the test if want was not among them.
func (n *notifySocket) await(t *testing.T, want string, exited <-chan struct{}, serveLog func() string) string {
	t.Helper()
	var seen []string
	for {
		select {
		case m := <-n.msgs:
			if strings.Contains(m, want) {
				return m
			}
			if m == endOfQueue {
				t.Fatalf("serve exited without sending %q; it sent %q\nserve log:\n%s", want, seen, serveLog())
			}
			seen = append(seen, m)
		case <-exited:
			exited = nil // send the marker once, then read up to it
			c, err := net.DialUnix("unixgram", nil, n.conn.LocalAddr().(*net.UnixAddr))
			if err != nil {
				t.Fatal(err)
			}
			_, err = c.Write([]byte(endOfQueue))
			c.Close()
			if err != nil {
				t.Fatal(err)
			}
		}
	}
}

func TestNotifierStatus(t *testing.T) {
	for _, tc := range []struct {
		exports int
		want    string
	}{
		{0, "0 exports (); 0 connections"},
		{2, "2 exports (x0, x1); 0 connections"},
		{8, "8 exports (x0, x1, x2, x3, x4, x5, x6, x7); 0 connections"},
		{11, "11 exports (x0, x1, x2, x3, x4, x5, x6, x7, +3 more); 0 connections"},
	} {
		srv := &nbdtarget.Server{}
		for i := range tc.exports {
			srv.Exports = append(srv.Exports, &nbdtarget.Export{Name: fmt.Sprintf("x%d", i)})
		}
		if got := (&notifier{srv: srv}).status(); got != tc.want {
			t.Errorf("%d exports: status %q, want %q", tc.exports, got, tc.want)
		}
	}
}
