package remote

import (
	"bytes"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/nbdmapper/nbdmapper/internal/nbdtest"
	"github.com/nbdmapper/nbdmapper/internal/sparse"
)

// shortDir is a fresh directory for unix sockets, whose paths must stay
// under 108 bytes (t.TempDir's are long).
func shortDir(t testing.TB) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "rmt")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}

// peer is a real NBD server run as a child process on a unix socket.
type peer struct {
	t      testing.TB
	name   string
	sock   string
	log    string // nbdkit's log filter output, if asked for
	argv   []string
	cmd    *exec.Cmd
	exited chan struct{}
	out    nbdtest.SyncBuffer
}

// startNbdkit runs `nbdkit -U SOCK -f --exit-with-parent ARGS...` with its
// log filter writing to dir/NAME.log (so tests count the requests that
// reached it), and waits until it accepts connections.
func startNbdkit(t testing.TB, dir, name string, args ...string) *peer {
	t.Helper()
	bin := nbdtest.Tool(t, "nbdkit")
	p := &peer{t: t, name: name, sock: filepath.Join(dir, name+".sock"), log: filepath.Join(dir, name+".log")}
	p.argv = append([]string{bin, "-U", p.sock, "-f", "--exit-with-parent", "--filter=log"}, args...)
	p.argv = append(p.argv, "logfile="+p.log, "logappend=true")
	p.start()
	t.Cleanup(p.stop)
	return p
}

// startQemuNbd runs qemu-nbd on file, exported as "e" with 8 clients
// allowed (qemu-nbd then advertises CAN_MULTI_CONN).
func startQemuNbd(t testing.TB, dir, name, file string) *peer {
	t.Helper()
	bin := nbdtest.Tool(t, "qemu-nbd")
	p := &peer{t: t, name: name, sock: filepath.Join(dir, name+".sock")}
	p.argv = []string{bin, "-k", p.sock, "-f", "raw", "-x", "e", "--shared=8", "--persistent", "--cache=writeback", "--discard=unmap", file}
	p.start()
	t.Cleanup(p.stop)
	return p
}

func (p *peer) start() {
	p.t.Helper()
	os.Remove(p.sock)
	p.cmd = exec.Command(p.argv[0], p.argv[1:]...)
	p.cmd.Stdout, p.cmd.Stderr = &p.out, &p.out
	p.exited = make(chan struct{})
	if err := p.cmd.Start(); err != nil {
		p.t.Fatal(err)
	}
	go func() { p.cmd.Wait(); close(p.exited) }()
	nbdtest.Until(p.t, p.name+" accepting on "+p.sock, func() bool {
		select {
		case <-p.exited:
			p.t.Fatalf("%s exited early: %s", p.name, p.out.String())
		default:
		}
		c, err := net.Dial("unix", p.sock)
		if err == nil {
			c.Close()
		}
		return err == nil
	})
}

// kill ends the server with SIGKILL, as a crash would.
func (p *peer) kill() {
	p.cmd.Process.Signal(syscall.SIGKILL)
	<-p.exited
}

func (p *peer) stop() {
	select {
	case <-p.exited:
	default:
		p.kill()
	}
}

// restart starts the same server again on the same socket.
func (p *peer) restart() {
	p.t.Helper()
	p.stop()
	p.start()
}

// uri is the peer's export as an NBD URI.
func (p *peer) uri(export string) string { return nbdtest.URI(p.sock, export) }

// count is how many requests of op (nbdkit's log names: Read, Write,
// Flush, Trim, Zero, Extents, Cache) reached the server so far.
func (p *peer) count(op string) int {
	b, _ := os.ReadFile(p.log)
	return bytes.Count(b, []byte(" "+op+" id="))
}

// logLines are the log lines that record op requests.
func (p *peer) logLines(op string) []string {
	b, _ := os.ReadFile(p.log)
	var out []string
	for _, l := range strings.Split(string(b), "\n") {
		if strings.Contains(l, " "+op+" id=") {
			out = append(out, l)
		}
	}
	return out
}

// connects is how many connections reached the server.
func (p *peer) connects() int {
	b, _ := os.ReadFile(p.log)
	return bytes.Count(b, []byte(" Connect export="))
}

func sparseFile(t testing.TB, dir, name string, size int64) string {
	t.Helper()
	return sparse.Create(t, filepath.Join(dir, name), size)
}

// testOptions are Options for tests: short waits, so a test of a lost
// remote does not idle, and panics fail the test.
func testOptions(t testing.TB) Options {
	return Options{
		Timeout:    20 * time.Second,
		BackoffMin: 5 * time.Millisecond,
		BackoffMax: 100 * time.Millisecond,
		OnPanic:    func(v any, stack []byte) { t.Errorf("panic: %v\n%s", v, stack) },
	}
}

func openURI(t testing.TB, uri string, opts Options) *Device {
	t.Helper()
	u, err := ParseURI(uri)
	if err != nil {
		t.Fatal(err)
	}
	d, err := Open(uri, u, false, opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Close() })
	return d
}

func readFile(t testing.TB, path string, off, n int64) []byte {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	b := make([]byte, n)
	if _, err := f.ReadAt(b, off); err != nil {
		t.Fatal(err)
	}
	return b
}

func pattern(n int, seed byte) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = seed + byte(i*7) + byte(i>>9)
	}
	return b
}

func mustEqual(t testing.TB, what string, got, want []byte) {
	t.Helper()
	if !bytes.Equal(got, want) {
		i := 0
		for i < len(got) && i < len(want) && got[i] == want[i] {
			i++
		}
		t.Fatalf("%s: differs at byte %d of %d", what, i, len(want))
	}
}

func stringsReader(s string) *strings.Reader { return strings.NewReader(s) }

func itoa(v int64) string { return fmt.Sprint(v) }
