package main

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"

	"github.com/nbdmapper/nbdmapper/internal/testing/nbdtest"
	"github.com/nbdmapper/nbdmapper/internal/testing/sparse"
)

// TestServeRemote serves tables over two nbdkit remotes (unix sockets)
// with the real binary: bytes land where the tables say on the remotes'
// files, one client flush is one NBD flush per written remote, status
// shows each remote under each export, and check validates URIs with and
// without connecting.
func TestServeRemote(t *testing.T) {
	dir := nbdtest.ShortDir(t)
	const size = 8 << 20
	var files []string
	var peers []*nbdtest.Peer
	for i := range 2 {
		f := sparse.Create(t, filepath.Join(dir, fmt.Sprintf("r%d.img", i)), size)
		files = append(files, f)
		peers = append(peers, nbdtest.StartNbdkit(t, dir, fmt.Sprintf("r%d", i), nbdtest.PeerOptions{}, "file", f))
	}
	u0, u1 := peers[0].URI(""), peers[1].URI("")
	// "lin": the first 4 MiB of r0 then of r1; "str": the second 4 MiB of
	// both, striped in 64 KiB chunks; "lin" names r0 in another spelling.
	u0b := strings.Replace(u0, "nbd+unix", "NBD+UNIX", 1)
	writeFile(t, filepath.Join(dir, "lin.table"), fmt.Sprintf("0 8192 linear %s 0\n8192 8192 linear %s 0\n", u0b, u1))
	writeFile(t, filepath.Join(dir, "str.table"), fmt.Sprintf("0 16384 striped 2 128 %s 8192 %s 8192\n", u0, u1))

	out, err := cmd2(dir, "check", "str.table")
	if err != nil || out != fmt.Sprintf("0 16384 striped 2 128 %s 8192 %s 8192\n", u0, u1) {
		t.Fatalf("check: %v\n%s", err, out)
	}
	if out, err := cmd2(dir, "check", "--connect", "str.table"); err != nil {
		t.Fatalf("check --connect: %v\n%s", err, out)
	}

	before := []int{peers[0].Connects(), peers[1].Connects()}
	s := serve(t, dir, "lin=lin.table", "str=str.table")
	script := `
import hashlib
a = bytes(range(256)) * 16384        # 4 MiB
b = bytes(reversed(range(256))) * 16384
h.pwrite(a, 0)
h.pwrite(b, 4 << 20)
h.flush()
`
	nbdsh(t, s.URI("lin"), script)
	nbdsh(t, s.URI("str"), "h.pwrite(bytes([7]) * (64 << 10) + bytes([9]) * (64 << 10), 0)\nh.flush()")
	a := bytes.Repeat(seq(false), 16384)
	b := bytes.Repeat(seq(true), 16384)
	mustFile(t, files[0], 0, a)
	mustFile(t, files[1], 0, b)
	mustFile(t, files[0], 4<<20, bytes.Repeat([]byte{7}, 64<<10)) // chunk 0 on r0
	mustFile(t, files[1], 4<<20, bytes.Repeat([]byte{9}, 64<<10)) // chunk 1 on r1
	for i, p := range peers {
		if n := p.Count("Flush"); n != 2 {
			t.Errorf("remote %d: %d NBD flushes for its two exports' one flush each, want 2", i, n)
		}
		if n := p.Connects() - before[i]; n != 4 {
			t.Errorf("remote %d: %d connections, want 4 (one device, however many lines and spellings)", i, n)
		}
	}

	status, err := cmd2(dir, "status", "--metrics", s.metrics)
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{
		`(?m)^lin: remote ` + regexp.QuoteMeta(u0b) + `: up connections 4/4 reconnects 0 retries 0 timeouts 0 rtt \S+ in flight 0 unflushed 0$`,
		`(?m)^lin: remote ` + regexp.QuoteMeta(u1) + `: up connections 4/4 `,
		`(?m)^str: remote ` + regexp.QuoteMeta(u0b) + `: up `,
		`(?m)^str: remote ` + regexp.QuoteMeta(u1) + `: up `,
	} {
		if !regexp.MustCompile(want).MatchString(status) {
			t.Errorf("status lacks %s:\n%s", want, status)
		}
	}

	// A remote that dies is retried, then EIO; the server stays up, and
	// status says where the writes went.
	peers[1].Kill()
	nbdtest.Until(t, "status to show r1 down", func() bool {
		out, _ := cmd2(dir, "status", "--metrics", s.metrics)
		return strings.Contains(out, "remote "+u1+": down")
	})
	peers[1].Start()
	nbdsh(t, s.URI("lin"), "h.pwrite(b'x' * 4096, 4 << 20)") // on r1, after its reconnection
	s.Stop(t)

	// check: a malformed URI names file and line; --connect checks sizes.
	writeFile(t, filepath.Join(dir, "bad.table"), "0 8 zero\n8 8 linear nbd+unix:///e 0\n")
	checkFails(t, dir, []string{"check", "bad.table"}, `bad\.table:2: .*no socket=PATH`)
	writeFile(t, filepath.Join(dir, "big.table"), fmt.Sprintf("0 16385 linear %s 8192\n", u0))
	if _, err := cmd2(dir, "check", "big.table"); err != nil {
		t.Fatalf("check without --connect cannot know the size, so must pass: %v", err)
	}
	checkFails(t, dir, []string{"check", "--connect", "big.table"}, `big\.table:1: .*beyond the end`)
	peers[0].Kill()
	checkFails(t, dir, []string{"check", "--connect", "str.table"}, `str\.table:1: .*`+regexp.QuoteMeta(u0)+`.*connect`)
}

