package main

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/nbdmapper/nbdmapper/internal/testing/nbdtest"
	"github.com/nbdmapper/nbdmapper/internal/testing/netns"
	"github.com/nbdmapper/nbdmapper/internal/testing/sparse"
)

// The multi-host topology (docs/remote.md): four "hosts", each a network
// namespace linked to the client's namespace by a veth pair, each serving
// a 64 MiB file with a different real NBD server on HOST:10809, plus an
// nbdkit with its log filter on HOST:10810 for counting requests. The
// nbdmapper under test runs in the client namespace and serves a unix
// socket, which the test's clients (nbdsh, fio) use from outside.
//
//	host 1  10.99.1.2  nbdkit file, 1-2 ms delay (and :10810 nbdkit, counted)
//	host 2  10.99.2.2  qemu-nbd           (and :10810 ...)
//	host 3  10.99.3.2  nbd-server         (and :10810 ...)
//	host 4  10.99.4.2  nbdmapper serve    (and :10810 ...)
//
// Exports of the nbdmapper under test:
//
//	str  striped 4 x 64 KiB over the first 32 MiB of hosts 1-4
//	lin  1024 linear segments of 128 KiB over the last 32 MiB of hosts 1-4
//	cnt  1024 linear segments of 256 KiB over the counting nbdkits
const (
	hostFile = 64 << 20
	half     = 32 << 20
	strChunk = 64 << 10
	linSeg   = 128 << 10
	cntSeg   = 256 << 10
	cntMax   = 8 << 20 // the counting nbdkits' maximum request: trims split here
)

type hostRig struct {
	net       *netns.Net
	dir       string
	files     []string // hosts' files, 1-4
	cntFiles  []string
	nbdkit    *nbdtest.Peer   // host 1's server
	counters  []*nbdtest.Peer // the :10810 nbdkits
	sock      string          // the nbdmapper under test's socket
	client    *exec.Cmd
	clientOut *nbdtest.SyncBuffer
	exited    chan struct{}
}

func TestHosts(t *testing.T) {
	for _, tool := range []string{"nbdkit", "qemu-nbd", "nbd-server", "fio"} {
		nbdtest.Tool(t, tool)
	}
	nbdtest.Python(t)
	r := &hostRig{net: netns.New(t, 4), dir: nbdtest.ShortDir(t)}
	r.startHosts(t)
	r.startClient(t)

	t.Run("placement", r.placement)
	t.Run("fio", r.fio)
	t.Run("flush-and-trim-counts", r.counts)
	t.Run("remote-killed", r.killed)

	// At shutdown serve syncs every device; host 1's cannot vouch for its
	// writes, and serve says so with a failing exit status.
	if err := r.client.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	<-r.exited
	if r.client.ProcessState.ExitCode() != 1 || !strings.Contains(r.clientOut.String(), "may be lost") {
		t.Fatalf("nbdmapper serve after SIGTERM: %v, want exit status 1 naming the lost writes\n%s", r.client.ProcessState, r.clientOut.String())
	}
}

// uri is host i's (0-based) main export.
func (r *hostRig) uri(i int) string {
	export := "e"
	if i == 0 {
		export = ""
	}
	return fmt.Sprintf("nbd://%s:10809/%s", r.net.Hosts[i].Addr, export)
}

func (r *hostRig) startHosts(t *testing.T) {
	for i, h := range r.net.Hosts {
		f := sparse.Create(t, filepath.Join(r.dir, fmt.Sprintf("h%d.img", i+1)), hostFile)
		r.files = append(r.files, f)
		at := nbdtest.PeerOptions{Addr: h.Addr + ":10809", Wrap: netns.Exec(h.NS), Dial: netns.Dialer(h.NS)}
		switch i {
		case 0:
			// LAN-like latency (there is no netem here), which also keeps
			// fio's requests in flight when it is killed.
			r.nbdkit = nbdtest.StartNbdkit(t, r.dir, "h1", at, "--filter=delay", "file", f, "delay-read=1ms", "delay-write=2ms")
		case 1:
			nbdtest.StartQemuNbd(t, r.dir, "h2", f, at)
		case 2:
			startNbdServer(t, r.dir, h, f)
		case 3:
			writeFile(t, filepath.Join(r.dir, "h4.table"), fmt.Sprintf("0 %d linear %s 0\n", hostFile/512, f))
			startProc(t, h.NS, netns.Dialer(h.NS), "tcp", h.Addr+":10809", append(netns.Exec(h.NS), bin, "serve",
				"--listen", h.Addr+":10809", "--metrics", "off", "--control", "off", "e="+filepath.Join(r.dir, "h4.table")))
		}
		cf := sparse.Create(t, filepath.Join(r.dir, fmt.Sprintf("c%d.img", i+1)), hostFile)
		r.cntFiles = append(r.cntFiles, cf)
		r.counters = append(r.counters, nbdtest.StartNbdkit(t, r.dir, fmt.Sprintf("c%d", i+1),
			nbdtest.PeerOptions{Addr: h.Addr + ":10810", Wrap: netns.Exec(h.NS), Dial: netns.Dialer(h.NS)},
			"--filter=blocksize-policy", "file", cf, "blocksize-maximum=8M", "blocksize-error-policy=error"))
	}
}

