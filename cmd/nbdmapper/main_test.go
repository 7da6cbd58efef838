package main

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/nbdmapper/nbdmapper/internal/testing/nbdtest"
	"github.com/nbdmapper/nbdmapper/internal/testing/sparse"
)

// The tests run the real binary, as users do.
var bin string

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "nbdmapper-cmd")
	if err != nil {
		panic(err)
	}
	if bin, err = nbdtest.Build(dir); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

func TestCheck(t *testing.T) {
	dir := t.TempDir()
	sparse.Create(t, filepath.Join(dir, "a.img"), 1<<20)
	sparse.Create(t, filepath.Join(dir, "b.img"), 1<<20)
	for _, tc := range []struct {
		name, table string
		want        string // stdout, or a regexp for stderr when wantErr
		wantErr     bool
	}{
		{
			name:  "normalises numbers and spacing, keeps device names",
			table: "# comment\n0  0100 linear a.img 08\n\n100\t28 zero   # tail\n128 256 striped 2 8 a.img 512 b.img 0\n",
			want:  "0 100 linear a.img 8\n100 28 zero\n128 256 striped 2 8 a.img 512 b.img 0\n",
		},
		{name: "gap names file and line", table: "0 8 zero\n16 8 zero\n", want: `^nbdmapper: .*t\.table:2: gap`, wantErr: true},
		{name: "beyond device", table: "0 4096 linear a.img 1\n", want: `^nbdmapper: .*t\.table:1: .*beyond the end`, wantErr: true},
		{name: "missing device", table: "0 8 zero\n8 8 linear nope.img 0\n", want: `^nbdmapper: .*t\.table:2: .*nope\.img`, wantErr: true},
		{name: "unknown target", table: "0 8 mirror a.img\n", want: `t\.table:1: unknown target`, wantErr: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			path := filepath.Join(dir, "t.table")
			if err := os.WriteFile(path, []byte(tc.table), 0o644); err != nil {
				t.Fatal(err)
			}
			cmd := exec.Command(bin, "check", "t.table")
			cmd.Dir = dir
			var stdout, stderr bytes.Buffer
			cmd.Stdout, cmd.Stderr = &stdout, &stderr
			err := cmd.Run()
			if tc.wantErr {
				var ee *exec.ExitError
				if !errors.As(err, &ee) || ee.ExitCode() != 1 {
					t.Fatalf("err %v, want exit status 1", err)
				}
				if !regexp.MustCompile(tc.want).MatchString(stderr.String()) {
					t.Fatalf("stderr %q does not match %q", stderr.String(), tc.want)
				}
				return
			}
			if err != nil {
				t.Fatalf("%v: %s", err, stderr.String())
			}
			if stdout.String() != tc.want {
				t.Fatalf("check printed\n%s\nwant\n%s", stdout.String(), tc.want)
			}
			// The normalised table parses back to itself.
			os.WriteFile(path, stdout.Bytes(), 0o644)
			again, err := cmd2(dir, "check", "t.table")
			if err != nil || again != tc.want {
				t.Fatalf("round trip: %v\n%s", err, again)
			}
		})
	}
}

func cmd2(dir string, args ...string) (string, error) {
	cmd := exec.Command(bin, args...)
	cmd.Dir = dir
	out, err := cmd.Output()
	return string(out), err
}

// server is a running `nbdmapper serve` with its metrics address.
type server struct {
	*nbdtest.Server
	metrics string
}

// serve starts the binary in dir on a unix socket and a free loopback
// metrics port, and waits until both accept connections.
func serve(t *testing.T, dir string, exports ...string) *server {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	metrics := l.Addr().String()
	l.Close()
	s := &server{nbdtest.Start(t, bin, dir, append([]string{"--metrics", metrics}, exports...)...), metrics}
	s.WaitListening(t, "tcp", metrics)
	return s
}

