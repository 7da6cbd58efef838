package crash_test

import (
	"crypto/sha256"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/nbdmapper/nbdmapper/internal/testing/crash"
)

// kernelSamples is how many crash images of the snapshot workload the
// kernel reads in TestKernelReadsCrashImages.
const kernelSamples = 8

// TestKernelReadsCrashImages checks nbdmapper's recovery of the snapshot
// store against the kernel's: a sample of the crash images of the snapshot
// workload (every 70th with volatile writes persisted) goes to
// the vmtest guest, where dm-snapshot loads each COW image over its origin
// image (internal/testing/vmtest/guest/crashimages.sh); its status line and the bytes it
// reads must be nbdmapper's. It boots a VM (a minute or two under TCG).
func TestKernelReadsCrashImages(t *testing.T) {
	if testing.Short() {
		t.Skip("guest VM test skipped in -short mode")
	}
	if _, err := exec.LookPath("bash"); err != nil {
		t.Skip("no bash to run internal/testing/vmtest/run.sh")
	}
	var w workload
	var chunk string
	for _, x := range workloads() {
		if x.name == "snapshot" {
			w = x
			for _, d := range x.defs {
				if f := strings.Fields(d.text); d.name == "snap" {
					chunk = f[len(f)-1] // 0 N snapshot origin cow P <chunk>
				}
			}
		}
	}
	out := t.TempDir()
	seen, dumped := 0, 0
	runWorkloadDump(t, w, 0, func(im crash.Image, imgs map[string]string, views map[string]viewImage) error {
		if im.Persisted == 0 {
			return nil
		}
		if seen++; seen%70 != 0 || dumped == kernelSamples {
			return nil
		}
		dir := filepath.Join(out, "crashimg", fmt.Sprintf("%03d", dumped))
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return err
		}
		for _, k := range []string{"origin", "cow"} {
			b, err := os.ReadFile(imgs[k])
			if err != nil {
				return err
			}
			if err := os.WriteFile(filepath.Join(dir, k+".img"), b, 0o644); err != nil {
				return err
			}
		}
		snap := views["snap"]
		status, _, _ := strings.Cut(snap.status, "\n")
		expect := fmt.Sprintf("%x\n%s\n%s\n", sha256.Sum256(snap.data), status, chunk)
		dumped++
		return os.WriteFile(filepath.Join(dir, "expect"), []byte(expect), 0o644)
	})
	if dumped < kernelSamples/2 {
		t.Fatalf("only %d crash images sampled", dumped)
	}
	cmd := exec.Command("bash", "../vmtest/run.sh", "-o", out, "-d", "16", "../vmtest/guest/crashimages.sh")
	cmd.Stderr = os.Stderr
	console, err := cmd.Output()
	var ee *exec.ExitError
	if errors.As(err, &ee) && ee.ExitCode() == 77 {
		t.Skipf("SKIPPING: QEMU cannot run here:\n%s", console)
	}
	var lines []string
	pass := false
	for _, l := range strings.Split(string(console), "\n") {
		l = strings.TrimRight(l, "\r")
		if strings.HasPrefix(l, "crashimg ") {
			lines = append(lines, l)
		}
		if strings.HasPrefix(l, "VMTEST-RESULT kernel_crash_images PASS") {
			pass = true
		}
	}
	t.Logf("%d crash images, the kernel's reading of each:\n%s", dumped, strings.Join(lines, "\n"))
	if !pass || len(lines) != dumped {
		t.Fatalf("the kernel did not read the crash images as nbdmapper does (run.sh: %v):\n%s", err, console)
	}
}