// startNbdServer runs nbd-server in h's namespace. It daemonizes and
// forks a child per connection, so its processes are found by the unique
// configuration file they were started with, and killed at the end.
func startNbdServer(t *testing.T, dir string, h netns.Host, file string) {
	conf := filepath.Join(dir, "nbd-server.conf")
	writeFile(t, conf, fmt.Sprintf("[generic]\nlistenaddr = %s\nport = 10809\n[e]\nexportname = %s\nflush = true\nfua = true\ntrim = true\n", h.Addr, file))
	argv := append(netns.Exec(h.NS), "nbd-server", "-C", conf)
	if out, err := exec.Command(argv[0], argv[1:]...).CombinedOutput(); err != nil {
		t.Fatalf("nbd-server: %v\n%s", err, out)
	}
	t.Cleanup(func() {
		for _, pid := range pidsWith(conf) {
			syscall.Kill(pid, syscall.SIGKILL)
		}
	})
	waitDial(t, "nbd-server", netns.Dialer(h.NS), "tcp", h.Addr+":10809", nil)
}

// pidsWith lists the processes whose command line holds arg.
func pidsWith(arg string) []int {
	var pids []int
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		b, _ := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if bytes.Contains(b, []byte("\x00"+arg+"\x00")) || bytes.HasSuffix(b, []byte("\x00"+arg)) {
			pids = append(pids, pid)
		}
	}
	return pids
}

// startProc runs argv until the test ends and waits until addr accepts.
func startProc(t *testing.T, name string, dial func(string, string) (net.Conn, error), network, addr string, argv []string) (*exec.Cmd, *nbdtest.SyncBuffer, chan struct{}) {
	var out nbdtest.SyncBuffer
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan struct{})
	go func() { cmd.Wait(); close(exited) }()
	t.Cleanup(func() { cmd.Process.Kill(); <-exited })
	waitDial(t, name, dial, network, addr, exited)
	return cmd, &out, exited
}

func waitDial(t *testing.T, name string, dial func(string, string) (net.Conn, error), network, addr string, exited chan struct{}) {
	nbdtest.Until(t, name+" accepting on "+addr, func() bool {
		select {
		case <-exited:
			t.Fatalf("%s exited early", name)
		default:
		}
		c, err := dial(network, addr)
		if err == nil {
			c.Close()
		}
		return err == nil
	})
}

// startClient writes the tables and starts the nbdmapper under test in the
// client namespace.
func (r *hostRig) startClient(t *testing.T) {
	var str, lin, cnt strings.Builder
	fmt.Fprintf(&str, "0 %d striped 4 %d", 4*half/512, strChunk/512)
	for i := range 4 {
		fmt.Fprintf(&str, " %s 0", r.uri(i))
	}
	str.WriteString("\n")
	for i := int64(0); i < 1024; i++ {
		dev, off := linPlace(i * linSeg)
		fmt.Fprintf(&lin, "%d %d linear %s %d\n", i*linSeg/512, linSeg/512, r.uri(dev), off/512)
		cdev, coff := cntPlace(i * cntSeg)
		fmt.Fprintf(&cnt, "%d %d linear nbd://%s:10810/ %d\n", i*cntSeg/512, cntSeg/512, r.net.Hosts[cdev].Addr, coff/512)
	}
	for name, text := range map[string]string{"str": str.String(), "lin": lin.String(), "cnt": cnt.String()} {
		writeFile(t, filepath.Join(r.dir, name+".table"), text)
	}
	r.sock = filepath.Join(r.dir, "nbd.sock")
	argv := append(netns.Exec(r.net.Client), bin, "serve", "--socket", r.sock, "--metrics", "127.0.0.1:9810",
		"--control", "off", "--remote-timeout", "4s", "--remote-backoff-max", "200ms",
		"str="+filepath.Join(r.dir, "str.table"), "lin="+filepath.Join(r.dir, "lin.table"), "cnt="+filepath.Join(r.dir, "cnt.table"))
	r.client, r.clientOut, r.exited = startProc(t, "nbdmapper serve", net.Dial, "unix", r.sock, argv)
}

