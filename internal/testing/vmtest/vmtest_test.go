package vmtest

import (
	"bufio"
	"bytes"
	"errors"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
)

// guestTests are the names tests.sh reports, in order.
var guestTests = []string{"fs", "dm_linear", "flush", "discard", "nbd_client", "nbd_client_tls", "snapshot", "lifecycle", "live_snapshot", "remote", "snapshot_merge", "multi_snapshot"}

// result is one VMTEST-RESULT line.
type result struct{ status, detail string }

// parseConsole collects VMTEST-RESULT and VMTEST-METRIC lines.
func parseConsole(out []byte) (map[string]result, map[string]float64) {
	results := map[string]result{}
	metrics := map[string]float64{}
	sc := bufio.NewScanner(bytes.NewReader(out))
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := strings.TrimRight(sc.Text(), "\r")
		if rest, ok := strings.CutPrefix(line, "VMTEST-RESULT "); ok {
			f := strings.SplitN(rest, " ", 3)
			if len(f) >= 2 {
				r := result{status: f[1]}
				if len(f) == 3 {
					r.detail = f[2]
				}
				results[f[0]] = r
			}
		}
		if rest, ok := strings.CutPrefix(line, "VMTEST-METRIC "); ok {
			k, v, _ := strings.Cut(rest, "=")
			if x, err := strconv.ParseFloat(v, 64); err == nil {
				metrics[k] = x
			}
		}
	}
	return results, metrics
}

// TestGuest boots a guest and runs the kernel nbd suite (a few minutes
// under TCG). It skips only when QEMU cannot run at all.
func TestGuest(t *testing.T) {
	if testing.Short() {
		t.Skip("guest VM suite skipped in -short mode")
	}
	if _, err := exec.LookPath("bash"); err != nil {
		t.Skip("no bash to run internal/testing/vmtest/run.sh")
	}
	out := t.TempDir()
	cmd := exec.Command("bash", "run.sh", "-o", out, "guest/tests.sh")
	cmd.Stderr = os.Stderr // progress: downloads, build, boot
	console, err := cmd.Output()
	var ee *exec.ExitError
	if errors.As(err, &ee) && ee.ExitCode() == 77 {
		t.Skipf("SKIPPING the guest VM suite: QEMU cannot run here:\n%s", console)
	}
	t.Logf("guest console:\n%s", console)
	if err != nil && !errors.As(err, &ee) {
		t.Fatalf("run.sh: %v", err)
	}
	results, metrics := parseConsole(console)
	if len(results) == 0 {
		t.Fatalf("the guest reported no results (run.sh: %v)", err)
	}
	for _, name := range guestTests {
		t.Run(name, func(t *testing.T) {
			r, ok := results[name]
			switch {
			case !ok:
				t.Fatal("no VMTEST-RESULT line for this test")
			case r.status == "SKIP":
				t.Skip(r.detail)
			case r.status != "PASS":
				t.Fatalf("%s: %s", r.status, r.detail)
			}
		})
	}

	// The guest script asserts these too; checking the figures here keeps
	// a script that forgot to fail from passing silently.
	t.Run("flush-figures", func(t *testing.T) {
		nbd, disk := metrics["flush_nbdmapper_nbd_flushes"], metrics["flush_nbdmapper_disk_flushes"]
		if nbd < 100 || disk > nbd*1.1+4 {
			t.Errorf("nbdmapper: %v disk flushes for %v NBD flushes, want about one each", disk, nbd)
		}
		bnbd, bdisk := metrics["flush_baseline_nbd_flushes"], metrics["flush_baseline_disk_flushes"]
		if bnbd < 1 || bdisk < bnbd*512 {
			t.Errorf("per-segment baseline: %v disk flushes for %v NBD flushes, want ~1024 each", bdisk, bnbd)
		}
	})
	t.Run("merge-figures", func(t *testing.T) {
		// The status compared mid-merge was caught in the middle: less
		// than at the start (6616 sectors) and more than when done (16).
		if mid := metrics["snapshot_merge_nbdmapper_mid_sectors"]; mid <= 16 {
			t.Errorf("nbdmapper's merge status compared at %v allocated sectors: not mid-merge", mid)
		}
	})
	t.Run("discard-figures", func(t *testing.T) {
		trims, discards := metrics["discard_nbd_trims"], metrics["discard_disk_discards"]
		if trims < 1 || discards > 4*trims+4 {
			t.Errorf("%v disk discards for %v trims over 1024 segments, want them merged", discards, trims)
		}
	})
}

