package main

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/nbdmapper/nbdmapper/internal/testing/nbdtest"
	"github.com/nbdmapper/nbdmapper/internal/testing/sparse"
)

func TestMergeLines(t *testing.T) {
	for _, tc := range []struct {
		name, status string
		pct          float64
		failed       string
		err          bool
	}{
		{name: "started", status: "0 16384 snapshot-merge 8216/16384 24\n", pct: 100 * (1 - 8192.0/16360)},
		{name: "done", status: "0 16384 snapshot-merge 24/16384 24\n", pct: 100},
		{name: "failed", status: "0 16384 snapshot-merge Merge failed\n", failed: "Merge failed"},
		{name: "invalid", status: "0 16384 snapshot-merge Invalid\n", failed: "Invalid"},
		{name: "beside other lines", status: "0 8 linear \n8 16384 snapshot-merge 40/16384 24\n16392 8 zero \n", pct: 100 * (1 - 16.0/16360)},
		{name: "garbled", status: "0 16384 snapshot-merge 8/x 24\n", err: true},
		{name: "allocated below metadata", status: "0 16384 snapshot-merge 8/16384 24\n", err: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ms, err := mergeLines(tc.status)
			if tc.err {
				if err == nil {
					t.Fatalf("no error for %q", tc.status)
				}
				return
			}
			if err != nil || len(ms) != 1 {
				t.Fatalf("%v, %d lines", err, len(ms))
			}
			if ms[0].failed != tc.failed {
				t.Fatalf("failed %q, want %q", ms[0].failed, tc.failed)
			}
			if got := mergedPercent(ms); tc.failed == "" && fmt.Sprintf("%.6f", got) != fmt.Sprintf("%.6f", tc.pct) {
				t.Fatalf("merged %.6f%%, want %.6f%%", got, tc.pct)
			}
		})
	}
	page := "a: 0 8 zero \nb: 0 16384 snapshot-merge 8216/16384 24\nb: failed x: y\n"
	want := "a: 0 8 zero \nb: 0 16384 snapshot-merge 8216/16384 24\nb: snapshot-merge 0: merged: 49.9%\nb: failed x: y\n"
	if got := mergePercentLines(page); got != want {
		t.Fatalf("mergePercentLines:\n%s\nwant\n%s", got, want)
	}
}

// mergingServer writes size bytes of random data through a persistent
// snapshot of origin.img, stops the server, and serves the snapshot's
// store again as a snapshot-merge of export lv, copying at most rate
// bytes per second: a merge that takes a few seconds.
func mergingServer(t *testing.T, size int64, rate string) (*server, string) {
	dir := nbdtest.ShortDir(t)
	sparse.Create(t, filepath.Join(dir, "origin.img"), 2*size)
	sparse.Create(t, filepath.Join(dir, "cow.img"), 2*size)
	sectors := 2 * size / 512
	writeFile(t, filepath.Join(dir, "snap.table"), fmt.Sprintf("0 %d snapshot origin.img cow.img P 8\n", sectors))
	writeFile(t, filepath.Join(dir, "merge.table"), fmt.Sprintf("0 %d snapshot-merge origin.img cow.img P 8\n", sectors))
	s := nbdtest.Start(t, bin, dir, "--metrics", "off", "--control", "off", "snap=snap.table")
	c, err := nbdtest.Dial(s.Socket, "snap")
	if err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 1<<20)
	r := rand.NewChaCha8([32]byte{7})
	for off := int64(0); off < size; off += int64(len(buf)) {
		r.Read(buf)
		if err := c.Pwrite(buf, off, false); err != nil {
			t.Fatal(err)
		}
	}
	if err := c.Flush(); err != nil {
		t.Fatal(err)
	}
	c.Close()
	s.Stop(t)
	ctl := filepath.Join(dir, "control")
	return serve(t, dir, "--control", ctl, "--merge-rate", rate, "lv=merge.table"), ctl
}

