package vmtest

import (
	"bufio"
	"errors"
	"flag"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
)

var powerCuts = flag.Int("powercut.cuts", 3, "power cuts TestPowerCut makes (bench/powercut.sh: 50)")

// TestPowerCut cuts the power of a guest that writes through nbdmapper
// and the kernel's nbd driver (guest/powercut.sh), boots it again on the
// same disk image and checks that every record and fsync'd ext4 file
// acknowledged before the cut is there, and that e2fsck finds the
// filesystem clean. The cut is a SIGKILL of QEMU after a random number of
// acknowledgements. Each verifying boot then writes again and is cut in
// turn, so N cuts take N+1 boots. Set NBDMAPPER_BIN to test another build
// (docs/crash.md runs the nbdmapper_broken_flush one).
func TestPowerCut(t *testing.T) {
	if testing.Short() {
		t.Skip("guest VM power cuts skipped in -short mode")
	}
	if _, err := exec.LookPath("bash"); err != nil {
		t.Skip("no bash to run internal/testing/vmtest/run.sh")
	}
	seed := rand.Uint64()
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewPCG(seed, 11))
	out := t.TempDir()
	var sum struct{ rawAcked, rawLost, fsAcked, fsLost, fsckFails, failed int }
	var verify []string
	for boot := 0; boot <= *powerCuts; boot++ {
		args := verify
		acks := 0
		if boot < *powerCuts {
			args = append(args, "write", strconv.Itoa(boot))
			acks = 8 + rng.IntN(40)
		}
		b := runBoot(t, out, boot > 0, acks, args)
		if boot > 0 {
			name := fmt.Sprintf("cut%d", boot-1)
			results, m := parseConsole([]byte(b.console))
			ok := t.Run(name, func(t *testing.T) {
				for _, name := range []string{"powercut_raw", "powercut_fs"} {
					r, ok := results[name]
					switch {
					case !ok:
						t.Errorf("%s: no result:\n%s", name, b.console)
					case r.status != "PASS":
						t.Errorf("%s: %s %s", name, r.status, r.detail)
					default:
						t.Logf("%s: %s", name, r.detail)
					}
				}
			})
			if !ok {
				sum.failed++
			}
			sum.rawAcked += int(m["powercut_raw_acked"])
			sum.rawLost += int(m["powercut_raw_lost"])
			sum.fsAcked += int(m["powercut_fs_acked"])
			sum.fsLost += int(m["powercut_fs_lost"])
			if m["powercut_fs_fsck_rc"] != 0 {
				sum.fsckFails++
			}
		}
		if boot < *powerCuts {
			t.Logf("boot %d: cut after %d acknowledgements: raw records 0..%d, ext4 files f0..f%d",
				boot, acks, b.last["raw"], b.last["fs"])
			verify = []string{"verify", strconv.Itoa(boot), strconv.Itoa(b.last["raw"]), strconv.Itoa(b.last["fs"])}
		}
	}
	t.Logf("%d power cuts, %d failed: raw records acknowledged %d, lost %d; ext4 files fsync'd %d, lost %d; e2fsck not clean %d times",
		*powerCuts, sum.failed, sum.rawAcked, sum.rawLost, sum.fsAcked, sum.fsLost, sum.fsckFails)
}

// boot is what one guest boot printed.
type boot struct {
	console string
	last    map[string]int // the last acknowledged seq of each writer
	killed  bool
}

// runBoot boots the guest on OUTDIR's disk image (a fresh one unless
// keep) with powercut.sh ARGS, and SIGKILLs QEMU once the writers have
// printed acks acknowledgements (never, for acks 0).
func runBoot(t *testing.T, out string, keep bool, acks int, args []string) boot {
	runArgs := []string{"run.sh", "-o", out, "-t", "900"}
	if keep {
		runArgs = append(runArgs, "-k")
	}
	cmd := exec.Command("bash", append(append(runArgs, "guest/powercut.sh"), args...)...)
	cmd.Stderr = os.Stderr
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	b := boot{last: map[string]int{"raw": -1, "fs": -1}}
	var console strings.Builder
	seen := 0
	sc := bufio.NewScanner(stdout)
	for sc.Scan() {
		line := strings.TrimRight(sc.Text(), "\r")
		console.WriteString(line + "\n")
		f := strings.Fields(line)
		if len(f) != 3 || f[0] != "POWERCUT-ACK" || b.killed || acks == 0 {
			continue
		}
		n, err := strconv.Atoi(f[2])
		if err != nil {
			continue
		}
		// The line was printed after the data was synced: it counts.
		// The cut waits for the slower ext4 writer's first file too.
		b.last[f[1]] = n
		if seen++; seen >= acks && b.last["fs"] >= 0 {
			if err := killQEMU(out); err != nil {
				t.Errorf("power cut: %v", err)
			}
			b.killed = true
		}
	}
	io.Copy(io.Discard, stdout)
	err = cmd.Wait()
	b.console = console.String()
	var ee *exec.ExitError
	if errors.As(err, &ee) && ee.ExitCode() == 77 {
		t.Skipf("SKIPPING power cuts: QEMU cannot run here:\n%s", b.console)
	}
	if err != nil && !errors.As(err, &ee) {
		t.Fatalf("run.sh: %v", err)
	}
	if acks > 0 && !b.killed {
		t.Fatalf("the guest ended (%v) after %d of %d acknowledgements, before the cut:\n%s", err, seen, acks, b.console)
	}
	return b
}

// killQEMU cuts the power: SIGKILL to the QEMU run.sh started, whose pid
// QEMU wrote to OUTDIR/qemu.pid.
func killQEMU(out string) error {
	b, err := os.ReadFile(filepath.Join(out, "qemu.pid"))
	if err != nil {
		return err
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil {
		return fmt.Errorf("qemu.pid: %w", err)
	}
	return syscall.Kill(pid, syscall.SIGKILL)
}