func TestParseConsole(t *testing.T) {
	tests := []struct {
		name    string
		in      string
		results map[string]result
		metrics map[string]float64
	}{
		{"empty", "", map[string]result{}, map[string]float64{}},
		{
			"mixed with kernel noise and CRLF",
			"[    3.1] nbd: loaded\r\nVMTEST-RESULT fs PASS 21.6s\r\nVMTEST-METRIC fs_files=25\r\n" +
				"VMTEST-RESULT snapshot SKIP SKIP: no snapshot target\nVMTEST-METRIC bad=x\n",
			map[string]result{"fs": {"PASS", "21.6s"}, "snapshot": {"SKIP", "SKIP: no snapshot target"}},
			map[string]float64{"fs_files": 25},
		},
		{"status without detail", "VMTEST-RESULT x FAIL\n", map[string]result{"x": {"FAIL", ""}}, map[string]float64{}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			r, m := parseConsole([]byte(tc.in))
			if len(r) != len(tc.results) || len(m) != len(tc.metrics) {
				t.Fatalf("got %v %v, want %v %v", r, m, tc.results, tc.metrics)
			}
			for k, v := range tc.results {
				if r[k] != v {
					t.Errorf("result %s = %v, want %v", k, r[k], v)
				}
			}
			for k, v := range tc.metrics {
				if m[k] != v {
					t.Errorf("metric %s = %v, want %v", k, m[k], v)
				}
			}
		})
	}
}

// TestBootWatchdog has the first boot hang where a real one once did,
// before /init printed anything, and checks that run.sh killed it and
// booted again to run the script.
func TestBootWatchdog(t *testing.T) {
	if testing.Short() {
		t.Skip("guest VM boots skipped in -short mode")
	}
	if _, err := exec.LookPath("bash"); err != nil {
		t.Skip("no bash to run internal/testing/vmtest/run.sh")
	}
	dir := t.TempDir()
	script := dir + "/hello.sh"
	if err := os.WriteFile(script, []byte("echo WATCHDOG-JOB-RAN\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	out := dir + "/out"
	cmd := exec.Command("bash", "run.sh", "-o", out, "-t", "600", script)
	cmd.Env = append(os.Environ(), "VMTEST_HANG_BOOTS=1", "VMTEST_BOOT_LIMIT=60")
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	console, err := cmd.Output()
	var ee *exec.ExitError
	if errors.As(err, &ee) && ee.ExitCode() == 77 {
		t.Skipf("SKIPPING the boot watchdog: QEMU cannot run here:\n%s", stderr.String())
	}
	if err != nil {
		t.Fatalf("run.sh: %v\nconsole:\n%s\nlog:\n%s", err, console, stderr.String())
	}
	if !strings.Contains(stderr.String(), "boot 1 of 3: no VMTEST-BOOTED") {
		t.Errorf("run.sh did not report the hung boot:\n%s", stderr.String())
	}
	hung, err := os.ReadFile(out + "/kernel.hung1.log")
	if err != nil {
		t.Fatalf("the hung boot's kernel log was not kept: %v", err)
	}
	// The hang stands for one after the kernel started init: its log
	// shows that much, and the console of the boot that ran shows the job.
	if !bytes.Contains(hung, []byte("Run /init")) {
		t.Errorf("the hung boot's kernel log does not reach init:\n%s", hung)
	}
	if !bytes.Contains(console, []byte("WATCHDOG-JOB-RAN")) || !bytes.Contains(console, []byte("VMTEST-EXIT 0")) {
		t.Errorf("the second boot did not run the script:\n%s", console)
	}
}
