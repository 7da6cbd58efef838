package main

import (
	"bytes"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"flag"
	"fmt"
	"io"
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
	"github.com/nbdmapper/nbdmapper/internal/testing/sparse"
	"github.com/nbdmapper/nbdmapper/nbdtarget"
)

// rssOverhead is what the server may hold beyond its --memory budget: the
// Go runtime and heap slack, the table, per-connection buffers and
// goroutine stacks. docs/limits.md states it.
const rssOverhead = 64 << 20

// stamped is 1 MiB of random bytes with its block number at both ends, so
// that a misplaced or shifted block shows; comparing it costs one
// bytes.Equal per MiB.
type stamped struct{ base []byte }

func newStamped(t *testing.T) stamped {
	b := make([]byte, 1<<20)
	if _, err := rand.Read(b); err != nil {
		t.Fatal(err)
	}
	return stamped{b}
}

func (s stamped) block(i int64, dst []byte) []byte {
	dst = append(dst[:0], s.base...)
	binary.LittleEndian.PutUint64(dst, uint64(i))
	binary.LittleEndian.PutUint64(dst[len(dst)-8:], uint64(i))
	return dst
}

// TestLongRequestsInBoundedMemory writes and reads back 1 GiB in single
// requests from a raw client (as clients that negotiated no block size
// may), and 60 MiB through libnbd (which caps a request at 64 MiB), with a
// 64 MiB memory budget: every byte comes back, and the server's peak RSS
// stays within the budget plus rssOverhead.
func TestLongRequestsInBoundedMemory(t *testing.T) {
	const gib = 1 << 30
	dir := t.TempDir()
	sparse.Create(t, filepath.Join(dir, "a.img"), gib+(64<<20))
	writeFile(t, filepath.Join(dir, "t.table"), fmt.Sprintf("0 %d linear a.img 0\n", (gib+(64<<20))/512))
	const budget = 64 << 20
	s := nbdtest.Start(t, bin, dir, "--metrics", "off", "--memory", "64M", "t=t.table")

	st := newStamped(t)
	const off = 4096
	blocks := int64(gib >> 20)
	for _, structured := range []bool{false, true} {
		var opts []nbdtest.DialOption
		if structured {
			opts = append(opts, nbdtest.Structured)
		}
		c, err := nbdtest.DialNBD("unix", s.Socket, "t", opts...)
		if err != nil {
			t.Fatal(err)
		}
		if !structured {
			// One 1 GiB WRITE, its payload sent as it is made.
			if err := c.Send(nbdtest.CmdWrite, 0, 1, off, gib); err != nil {
				t.Fatal(err)
			}
			var buf []byte
			for i := range blocks {
				buf = st.block(i, buf)
				if _, err := c.Write(buf); err != nil {
					t.Fatal(err)
				}
			}
			if r, err := c.Recv(); err != nil || r.Handle != 1 || r.Errno != 0 {
				t.Fatalf("1 GiB write: %+v %v", r, err)
			}
		}
		// One 1 GiB READ, checked as it arrives.
		if err := c.Send(nbdtest.CmdRead, 0, 2, off, gib); err != nil {
			t.Fatal(err)
		}
		got, want := make([]byte, 1<<20), make([]byte, 0, 1<<20)
		pos := int64(0)
		for pos < gib {
			r, err := c.Recv()
			if err != nil || r.Handle != 2 || r.Errno != 0 {
				t.Fatalf("structured=%v: 1 GiB read at %d: %+v %v", structured, pos, r, err)
			}
			n := int64(gib)
			if !r.Simple {
				if r.Type != 1 || int64(r.Offset) != off+pos {
					t.Fatalf("chunk type %d at %d, want data at %d", r.Type, r.Offset, off+pos)
				}
				n = r.DataLen
			}
			// Stream boundaries need not fall on MiB blocks: compare
			// whatever arrives against the stamped pattern.
			for left := n; left > 0; {
				blk, in := pos>>20, pos&(1<<20-1)
				k := min(left, 1<<20-in)
				if _, err := io.ReadFull(c, got[:k]); err != nil {
					t.Fatal(err)
				}
				want = st.block(blk, want)
				if !bytes.Equal(got[:k], want[in:in+k]) {
					t.Fatalf("structured=%v: bytes at %d differ from what was written", structured, pos)
				}
				pos += k
				left -= k
			}
			if r.Done() && pos != gib {
				t.Fatalf("reply done after %d bytes", pos)
			}
		}
		c.Close()
	}

	// 60 MiB through libnbd, in one request each way.
	out, err := nbdtest.Nbdsh(t, "-u", s.URI("t"), "-c", `
import os
b = os.urandom(60 << 20)
h.pwrite(b, 12345)
assert h.pread(60 << 20, 12345) == b
print("ok")
`).CombinedOutput()
	if err != nil || !strings.Contains(string(out), "ok") {
		t.Fatalf("nbdsh 60 MiB round trip: %v\n%s", err, out)
	}

	rss := s.PeakRSS(t)
	t.Logf("peak RSS %d MiB with a %d MiB budget", rss>>20, budget>>20)
	if rss > budget+rssOverhead {
		t.Fatalf("peak RSS %d MiB, more than the %d MiB budget + %d MiB", rss>>20, budget>>20, rssOverhead>>20)
	}
	s.Stop(t)
}