var mergedLine = regexp.MustCompile(`^lv: merged: (\d+\.\d)%$`)

// TestWaitFollowsMerge follows a real merge of 4 MiB at 1 MiB/s: status
// shows its percentage, and wait prints a line per interval, never going
// back, until 100.0%, then exits 0.
func TestWaitFollowsMerge(t *testing.T) {
	s, ctl := mergingServer(t, 4<<20, "1M")
	st, err := cmd2("", "status", "--metrics", s.metrics)
	if err != nil {
		t.Fatalf("status: %v", err)
	}
	if !regexp.MustCompile(`(?m)^lv: 0 \d+ snapshot-merge \d+/\d+ \d+\nlv: snapshot-merge 0: merged: \d+\.\d%$`).MatchString(st) {
		t.Fatalf("status has no merge percentage:\n%s", st)
	}
	out, err := cmd2("", "wait", "--control", ctl, "--interval", "100ms", "lv")
	if err != nil {
		t.Fatalf("wait: %v\n%s", err, out)
	}
	lines := strings.Split(strings.TrimSuffix(out, "\n"), "\n")
	last := -1.0
	for _, line := range lines {
		m := mergedLine.FindStringSubmatch(line)
		if m == nil {
			t.Fatalf("wait printed %q in\n%s", line, out)
		}
		pct, _ := strconv.ParseFloat(m[1], 64)
		if pct < last {
			t.Fatalf("merged went back from %.1f%% to %.1f%%:\n%s", last, pct, out)
		}
		last = pct
	}
	if last != 100 || len(lines) < 2 {
		t.Fatalf("wait ended at %.1f%% after %d lines:\n%s", last, len(lines), out)
	}
	t.Logf("%d lines, first %q", len(lines), lines[0])
	// Once done, wait says so at once.
	if out, err := cmd2("", "wait", "--control", ctl, "lv"); err != nil || out != "lv: merged: 100.0%\n" {
		t.Fatalf("wait after the merge: %v %q", err, out)
	}
}

// TestWaitTerminal runs wait on a pseudo-terminal (script(1)): it
// redraws one line with a bar, the rate and the time left.
func TestWaitTerminal(t *testing.T) {
	script := tool(t, "script", "bsdutils")
	_, ctl := mergingServer(t, 2<<20, "1M")
	cmd := exec.Command(script, "-qec", fmt.Sprintf("%s wait --interval 100ms --control %s lv", bin, ctl), "/dev/null")
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("wait on a terminal: %v\n%q", err, out)
	}
	s := string(out)
	if !strings.Contains(s, "\r\033[Klv: [") || !strings.Contains(s, "] 100.0%") || !strings.Contains(s, "/s  ") || !strings.Contains(s, " left") {
		t.Fatalf("wait on a terminal printed %q", s)
	}
}

// TestWaitErrors: wait exits 1 on a device with no merge, and names the
// control socket it could not reach.
func TestWaitErrors(t *testing.T) {
	dir := nbdtest.ShortDir(t)
	writeFile(t, filepath.Join(dir, "z.table"), "0 8 zero\n")
	ctl := filepath.Join(dir, "control")
	nbdtest.Start(t, bin, dir, "--metrics", "off", "--control", ctl, "z=z.table")
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--control", ctl, "z"}, "z has no snapshot-merge line"},
		{[]string{"--control", filepath.Join(dir, "nope"), "z"}, "is nbdmapper serve running with --control"},
		{[]string{"--control", ctl, "--interval", "0s", "z"}, "--interval 0s: must be positive"},
	} {
		cmd := exec.Command(bin, append([]string{"wait"}, tc.args...)...)
		out, err := cmd.CombinedOutput()
		var ee *exec.ExitError
		if !errors.As(err, &ee) || ee.ExitCode() != 1 || !strings.Contains(string(out), tc.want) {
			t.Errorf("wait %q: %v %q, want exit 1 and %q", tc.args, err, out, tc.want)
		}
	}
}