func TestServeDemo(t *testing.T) {
	nbdtest.Tool(t, "nbdinfo")
	nbdtest.Tool(t, "qemu-io")
	dir := t.TempDir()
	s := serve(t, dir) // no exports: the demo
	out, err := exec.Command("nbdinfo", s.URI("demo")).CombinedOutput()
	if err != nil {
		t.Fatalf("nbdinfo: %v\n%s", err, out)
	}
	for _, want := range []string{"export-size: 67108864", "can_flush: true", "can_trim: true"} {
		if !strings.Contains(string(out), want) {
			t.Errorf("nbdinfo output lacks %q:\n%s", want, out)
		}
	}
	// Segment 1 of the demo is the second MiB of the device, at offset 0 of disk1.img.
	qio := exec.Command("qemu-io", "-f", "raw", "-c", "write -P 0x5a 1M 4k", "-c", "flush", s.URI("demo"))
	if out, err := qio.CombinedOutput(); err != nil {
		t.Fatalf("qemu-io: %v\n%s", err, out)
	}
	s.Stop(t)
	disk1, err := os.ReadFile(filepath.Join(dir, "demo", "disk1.img"))
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(disk1[:4096], bytes.Repeat([]byte{0x5a}, 4096)) {
		t.Fatal("write to the demo's second segment did not land at offset 0 of disk1.img")
	}
	if !strings.Contains(s.Stdout(), "nbd-client") || !strings.Contains(s.Stdout(), "fio ") {
		t.Errorf("demo did not print how to connect:\n%s", s.Stdout())
	}
}

func TestServeStackedStatus(t *testing.T) {
	nbdtest.Tool(t, "qemu-io")
	dir := t.TempDir()
	sparse.Create(t, filepath.Join(dir, "origin.img"), 4<<20)
	sparse.Create(t, filepath.Join(dir, "cow.img"), 1<<20)
	os.WriteFile(filepath.Join(dir, "base.table"), []byte("0 8192 linear origin.img 0\n"), 0o644)
	os.WriteFile(filepath.Join(dir, "snap.table"), []byte("0 8192 snapshot /dev/mapper/base cow.img P 8\n"), 0o644)
	s := serve(t, dir, "base=base.table", "snap=snap.table")

	qio := exec.Command("qemu-io", "-f", "raw", "-c", "write -P 0x11 0 8k", "-c", "flush", s.URI("snap"))
	if out, err := qio.CombinedOutput(); err != nil {
		t.Fatalf("qemu-io: %v\n%s", err, out)
	}
	for _, tc := range []struct{ args, want string }{
		// Two 4 KiB chunks copied: next free chunk 2+2, times 8 sectors.
		{"status", "base: 0 8192 linear \nsnap: 0 8192 snapshot 32/2048 16\n"},
		{"status --table", "base: 0 8192 linear origin.img 0\nsnap: 0 8192 snapshot /dev/mapper/base cow.img P 8\n"},
	} {
		out, err := cmd2(dir, append(strings.Fields(tc.args), "--metrics", s.metrics)...)
		if err != nil || out != tc.want {
			t.Errorf("nbdmapper %s: %v\n%q\nwant\n%q", tc.args, err, out, tc.want)
		}
	}
	s.Stop(t)
	origin, _ := os.ReadFile(filepath.Join(dir, "origin.img"))
	if !bytes.Equal(origin[:8192], make([]byte, 8192)) {
		t.Fatal("a write to the snapshot reached the origin")
	}
}

func TestServeRejectsBadTable(t *testing.T) {
	dir := t.TempDir()
	os.WriteFile(filepath.Join(dir, "bad.table"), []byte("0 8 zero\n8 0 zero\n"), 0o644)
	cmd := exec.Command(bin, "serve", "--socket", filepath.Join(dir, "s"), "--metrics", "off", "bad=bad.table")
	cmd.Dir = dir
	out, err := cmd.CombinedOutput()
	var ee *exec.ExitError
	if !errors.As(err, &ee) || ee.ExitCode() != 1 {
		t.Fatalf("serve with a bad table: %v, want exit status 1\n%s", err, out)
	}
	last := lastLine(string(out))
	if !strings.HasPrefix(last, "nbdmapper: bad.table:2: zero length") {
		t.Fatalf("error %q does not name file, line and reason", last)
	}
	if _, err := os.Stat(filepath.Join(dir, "s")); err == nil {
		t.Fatal("server started listening despite the bad table")
	}
}