func writeFile(t *testing.T, path, text string) {
	t.Helper()
	if err := os.WriteFile(path, []byte(text), 0o644); err != nil {
		t.Fatal(err)
	}
}

// TestServeSurvivesDescriptorExhaustion runs the server with few file
// descriptors and opens more idle connections than it can take: accept
// fails with EMFILE, the server backs off and keeps running, and once the
// idle clients leave it serves a new one.
func TestServeSurvivesDescriptorExhaustion(t *testing.T) {
	dir := t.TempDir()
	sparse.Create(t, filepath.Join(dir, "a.img"), 1<<20)
	writeFile(t, filepath.Join(dir, "t.table"), "0 2048 linear a.img 0\n")
	sock := filepath.Join(dir, "nbd.sock")
	// ulimit -n sets the hard limit too, so the Go runtime cannot raise it.
	stderr, exited := startUnder(t, dir, `ulimit -n 32 && exec "$0" serve --socket nbd.sock --metrics off --handshake-timeout 1h t=t.table`)
	waitUnix(t, sock, exited)

	var idle []net.Conn
	for range 64 {
		nc, err := net.Dial("unix", sock)
		if err != nil {
			t.Fatal(err)
		}
		idle = append(idle, nc)
	}
	// The last idle client is still in the backlog: the server is out of
	// descriptors. Wait until it has said so.
	deadline := time.Now().Add(60 * time.Second)
	for !strings.Contains(stderr.String(), "too many open files") {
		select {
		case err := <-exited:
			t.Fatalf("server exited (%v) on descriptor exhaustion\n%s", err, stderr.String())
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("no EMFILE after 64 idle clients\n%s", stderr.String())
		}
		time.Sleep(10 * time.Millisecond)
	}
	for _, nc := range idle {
		nc.Close()
	}
	out, err := exec.Command(nbdtest.Tool(t, "nbdinfo"), "--size", nbdtest.URI(sock, "t")).CombinedOutput()
	if err != nil || strings.TrimSpace(string(out)) != "1048576" {
		t.Fatalf("nbdinfo after exhaustion: %v %s\n%s", err, out, stderr.String())
	}
}

// startUnder runs `sh -c script` in dir with the nbdmapper binary as $0,
// for what must be set up just before serve starts (a ulimit, systemd's
// LISTEN_* variables), with files as fds 3, 4, ... It returns serve's
// standard error and a channel that gets how it exited; serve is killed
// when the test ends.
func startUnder(t *testing.T, dir, script string, files ...*os.File) (*nbdtest.SyncBuffer, chan error) {
	t.Helper()
	cmd := exec.Command("sh", "-c", script, bin)
	cmd.Dir = dir
	cmd.ExtraFiles = files
	stderr := new(nbdtest.SyncBuffer)
	cmd.Stderr = stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	t.Cleanup(func() { cmd.Process.Kill() })
	return stderr, exited
}