// strPlace, linPlace and cntPlace say where each table puts virtual
// offset v: host (0-based) and offset in its file.
func strPlace(v int64) (int, int64) {
	k := v / strChunk
	return int(k % 4), k/4*strChunk + v%strChunk
}

func linPlace(v int64) (int, int64) {
	i := v / linSeg
	slot := (i / 4 * 389) % 256
	return int(i % 4), half + slot*linSeg + v%linSeg
}

func cntPlace(v int64) (int, int64) {
	i := v / cntSeg
	slot := (i / 4 * 389) % 256
	return int(i % 4), slot*cntSeg + v%cntSeg
}

func (r *hostRig) uriOf(export string) string { return nbdtest.URI(r.sock, export) }

// stampScript fills an export of n bytes with stamped 4 KiB blocks (block
// b: its number as 8 bytes big-endian, then base[b%251:]) and flushes.
func stampScript(n int64) string {
	return fmt.Sprintf(`
import struct
base = bytes(range(251)) * 18
def blk(b):
    return struct.pack('>Q', b) + base[b %% 251:b %% 251 + 4088]
for off in range(0, %d, 4 << 20):
    h.pwrite(b''.join(blk(b) for b in range(off // 4096, off // 4096 + 1024)), off)
h.flush()
`, n)
}

func stamp(b int64) []byte {
	p := binary.BigEndian.AppendUint64(nil, uint64(b))
	for j := int64(0); j < 4088; j++ {
		p = append(p, byte((b%251+j)%251))
	}
	return p
}

// placement: every stamped block is at the offset the table dictates, on
// the file of the host the table names.
func (r *hostRig) placement(t *testing.T) {
	for _, x := range []struct {
		export string
		place  func(int64) (int, int64)
	}{{"str", strPlace}, {"lin", linPlace}} {
		nbdsh(t, r.uriOf(x.export), stampScript(4*half))
		files := make([]*os.File, 4)
		for i, name := range r.files {
			f, err := os.Open(name)
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			files[i] = f
		}
		got := make([]byte, 4096)
		bad := 0
		for b := int64(0); b < 4*half/4096; b++ {
			host, off := x.place(b * 4096)
			if _, err := files[host].ReadAt(got, off); err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(got, stamp(b)) {
				if bad++; bad <= 10 {
					t.Errorf("%s: block %d is not on host %d at %d: found %x...", x.export, b, host+1, off, got[:16])
				}
			}
		}
	}
}

// fio writes and verifies (crc32c) both exports through libnbd.
func (r *hostRig) fio(t *testing.T) {
	for _, export := range []string{"str", "lin"} {
		out, err := exec.Command("fio", "--name=verify", "--ioengine=nbd", "--uri="+r.uriOf(export),
			"--rw=randwrite", "--bsrange=4k-256k", "--size=128m", "--io_size=96m", "--iodepth=16",
			"--verify=crc32c", "--verify_fatal=1", "--randrepeat=0", "--verify_state_save=0").CombinedOutput()
		if err != nil || !regexp.MustCompile(`err= 0`).Match(out) {
			t.Fatalf("fio on %s: %v\n%s", export, err, out)
		}
	}
}

// counts: over 1024 segments on four nbdkits, one client flush is one NBD
// flush per written remote and none for the clean one, and a whole-device
// trim is, per remote, the 256 segments merged and split at its 8 MiB
// maximum.
func (r *hostRig) counts(t *testing.T) {
	count := func(op string) []int {
		var n []int
		for _, p := range r.counters {
			n = append(n, p.Count(op))
		}
		return n
	}
	// Write one block in each of the first 30 segments on hosts 1-3.
	var script strings.Builder
	for i := int64(0); i < 40; i++ {
		if i%4 != 3 {
			fmt.Fprintf(&script, "h.pwrite(b'w' * 4096, %d)\n", i*cntSeg+4096)
		}
	}
	before := count("Flush")
	nbdsh(t, r.uriOf("cnt"), script.String()+"h.flush()\nh.flush()\n")
	after := count("Flush")
	if d := fmt.Sprint(diff(after, before)); d != "[1 1 1 0]" {
		t.Fatalf("NBD flushes per remote for two client flushes (the second with nothing written): %s, want [1 1 1 0]", d)
	}
	before = count("Trim")
	nbdsh(t, r.uriOf("cnt"), fmt.Sprintf("h.trim(%d, 0)\n", 4*hostFile))
	want := hostFile / cntMax
	for i, n := range diff(count("Trim"), before) {
		if n != want {
			t.Errorf("host %d got %d TRIMs for a whole-device trim, want %d:\n%s", i+1, n, want, strings.Join(r.counters[i].LogLines("Trim"), "\n"))
		}
	}
}