func lastLine(s string) string {
	var last string
	sc := bufio.NewScanner(strings.NewReader(s))
	for sc.Scan() {
		last = sc.Text()
	}
	return last
}

// --cpuprofile writes a whole-run Go CPU profile, finished at shutdown.
func TestServeCPUProfile(t *testing.T) {
	dir := t.TempDir()
	sparse.Create(t, filepath.Join(dir, "a.img"), 1<<20)
	os.WriteFile(filepath.Join(dir, "t.table"), []byte("0 2048 linear a.img 0\n"), 0o644)
	profile := filepath.Join(dir, "cpu.pprof")
	s := serve(t, dir, "--cpuprofile", profile, "t=t.table")
	s.Stop(t)
	b, err := os.ReadFile(profile)
	if err != nil {
		t.Fatal(err)
	}
	// A pprof profile is a gzipped protobuf.
	if len(b) < 2 || b[0] != 0x1f || b[1] != 0x8b {
		t.Fatalf("%s is not a gzipped profile (%d bytes)", profile, len(b))
	}
}

// TestServeDemoKeepsFiles runs the demo (serve with no tables) where
// ./demo already holds files: a larger disk0.img keeps its size and data,
// and a disk1.img that is a symlink is refused rather than followed, so
// the file it points to is left alone.
func TestServeDemoKeepsFiles(t *testing.T) {
	t.Run("larger file", func(t *testing.T) {
		dir := t.TempDir()
		if err := os.Mkdir(filepath.Join(dir, "demo"), 0o755); err != nil {
			t.Fatal(err)
		}
		disk := filepath.Join(dir, "demo", "disk0.img")
		sparse.Create(t, disk, 256<<20)
		f, err := os.OpenFile(disk, os.O_RDWR, 0)
		if err != nil {
			t.Fatal(err)
		}
		f.WriteAt([]byte("keep me"), 200<<20)
		f.Close()
		s := serve(t, dir)
		s.Stop(t)
		b, err := os.ReadFile(disk)
		if err != nil {
			t.Fatal(err)
		}
		if len(b) != 256<<20 || string(b[200<<20:200<<20+7]) != "keep me" {
			t.Fatalf("disk0.img is %d bytes now, data %q", len(b), b[min(len(b), 200<<20):min(len(b), 200<<20+7)])
		}
	})
	t.Run("symlink", func(t *testing.T) {
		dir := t.TempDir()
		if err := os.Mkdir(filepath.Join(dir, "demo"), 0o755); err != nil {
			t.Fatal(err)
		}
		victim := filepath.Join(dir, "victim")
		writeFile(t, victim, "precious")
		if err := os.Symlink(victim, filepath.Join(dir, "demo", "disk1.img")); err != nil {
			t.Fatal(err)
		}
		cmd := exec.Command(bin, "serve", "--metrics", "off", "--control", "off", "--socket", filepath.Join(dir, "s"))
		cmd.Dir = dir
		var out strings.Builder
		cmd.Stdout, cmd.Stderr = &out, &out
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		defer cmd.Process.Kill()
		exited := make(chan error, 1)
		go func() { exited <- cmd.Wait() }()
		err := nbdtest.Recv(t, exited, "serve to refuse the symlink")
		var ee *exec.ExitError
		if !errors.As(err, &ee) || ee.ExitCode() != 1 || !strings.Contains(out.String(), "disk1.img") {
			t.Fatalf("serve: %v, want exit status 1 naming disk1.img\n%s", err, out.String())
		}
		if b, err := os.ReadFile(victim); err != nil || string(b) != "precious" {
			t.Fatalf("the file the symlink points to: %q, %v", b, err)
		}
	})
}
