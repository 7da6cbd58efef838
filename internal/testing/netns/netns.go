// Package netns gives a test a small network of its own: a client network
// namespace joined to each of N "host" namespaces by a veth pair, with
// addresses the test assigns, all removed when the test ends. Servers run
// inside the host namespaces (Exec), the program under test inside the
// client's, and nothing reaches or leaves them: the machine's own
// interfaces, routes and listeners are never touched.
//
//	client ns  vc1 10.99.1.1/24 ---- vh1 10.99.1.2/24  host ns 1
//	           vc2 10.99.2.1/24 ---- vh2 10.99.2.2/24  host ns 2
//	           ...
//
// It is test support only, and needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN
// to make namespaces); without it New skips the test.
package netns

import (
	"fmt"
	"net"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// Net is a test's namespaces.
type Net struct {
	Client string // the client namespace's name
	Hosts  []Host
}

// Host is one host namespace and its link to the client.
type Host struct {
	NS         string
	Addr       string // the host's address, 10.99.I.2
	ClientAddr string // the client's end of the link, 10.99.I.1
}

// New makes the client namespace and hosts host namespaces (at most 254),
// or skips the test if it cannot (not root, no ip(8), no namespaces). The
// names carry the process id, so that parallel test processes do not
// collide.
func New(t testing.TB, hosts int) *Net {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("network namespaces need root")
	}
	if _, err := exec.LookPath("ip"); err != nil {
		t.Skip("no ip(8) (Debian package iproute2)")
	}
	prefix := fmt.Sprintf("nbdmt%d", os.Getpid())
	n := &Net{Client: prefix + "c"}
	if err := run("ip", "netns", "add", n.Client); err != nil {
		t.Skipf("cannot make a network namespace: %v", err)
	}
	t.Cleanup(func() { run("ip", "netns", "del", n.Client) })
	for i := 1; i <= hosts; i++ {
		h := Host{NS: fmt.Sprintf("%sh%d", prefix, i), Addr: fmt.Sprintf("10.99.%d.2", i), ClientAddr: fmt.Sprintf("10.99.%d.1", i)}
		if err := run("ip", "netns", "add", h.NS); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { run("ip", "netns", "del", h.NS) })
		vc, vh := fmt.Sprintf("vc%d", i), fmt.Sprintf("vh%d", i)
		// Both ends are made straight inside their namespaces, so no
		// interface ever appears in the machine's own.
		for _, cmd := range [][]string{
			{"ip", "link", "add", vc, "netns", n.Client, "type", "veth", "peer", "name", vh, "netns", h.NS},
			{"ip", "-n", n.Client, "addr", "add", h.ClientAddr + "/24", "dev", vc},
			{"ip", "-n", h.NS, "addr", "add", h.Addr + "/24", "dev", vh},
			{"ip", "-n", n.Client, "link", "set", vc, "up"},
			{"ip", "-n", h.NS, "link", "set", vh, "up"},
			{"ip", "-n", h.NS, "link", "set", "lo", "up"},
		} {
			if err := run(cmd...); err != nil {
				t.Fatal(err)
			}
		}
		n.Hosts = append(n.Hosts, h)
	}
	if err := run("ip", "-n", n.Client, "link", "set", "lo", "up"); err != nil {
		t.Fatal(err)
	}
	return n
}

func run(argv ...string) error {
	out, err := exec.Command(argv[0], argv[1:]...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("%s: %v: %s", strings.Join(argv, " "), err, out)
	}
	return nil
}

// Exec is the prefix that runs a command in namespace ns: ip netns exec
// NS. ip execs the command, so its process id is the command's.
func Exec(ns string) []string { return []string{"ip", "netns", "exec", ns} }

// Dialer dials from inside namespace ns.
func Dialer(ns string) func(network, addr string) (net.Conn, error) {
	return func(network, addr string) (net.Conn, error) { return DialIn(ns, network, addr) }
}

// DialIn connects to addr from inside namespace ns: the socket is made on
// an OS thread moved into the namespace for the call and moved back after
// it, so no other goroutine ever runs in the namespace. (Letting the
// thread die instead would be simpler, but a child process started from
// that thread with a parent-death signal, as nbdkit --exit-with-parent
// sets one, would die with it.)
func DialIn(ns, network, addr string) (net.Conn, error) {
	type result struct {
		c   net.Conn
		err error
	}
	ch := make(chan result, 1)
	go func() {
		runtime.LockOSThread()
		home, err := unix.Open("/proc/thread-self/ns/net", unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			runtime.UnlockOSThread()
			ch <- result{nil, err}
			return
		}
		defer unix.Close(home)
		fd, err := unix.Open("/run/netns/"+ns, unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			runtime.UnlockOSThread()
			ch <- result{nil, err}
			return
		}
		defer unix.Close(fd)
		if err := unix.Setns(fd, unix.CLONE_NEWNET); err != nil {
			runtime.UnlockOSThread()
			ch <- result{nil, err}
			return
		}
		c, err := net.Dial(network, addr)
		if unix.Setns(home, unix.CLONE_NEWNET) == nil {
			runtime.UnlockOSThread()
		} // else: the thread stays locked and is dropped when this goroutine ends
		ch <- result{c, err}
	}()
	r := <-ch
	return r.c, r.err
}
