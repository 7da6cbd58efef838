// Package cephtest gives a test a throwaway single-node Ceph cluster: one
// mon, one mgr and one BlueStore OSD on a sparse file in the test's own
// temporary directory, bound to 127.0.0.1 on ports of its own, started by
// scripts/ceph-cluster.sh and stopped by PID when the test ends. When the
// test failed, the tail of each daemon's log is shown.
//
// It is test support only. The cluster takes about 10 s to come up and
// about 1 GB of memory under load, so a package's tests share one: a
// single test starts it and runs its cases as subtests.
package cephtest

import (
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
)

// Cluster is a running throwaway cluster.
type Cluster struct {
	Dir  string // its daemons' data, logs and PIDs
	Conf string // its ceph.conf, for clients' conf= or -c
}

// tools are what the cluster and its tests run, with their Debian
// packages.
var tools = map[string]string{
	"ceph-mon":   "ceph-mon",
	"ceph-mgr":   "ceph-mgr",
	"ceph-osd":   "ceph-osd",
	"ceph":       "ceph-common",
	"rbd":        "ceph-common",
	"monmaptool": "ceph-mon",
}

// script is scripts/ceph-cluster.sh of this checkout.
func script() string {
	_, file, _, _ := runtime.Caller(0)
	return filepath.Join(filepath.Dir(file), "..", "..", "..", "scripts", "ceph-cluster.sh")
}

// Start brings a cluster up in a new temporary directory and stops it
// when t ends. The tests that call it are built only with `-tags ceph`,
// which asks for a cluster: a missing tool fails the test rather than
// skipping it.
func Start(t testing.TB) *Cluster {
	t.Helper()
	return start(t, "none")
}

// StartCephx is Start with cephx required: the conf names a keyring with
// client.admin's key, which the ceph and rbd tools use; User makes the
// keys of others.
func StartCephx(t testing.TB) *Cluster {
	t.Helper()
	return start(t, "cephx")
}

func start(t testing.TB, auth string) *Cluster {
	t.Helper()
	for tool, pkg := range tools {
		if _, err := exec.LookPath(tool); err != nil {
			t.Fatalf("%s not installed (Debian package %s; scripts/test.sh installs it)", tool, pkg)
		}
	}
	// A short path: the daemons' admin sockets live under it.
	dir, err := os.MkdirTemp("", "ceph")
	if err != nil {
		t.Fatal(err)
	}
	c := &Cluster{Dir: dir, Conf: filepath.Join(dir, "ceph.conf")}
	t.Cleanup(func() {
		c.Stop()
		if t.Failed() {
			t.Log(c.Logs())
		}
		os.RemoveAll(dir)
	})
	port := freePorts(t, 21)
	out, err := exec.Command(script(), "start", dir, fmt.Sprint(port), auth).CombinedOutput()
	if err != nil {
		t.Fatalf("ceph-cluster.sh start: %v\n%s\n%s", err, out, c.Logs())
	}
	return c
}

// Stop stops the daemons by their PIDs; Start's cleanup does it too.
func (c *Cluster) Stop() {
	exec.Command(script(), "stop", c.Dir).Run()
}

// Logs is the tail of every daemon's log and output.
func (c *Cluster) Logs() string {
	var b strings.Builder
	files, _ := filepath.Glob(filepath.Join(c.Dir, "log", "*"))
	for _, f := range files {
		data, err := os.ReadFile(f)
		if err != nil || len(data) == 0 {
			continue
		}
		lines := strings.Split(strings.TrimRight(string(data), "\n"), "\n")
		lines = lines[max(0, len(lines)-30):]
		fmt.Fprintf(&b, "==> %s (last %d lines) <==\n%s\n", filepath.Base(f), len(lines), strings.Join(lines, "\n"))
	}
	return b.String()
}

// RBD runs the rbd tool against the cluster and returns its output.
func (c *Cluster) RBD(t testing.TB, args ...string) string {
	t.Helper()
	return c.run(t, "rbd", args...)
}

// Ceph runs the ceph tool against the cluster and returns its output.
func (c *Cluster) Ceph(t testing.TB, args ...string) string {
	t.Helper()
	return c.run(t, "ceph", args...)
}

func (c *Cluster) run(t testing.TB, tool string, args ...string) string {
	t.Helper()
	out, err := exec.Command(tool, append([]string{"-c", c.Conf}, args...)...).CombinedOutput()
	if err != nil {
		t.Fatalf("%s %s: %v\n%s", tool, strings.Join(args, " "), err, out)
	}
	return string(out)
}

// CreateImage makes image NAME of size bytes in pool rbd and returns the
// table device that names it: rbd:rbd/NAME:conf=CONF.
func (c *Cluster) CreateImage(t testing.TB, name string, size int64) string {
	t.Helper()
	c.RBD(t, "create", "--size", fmt.Sprintf("%dB", size), "rbd/"+name)
	return c.Device(name)
}

// User makes cephx user client.NAME with the rights RBD clients of pool
// rbd need (`profile rbd`), and returns the path of its keyring.
func (c *Cluster) User(t testing.TB, name string) string {
	t.Helper()
	keyring := filepath.Join(c.Dir, name+".keyring")
	c.Ceph(t, "auth", "get-or-create", "client."+name, "mon", "profile rbd", "osd", "profile rbd pool=rbd", "-o", keyring)
	return keyring
}

// Device is the table device for image (or image@snap) in pool rbd.
func (c *Cluster) Device(image string) string {
	return "rbd:rbd/" + image + ":conf=" + c.Conf
}

// freePorts finds n consecutive loopback ports that nothing listens on
// now, and returns the first.
func freePorts(t testing.TB, n int) int {
	t.Helper()
	for range 100 {
		base := 20000 + rand.IntN(30000)
		free := true
		for p := base; p < base+n && free; p++ {
			l, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", p))
			if err != nil {
				free = false
				continue
			}
			l.Close()
		}
		if free {
			return base
		}
	}
	t.Fatal("no free run of loopback ports")
	return 0
}

// KillOSD kills the OSD with SIGKILL, as a crash would, and returns once
// it is gone. The cluster then serves no I/O until StartOSD.
func (c *Cluster) KillOSD(t testing.TB) {
	t.Helper()
	if out, err := exec.Command(script(), "kill-osd", c.Dir).CombinedOutput(); err != nil {
		t.Fatalf("ceph-cluster.sh kill-osd: %v\n%s", err, out)
	}
}

// StartOSD starts the OSD KillOSD killed, and returns once the monitor
// has it up.
func (c *Cluster) StartOSD(t testing.TB) {
	t.Helper()
	if out, err := exec.Command(script(), "start-osd", c.Dir).CombinedOutput(); err != nil {
		t.Fatalf("ceph-cluster.sh start-osd: %v\n%s", err, out)
	}
}