// waitUnix waits until a unix socket accepts, or fails if the process
// exits first.
func waitUnix(t *testing.T, sock string, exited chan error) {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for {
		if nc, err := net.Dial("unix", sock); err == nil {
			nc.Close()
			return
		}
		select {
		case err := <-exited:
			t.Fatalf("server exited before listening: %v", err)
		default:
		}
		if time.Now().After(deadline) {
			t.Fatal("server never listened")
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// envInt reads a test size from the environment (bench/hostile.sh sets
// them), or returns def.
func envInt(t *testing.T, name string, def int) int {
	v := os.Getenv(name)
	if v == "" {
		return def
	}
	var n int
	if _, err := fmt.Sscan(v, &n); err != nil || n <= 0 {
		t.Fatalf("%s=%q: want a positive integer", name, v)
	}
	return n
}

// TestHostileLoad keeps the most expensive requests in flight — maximum-
// length TRIM, BLOCK_STATUS, CACHE and WRITE_ZEROES — over a striped table
// with 1-sector chunks and a table of 1,048,576 segments, while other
// connections move 1 GiB READs and WRITEs. Every request gets its reply,
// and the server's peak RSS stays within --memory plus rssOverhead.
//
// HOSTILE_CONNS connections per table each keep HOSTILE_DEPTH requests in
// flight (defaults are small for the suite; bench/hostile.sh runs 64 x 64).
func TestHostileLoad(t *testing.T) {
	if testing.Short() {
		t.Skip("hostile load: not in -short")
	}
	conns := envInt(t, "HOSTILE_CONNS", 4)
	depth := envInt(t, "HOSTILE_DEPTH", 8)
	const gib = 1 << 30
	dir := t.TempDir()
	for _, f := range []string{"a.img", "b.img"} {
		sparse.Create(t, filepath.Join(dir, f), 2*gib)
	}
	for _, f := range []string{"c.img", "d.img"} {
		sparse.Create(t, filepath.Join(dir, f), 256<<20)
	}
	writeFile(t, filepath.Join(dir, "s.table"), fmt.Sprintf("0 %d striped 2 1 a.img 0 b.img 0\n", 4*gib/512))
	// 1,048,576 one-sector segments, alternating between c and d.
	var m strings.Builder
	const segs = 1 << 20
	for i := range segs {
		fmt.Fprintf(&m, "%d 1 linear %s %d\n", i, []string{"c.img", "d.img"}[i%2], i/2)
	}
	writeFile(t, filepath.Join(dir, "m.table"), m.String())
	const budget = 64 << 20
	s := nbdtest.Start(t, bin, dir, "--metrics", "off", "--memory", "64M", "s=s.table", "m=m.table")
	// The tables themselves are the operator's doing, not the clients':
	// the bound is on what the load adds to the peak after start-up.
	startRSS := s.PeakRSS(t)

	type result struct {
		what string
		err  error
	}
	results := make(chan result, 2*conns+2)
	hostile := func(export string, id int) {
		c, err := nbdtest.DialNBD("unix", s.Socket, export, nbdtest.Allocation)
		if err != nil {
			results <- result{export, err}
			return
		}
		defer c.Close()
		length := uint32(min(c.Size(), 1<<32-512))
		kinds := []uint16{nbdtest.CmdTrim, nbdtest.CmdBlockStatus, nbdtest.CmdCache, nbdtest.CmdWriteZeroes}
		for h := range depth {
			if err := c.Send(kinds[(h+id)%len(kinds)], 0, uint64(h), 0, length); err != nil {
				results <- result{export, err}
				return
			}
		}
		done := map[uint64]bool{}
		for len(done) < depth {
			r, err := c.Recv()
			if err != nil {
				results <- result{export, fmt.Errorf("after %d replies: %w", len(done), err)}
				return
			}
			if r.Errno != 0 || r.Type == 1 || done[r.Handle] {
				results <- result{export, fmt.Errorf("reply %+v", r)}
				return
			}
			if r.Done() {
				done[r.Handle] = true
			}
		}
		results <- result{export, nil}
	}
	bulk := func(typ uint16) {
		c, err := nbdtest.DialNBD("unix", s.Socket, "s")
		if err != nil {
			results <- result{"bulk", err}
			return
		}
		defer c.Close()
		if err := c.Send(typ, 0, 1, 0, gib); err != nil {
			results <- result{"bulk", err}
			return
		}
		if typ == nbdtest.CmdWrite {
			p := make([]byte, 1<<20)
			for range gib >> 20 {
				if _, err := c.Write(p); err != nil {
					results <- result{"bulk write", err}
					return
				}
			}
		}
		r, err := c.Recv()
		if err == nil && (r.Errno != 0 || r.Handle != 1) {
			err = fmt.Errorf("reply %+v", r)
		}
		if err == nil && typ == nbdtest.CmdRead {
			_, err = io.CopyN(io.Discard, c, gib)
		}
		results <- result{"bulk", err}
	}
	for i := range conns {
		go hostile("s", i)
		go hostile("m", i)
	}
	go bulk(nbdtest.CmdWrite)
	go bulk(nbdtest.CmdRead)
	for range 2*conns + 2 {
		if r := <-results; r.err != nil {
			t.Fatalf("%s: %v\n%s", r.what, r.err, s.Stderr())
		}
	}
	rss := s.PeakRSS(t)
	t.Logf("%d connections x %d requests per table, plus 1 GiB READ and WRITE: peak RSS %d MiB after start-up at %d MiB, with a %d MiB budget",
		conns, depth, rss>>20, startRSS>>20, budget>>20)
	if rss-startRSS > budget+rssOverhead {
		t.Fatalf("peak RSS grew by %d MiB under load, more than the %d MiB budget + %d MiB", (rss-startRSS)>>20, budget>>20, rssOverhead>>20)
	}
	s.Stop(t)
}

// TestFailedListenerExitsNonZero passes serve a listening socket, as
// systemd does, and then shuts that socket down under it: accept fails for
// good, and serve stops with the reason and a non-zero exit status instead
// of the 0 of an orderly stop.
func TestFailedListenerExitsNonZero(t *testing.T) {
	dir := t.TempDir()
	sparse.Create(t, filepath.Join(dir, "a.img"), 1<<20)
	writeFile(t, filepath.Join(dir, "t.table"), "0 2048 linear a.img 0\n")
	sock := filepath.Join(dir, "nbd.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	lf, err := l.(*net.UnixListener).File()
	if err != nil {
		t.Fatal(err)
	}
	defer lf.Close()
	// LISTEN_PID must be serve's own pid: the shell's, which exec keeps.
	// The listener becomes fd 3, where LISTEN_FDS starts.
	stderr, exited := startUnder(t, dir, `LISTEN_PID=$$ LISTEN_FDS=1 LISTEN_FDNAMES=nbd exec "$0" serve --metrics off t=t.table`, lf)
	out, err := exec.Command(nbdtest.Tool(t, "nbdinfo"), "--size", nbdtest.URI(sock, "t")).CombinedOutput()
	if err != nil || strings.TrimSpace(string(out)) != "1048576" {
		t.Fatalf("nbdinfo through the passed socket: %v %s\n%s", err, out, stderr.String())
	}
	if err := syscall.Shutdown(int(lf.Fd()), syscall.SHUT_RDWR); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-exited:
		var ee *exec.ExitError
		if !errors.As(err, &ee) || ee.ExitCode() != 1 {
			t.Fatalf("serve exited with %v, want status 1\n%s", err, stderr.String())
		}
		if !strings.Contains(stderr.String(), "listener failed") {
			t.Fatalf("no reason logged:\n%s", stderr.String())
		}
	case <-time.After(60 * time.Second):
		t.Fatalf("serve kept running on a failed listener\n%s", stderr.String())
	}
}

// serve's limit flags reach the server: --export-memory is ExportMemory,
// unset by default (half of --memory).
func TestLimitFlagsApply(t *testing.T) {
	for _, tc := range []struct {
		args         []string
		mem, perExpo int64
	}{
		{nil, nbdtarget.DefaultMemory, 0},
		{[]string{"--memory", "128M", "--export-memory", "40M"}, 128 << 20, 40 << 20},
	} {
		var f limitFlags
		fs := flag.NewFlagSet("serve", flag.ContinueOnError)
		f.register(fs)
		if err := fs.Parse(tc.args); err != nil {
			t.Fatal(err)
		}
		var s nbdtarget.Server
		f.apply(&s)
		if s.Memory != tc.mem || s.ExportMemory != tc.perExpo {
			t.Errorf("%v: Memory %d ExportMemory %d, want %d and %d", tc.args, s.Memory, s.ExportMemory, tc.mem, tc.perExpo)
		}
	}
}

// A snapshot-origin's copy-out holds a copy buffer (up to 256 KiB) while
// it reads the origin, which may hang: here the origin is a suspended
// device, so the copy-outs of small first writes wait there with their
// buffers. Every request held must have been charged what it holds to
// --memory, so that memory stays bounded however many clients write.
func TestCopyOutsChargedToMemory(t *testing.T) {
	dir := t.TempDir()
	sparse.Create(t, filepath.Join(dir, "base.img"), 4<<20)
	sparse.Create(t, filepath.Join(dir, "cow.img"), 4<<20)
	writeFile(t, filepath.Join(dir, "base.table"), "0 8192 linear base.img 0\n")
	writeFile(t, filepath.Join(dir, "orig.table"), "0 8192 snapshot-origin /dev/mapper/base\n")
	writeFile(t, filepath.Join(dir, "snap.table"), "0 8192 snapshot /dev/mapper/base cow.img N 8\n")
	ctl := filepath.Join(dir, "control")
	s := serve(t, dir, "--control", ctl, "base=base.table", "orig=orig.table", "snap=snap.table")
	lifecycle(t, ctl, "suspend", "base")
	c, err := nbdtest.Dial(s.Socket, "orig")
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	const writes = 8
	for i := range writes {
		c.Send(nbdtest.CmdWrite, 0, uint64(i), uint64(i)*64<<10, 512)
		c.Write(make([]byte, 512))
	}
	replies := make(chan error, 1)
	go func() {
		for range writes {
			r, err := c.Recv()
			if err == nil && r.Errno != 0 {
				err = nbdtest.ErrnoError(r.Errno)
			}
			if err != nil {
				replies <- err
				return
			}
		}
		replies <- nil
	}()
	heldRe := regexp.MustCompile(`Requests held: +(\d+)`)
	held := 0
	nbdtest.Until(t, "a copy-out to wait for the suspended origin", func() bool {
		m := heldRe.FindStringSubmatch(lifecycle(t, ctl, "info", "base"))
		held, _ = strconv.Atoi(m[1])
		return held > 0
	})
	charged := scrapeValue(t, s.metrics, "nbdmapper_request_memory_bytes")
	const copyBuffer = 256 << 10
	if charged < float64(held*copyBuffer) {
		t.Errorf("%d copy-outs hold a %d KiB buffer each, but requests are charged %.0f bytes in all", held, copyBuffer>>10, charged)
	}
	lifecycle(t, ctl, "resume", "base")
	if err := nbdtest.Recv(t, replies, "the writes' replies"); err != nil {
		t.Fatal(err)
	}
}

// The Go memory limit covers the tables the server holds now, not those
// it had at start-up: creating a device with a large table (131,072
// segments) raises it, so the new table is not counted against the
// request budget (a garbage collection after every few requests).
func TestMemoryLimitFollowsTables(t *testing.T) {
	dir := t.TempDir()
	sparse.Create(t, filepath.Join(dir, "d.img"), 1<<30)
	writeFile(t, filepath.Join(dir, "small.table"), "0 8 linear d.img 0\n")
	var big strings.Builder
	for i := range 1 << 17 {
		fmt.Fprintf(&big, "%d 8 linear d.img %d\n", i*8, (1<<17-1-i)*8)
	}
	writeFile(t, filepath.Join(dir, "big.table"), big.String())
	ctl := filepath.Join(dir, "control")
	s := nbdtest.Start(t, bin, dir, "--metrics", "off", "--control", ctl, "small=small.table")
	limitRe := regexp.MustCompile(`msg=memory .*limit=(\d+)`)
	limits := func() []int64 {
		var out []int64
		for _, m := range limitRe.FindAllStringSubmatch(s.Stderr(), -1) {
			n, _ := strconv.ParseInt(m[1], 10, 64)
			out = append(out, n)
		}
		return out
	}
	if len(limits()) != 1 {
		t.Fatalf("memory limits logged at start-up: %v\n%s", limits(), s.Stderr())
	}
	lifecycle(t, ctl, "create", "big", filepath.Join(dir, "big.table"))
	nbdtest.Until(t, "the memory limit to be set again", func() bool { return len(limits()) > 1 })
	l := limits()
	if grew := l[len(l)-1] - l[0]; grew < 8<<20 {
		t.Errorf("the memory limit grew %d bytes with a table of 131,072 segments: %v", grew, l)
	}
	s.Stop(t)
}