func seq(rev bool) []byte {
	b := make([]byte, 256)
	for i := range b {
		b[i] = byte(i)
		if rev {
			b[i] = byte(255 - i)
		}
	}
	return b
}

func mustFile(t *testing.T, path string, off int64, want []byte) {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	got := make([]byte, len(want))
	if _, err := f.ReadAt(got, off); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		t.Fatalf("%s at %d: the bytes are not where the table puts them", path, off)
	}
}

func nbdsh(t *testing.T, uri, script string) {
	t.Helper()
	out, err := nbdtest.Nbdsh(t, "-u", uri, "-c", script).CombinedOutput()
	if err != nil {
		t.Fatalf("nbdsh: %v\n%s", err, out)
	}
}

func checkFails(t *testing.T, dir string, args []string, want string) {
	t.Helper()
	cmd := exec.Command(bin, args...)
	cmd.Dir = dir
	out, err := cmd.CombinedOutput()
	var ee *exec.ExitError
	if !errors.As(err, &ee) || ee.ExitCode() != 1 {
		t.Fatalf("%v: %v, want exit status 1\n%s", args, err, out)
	}
	if !regexp.MustCompile(want).Match(out) {
		t.Fatalf("%v printed %q, want %q", args, out, want)
	}
}

// At SIGTERM every device is synced at once, and a sync that does not
// return within --shutdown-timeout makes serve exit 1 naming the device,
// instead of waiting for it for good (systemd would kill it then, and say
// nothing of which device): here a remote that stopped answering, which
// holds acknowledged writes, beside a local file, which is synced.
func TestShutdownBoundsHungSync(t *testing.T) {
	dir := nbdtest.ShortDir(t)
	local := sparse.Create(t, filepath.Join(dir, "l.img"), 4<<20)
	peer := nbdtest.StartNbdkit(t, dir, "r", nbdtest.PeerOptions{}, "file", sparse.Create(t, filepath.Join(dir, "r.img"), 4<<20))
	writeFile(t, filepath.Join(dir, "t.table"), fmt.Sprintf("0 8192 linear %s 0\n8192 8192 linear %s 0\n", local, peer.URI("")))
	s := nbdtest.Start(t, bin, dir, "--metrics", "off", "--control", "off", "--remote-timeout", "1h", "--shutdown-timeout", "1s", "t=t.table")
	nbdsh(t, s.URI("t"), "h.pwrite(b'l' * 4096, 0)\nh.pwrite(b'r' * 4096, 4 << 20)")
	peer.Pause()
	s.Signal(syscall.SIGTERM)
	exited := make(chan error, 1)
	go func() { exited <- s.Wait() }()
	err := nbdtest.Recv(t, exited, "serve to exit after SIGTERM")
	var exit *exec.ExitError
	if !errors.As(err, &exit) || exit.ExitCode() != 1 {
		t.Fatalf("serve after SIGTERM with a remote that does not answer: %v, want exit status 1\n%s", err, s.Stderr())
	}
	logs := s.Stderr()
	if !strings.Contains(logs, "syncs of "+peer.URI("")+" not returned") {
		t.Errorf("the exit does not name the remote whose sync did not return:\n%s", logs)
	}
	if !regexp.MustCompile(`msg="flush device" device=` + regexp.QuoteMeta(local) + ` requested=\d+ syncs=1 .* dirty=false`).MatchString(logs) {
		t.Errorf("the local file was not synced beside the hung remote:\n%s", logs)
	}
}
