package nbdtest

import (
	"bytes"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
)

// Peer is another NBD server run as a child process, the far end of a
// table's remote export: nbdkit (with its log filter, so that tests count
// what reached it) or qemu-nbd, on a unix socket or at an address, in the
// test's network namespace or one it made (Wrap). It is killed when the
// test ends; Kill and Start crash and restart it.
type Peer struct {
	Name string
	Sock string // the unix socket, or "" when Addr is set
	Log  string // nbdkit's log file ("" for qemu-nbd)

	t      testing.TB
	env    []string
	addr   string
	dial   func(network, addr string) (net.Conn, error)
	argv   []string
	cmd    *exec.Cmd
	exited chan struct{}
	out    SyncBuffer
}

// PeerOptions place a Peer.
type PeerOptions struct {
	// Addr, if set, is the HOST:PORT to listen on instead of a unix socket.
	Addr string
	// Wrap, if set, is put before the server's command line (for example
	// "ip", "netns", "exec", NS, to run it in a network namespace).
	Wrap []string
	// Dial, if set, is how to reach Addr (from inside that namespace);
	// net.Dial by default.
	Dial func(network, addr string) (net.Conn, error)
	// Env is added to the server's environment (for example
	// GNUTLS_SYSTEM_PRIORITY_FILE, to limit its TLS versions).
	Env []string
	// Args are qemu-nbd options put before the file (TLS objects, say);
	// nbdkit takes its own in StartNbdkit's ARGS.
	Args []string
}

// place sets where the peer listens, and returns the server's options for
// it: the socket flag and sock, or the address and port flags and opts.Addr.
func (p *Peer) place(opts PeerOptions, sock, sockFlag, hostFlag, portFlag string) []string {
	p.addr, p.dial, p.env = opts.Addr, opts.Dial, opts.Env
	if p.dial == nil {
		p.dial = net.Dial
	}
	if opts.Addr != "" {
		host, port, _ := net.SplitHostPort(opts.Addr)
		return []string{hostFlag, host, portFlag, port}
	}
	p.Sock = sock
	return []string{sockFlag, sock}
}

// StartNbdkit runs `nbdkit -f --exit-with-parent --filter=log ARGS...`
// listening on dir/NAME.sock (or opts.Addr), logging requests to
// dir/NAME.log, and waits until it accepts connections. ARGS are nbdkit's:
// more --filter options, the plugin, its parameters and the filters'.
func StartNbdkit(t testing.TB, dir, name string, opts PeerOptions, args ...string) *Peer {
	t.Helper()
	bin := Tool(t, "nbdkit")
	p := &Peer{t: t, Name: name, Log: filepath.Join(dir, name+".log")}
	listen := p.place(opts, filepath.Join(dir, name+".sock"), "-U", "-i", "-p")
	p.argv = append(append(append([]string(nil), opts.Wrap...), bin, "-f", "--exit-with-parent", "--filter=log"), listen...)
	p.argv = append(append(p.argv, args...), "logfile="+p.Log, "logappend=true")
	p.Start()
	t.Cleanup(p.stop)
	return p
}

// StartQemuNbd runs qemu-nbd exporting file as "e" to up to 8 clients (so
// that it advertises CAN_MULTI_CONN), on dir/NAME.sock or opts.Addr.
func StartQemuNbd(t testing.TB, dir, name, file string, opts PeerOptions) *Peer {
	t.Helper()
	bin := Tool(t, "qemu-nbd")
	p := &Peer{t: t, Name: name}
	listen := p.place(opts, filepath.Join(dir, name+".sock"), "-k", "-b", "-p")
	p.argv = append(append(append([]string(nil), opts.Wrap...), bin), listen...)
	p.argv = append(append(p.argv, opts.Args...), "-f", "raw", "-x", "e", "--shared=8", "--persistent", "--cache=writeback", "--discard=unmap", file)
	p.Start()
	t.Cleanup(p.stop)
	return p
}

// Start starts the server (again, after Kill) and waits until it accepts
// connections.
func (p *Peer) Start() {
	p.t.Helper()
	if p.Sock != "" {
		os.Remove(p.Sock)
	}
	p.cmd = exec.Command(p.argv[0], p.argv[1:]...)
	if p.env != nil {
		p.cmd.Env = append(os.Environ(), p.env...)
	}
	p.cmd.Stdout, p.cmd.Stderr = &p.out, &p.out
	p.exited = make(chan struct{})
	if err := p.cmd.Start(); err != nil {
		p.t.Fatal(err)
	}
	go func() { p.cmd.Wait(); close(p.exited) }()
	Until(p.t, p.Name+" accepting connections", func() bool {
		select {
		case <-p.exited:
			p.t.Fatalf("%s exited early: %s", p.Name, p.out.String())
		default:
		}
		return p.accepting()
	})
}

// accepting says whether the server takes connections now.
func (p *Peer) accepting() bool {
	network, addr := "unix", p.Sock
	if p.Sock == "" {
		network, addr = "tcp", p.addr
	}
	c, err := p.dial(network, addr)
	if err == nil {
		c.Close()
	}
	return err == nil
}

// Pause stops the server (SIGSTOP): its connections stay up and requests
// sent to it wait unanswered, until Kill.
func (p *Peer) Pause() { p.cmd.Process.Signal(syscall.SIGSTOP) }

// Kill ends the server with SIGKILL, as a crash would, and waits for it.
func (p *Peer) Kill() {
	p.cmd.Process.Signal(syscall.SIGKILL)
	<-p.exited
}

func (p *Peer) stop() {
	select {
	case <-p.exited:
	default:
		p.Kill()
	}
}

// URI is the peer's export as an NBD URI.
func (p *Peer) URI(export string) string {
	if p.Sock != "" {
		return URI(p.Sock, export)
	}
	return "nbd://" + p.addr + "/" + export
}

// Count is how many requests of op (nbdkit's log names them Read, Write,
// Flush, Trim, Zero, Extents, Cache) reached the server so far.
func (p *Peer) Count(op string) int {
	b, _ := os.ReadFile(p.Log)
	return bytes.Count(b, []byte(" "+op+" id="))
}

// LogLines are the log lines recording op requests.
func (p *Peer) LogLines(op string) []string {
	b, _ := os.ReadFile(p.Log)
	var out []string
	for _, l := range strings.Split(string(b), "\n") {
		if strings.Contains(l, " "+op+" id=") {
			out = append(out, l)
		}
	}
	return out
}

// Connects is how many connections reached the server.
func (p *Peer) Connects() int {
	b, _ := os.ReadFile(p.Log)
	return bytes.Count(b, []byte(" Connect export="))
}

// Disconnects is how many connections to the server have ended.
func (p *Peer) Disconnects() int {
	b, _ := os.ReadFile(p.Log)
	return bytes.Count(b, []byte(" Disconnect transactions="))
}