func diff(a, b []int) []int {
	out := make([]int, len(a))
	for i := range a {
		out[i] = a[i] - b[i]
	}
	return out
}

// status runs `nbdmapper status` against the server under test.
func (r *hostRig) status(t *testing.T) string {
	argv := append(netns.Exec(r.net.Client), bin, "status", "--metrics", "127.0.0.1:9810")
	out, err := exec.Command(argv[0], argv[1:]...).Output()
	if err != nil {
		t.Fatalf("status: %v", err)
	}
	return string(out)
}

// killed: host 1's nbdkit is killed while fio writes to "lin" (a quarter
// of it is on host 1) and restarted a second later, within
// --remote-timeout: fio ends without an error, its requests retried. The
// next flush fails (writes were acknowledged and unflushed when the
// connections dropped); the server stays up and serves its other exports;
// reads and writes of host 1 go on. Then host 1 stays away past
// --remote-timeout: requests to it fail with EIO, and succeed again once
// it is back.
func (r *hostRig) killed(t *testing.T) {
	fio := exec.Command("fio", "--name=churn", "--ioengine=nbd", "--uri="+r.uriOf("lin"),
		"--rw=randwrite", "--bs=4k", "--size=128m", "--iodepth=16", "--time_based", "--runtime=6s",
		"--verify=crc32c", "--verify_fatal=1", "--randrepeat=0", "--verify_state_save=0")
	var fout nbdtest.SyncBuffer
	fio.Stdout, fio.Stderr = &fout, &fout
	if err := fio.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- fio.Wait() }()
	writes := func() int { return r.nbdkit.Count("Write") }
	start := writes()
	nbdtest.Until(t, "fio's writes to reach host 1", func() bool { return writes() > start+100 })
	// Killed with requests in flight for certain, however the machine
	// schedules fio: they must be retried on the new connection.
	r.nbdkit.Pause()
	inFlight := regexp.MustCompile(`remote ` + regexp.QuoteMeta(r.uri(0)) + `: up .* in flight [1-9]`)
	nbdtest.Until(t, "requests in flight to the paused host 1", func() bool { return inFlight.MatchString(r.status(t)) })
	r.nbdkit.Kill()
	nbdtest.Until(t, "status to show host 1 down", func() bool {
		return strings.Contains(r.status(t), "remote "+r.uri(0)+": down")
	})
	time.Sleep(time.Second) // a remote away for a while, not a blip
	r.nbdkit.Start()
	if err := nbdtest.Recv(t, done, "fio"); err != nil || !regexp.MustCompile(`err= 0`).Match([]byte(fout.String())) {
		t.Fatalf("fio across the remote's restart: %v\n%s", err, fout.String())
	}
	st := r.status(t)
	if !regexp.MustCompile(`lin: remote ` + regexp.QuoteMeta(r.uri(0)) + `: up connections 4/4 reconnects [1-9]\d* retries [1-9]\d* .* lost: `).MatchString(st) {
		t.Fatalf("status after the restart does not show reconnections, retries and lost writes:\n%s", st)
	}
	flushFails := "try:\n    h.flush()\nexcept nbd.Error as e:\n    assert e.errnum == errno.EIO, e\nelse:\n    raise AssertionError('flush succeeded')\n"
	nbdsh(t, r.uriOf("lin"), "import errno\n"+flushFails+flushFails)
	// The server is up: exports without host 1 flush (str, striped over
	// it too, fails like lin), host 1 reads and writes.
	nbdsh(t, r.uriOf("cnt"), "h.pwrite(b's' * 65536, 65536)\nh.flush()")
	nbdsh(t, r.uriOf("str"), "import errno\n"+flushFails)
	nbdsh(t, r.uriOf("lin"), "h.pwrite(b'k' * 4096, 0)\nassert h.pread(4096, 0) == b'k' * 4096")

	// Away past the deadline: EIO; back: served again.
	r.nbdkit.Kill()
	nbdsh(t, r.uriOf("lin"), "import errno\ntry:\n    h.pread(4096, 0)\nexcept nbd.Error as e:\n    assert e.errnum == errno.EIO, e\nelse:\n    raise AssertionError('read from a dead remote succeeded')\n")
	r.nbdkit.Start()
	nbdtest.Until(t, "host 1 back", func() bool { return strings.Contains(r.status(t), "remote "+r.uri(0)+": up") })
	nbdsh(t, r.uriOf("lin"), "assert h.pread(4096, 0) == b'k' * 4096")
	if !regexp.MustCompile(`remote ` + regexp.QuoteMeta(r.uri(0)) + `: up .*timeouts [1-9]`).MatchString(r.status(t)) {
		t.Fatalf("status does not count the timeout:\n%s", r.status(t))
	}
}
