package main

import (
	"bytes"
	"crypto/rand"
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nbdmapper/nbdmapper/internal/nbdtest"
	"github.com/nbdmapper/nbdmapper/internal/sparse"
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
	cmd := exec.Command("sh", "-c", `ulimit -n 32 && exec "$0" serve --socket nbd.sock --metrics off --handshake-timeout 1h t=t.table`, bin)
	cmd.Dir = dir
	var stderr nbdtest.SyncBuffer
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	t.Cleanup(func() { cmd.Process.Kill(); <-exited })
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
