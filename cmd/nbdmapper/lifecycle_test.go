package main

import (
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nbdmapper/nbdmapper/internal/nbdtest"
	"github.com/nbdmapper/nbdmapper/internal/sparse"
)

// lifecycle runs `nbdmapper OP ARGS... --control CTL` and returns its output.
func lifecycle(t *testing.T, ctl string, op string, args ...string) string {
	t.Helper()
	out, err := exec.Command(bin, append([]string{op, "--control", ctl}, args...)...).CombinedOutput()
	if err != nil {
		t.Fatalf("nbdmapper %s %s: %v\n%s", op, strings.Join(args, " "), err, out)
	}
	return string(out)
}

// TestLiveLifecycleUnderFio keeps fio's nbd engine writing and verifying
// (crc32c) through libnbd while the device's table changes under it, as
// dmsetup users change theirs: a reload that moves a segment to another
// file holding the same bytes, a suspend of 2 s, and a grow by appending
// a segment. Every fio run must end without an I/O error or a verify
// failure, and the suspend must have held requests rather than failed them.
func TestLiveLifecycleUnderFio(t *testing.T) {
	fio := nbdtest.Tool(t, "fio")
	dir := t.TempDir()
	for _, f := range []string{"a.img", "b.img", "a2.img", "c.img"} {
		sparse.Create(t, filepath.Join(dir, f), 4<<20)
	}
	writeFile(t, filepath.Join(dir, "t.table"), "0 8192 linear a.img 0\n8192 8192 linear b.img 0\n")
	writeFile(t, filepath.Join(dir, "moved.table"), "0 8192 linear a2.img 0\n8192 8192 linear b.img 0\n")
	writeFile(t, filepath.Join(dir, "grown.table"), "0 8192 linear a2.img 0\n8192 8192 linear b.img 0\n16384 8192 linear c.img 0\n")
	ctl := filepath.Join(dir, "control")
	s := nbdtest.Start(t, bin, dir, "--metrics", "off", "--control", ctl, "t=t.table")
	if out := lifecycle(t, ctl, "ls"); !strings.HasPrefix(out, "t\t(8388608 bytes)") {
		t.Fatalf("ls: %q", out)
	}

	var stop atomic.Bool
	runs := make(chan error, 1)
	var count int
	go func() {
		for !stop.Load() {
			out, err := exec.Command(fio, "--name=verify", "--ioengine=nbd", "--uri="+s.URI("t"),
				"--rw=randwrite", "--bs=4k", "--size=8m", "--iodepth=16", "--verify=crc32c",
				"--verify_fatal=1", "--verify_backlog=128", "--randrepeat=0").CombinedOutput()
			count++
			if err != nil || !regexp.MustCompile(`err= 0`).Match(out) {
				runs <- fmt.Errorf("fio run %d: %v\n%s", count, err, out)
				return
			}
		}
		runs <- nil
	}()
	fioFailed := func() {
		t.Helper()
		select {
		case err := <-runs:
			if err != nil {
				t.Fatal(err)
			}
			t.Fatal("fio stopped early")
		default:
		}
	}

	// Move the first segment to a2.img: load the table, suspend (drains
	// and flushes), copy the bytes while nothing writes, resume.
	time.Sleep(200 * time.Millisecond) // let fio get going
	lifecycle(t, ctl, "reload", "t", filepath.Join(dir, "moved.table"))
	if out := lifecycle(t, ctl, "info", "t"); !strings.Contains(out, "LIVE & INACTIVE") {
		t.Fatalf("info after reload:\n%s", out)
	}
	lifecycle(t, ctl, "suspend", "t")
	copyFile(t, filepath.Join(dir, "a.img"), filepath.Join(dir, "a2.img"))
	lifecycle(t, ctl, "resume", "t")
	if out := lifecycle(t, ctl, "table", "t"); !strings.Contains(out, "a2.img") {
		t.Fatalf("table after resume: %q", out)
	}
	fioFailed()

	// Suspend for 2 s: requests wait, none fails.
	lifecycle(t, ctl, "suspend", "t")
	time.Sleep(2 * time.Second)
	lifecycle(t, ctl, "resume", "t")
	info := lifecycle(t, ctl, "info", "t")
	if m := regexp.MustCompile(`Requests held: +(\d+)`).FindStringSubmatch(info); m == nil || m[1] == "0" {
		t.Fatalf("the suspend held no request:\n%s", info)
	}
	fioFailed()

	// Grow by appending a segment; new connections see the new size.
	lifecycle(t, ctl, "reload", "t", filepath.Join(dir, "grown.table"))
	lifecycle(t, ctl, "resume", "t")
	out, err := exec.Command(nbdtest.Tool(t, "nbdinfo"), "--size", s.URI("t")).CombinedOutput()
	if err != nil || strings.TrimSpace(string(out)) != "12582912" {
		t.Fatalf("size after growing: %v %s", err, out)
	}

	stop.Store(true)
	select {
	case err := <-runs:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(5 * time.Minute):
		t.Fatal("fio never finished")
	}
	t.Logf("%d fio runs with verification, 0 errors\n%s", count, lifecycle(t, ctl, "info", "t"))
	s.Stop(t)
}

func copyFile(t *testing.T, from, to string) {
	t.Helper()
	src, err := os.Open(from)
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	dst, err := os.OpenFile(to, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer dst.Close()
	if _, err := io.Copy(dst, src); err != nil {
		t.Fatal(err)
	}
}
