//go:build ceph

package vmtest

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"testing"

	"github.com/nbdmapper/nbdmapper/internal/testing/cephtest"
	"github.com/nbdmapper/nbdmapper/internal/testing/nbdtest"
)

// TestGuestCeph mounts ext4 in the guest on /dev/nbd0 over a table of two
// Ceph RBD images striped: the cluster and nbdmapper (built with -tags
// ceph,pacific) run on the host, and the guest's nbd-client reaches the
// server through run.sh's -s port (guest/ceph.sh). Afterwards the host
// reads the filesystem back through the server, from the images: e2fsck
// finds it clean and the guest's file has the checksum the guest saw.
func TestGuestCeph(t *testing.T) {
	if testing.Short() {
		t.Skip("guest VM suite skipped in -short mode")
	}
	for _, tool := range []string{"bash", "socat", "nbdcopy", "e2fsck", "debugfs"} {
		nbdtest.Tool(t, tool)
	}
	dir := nbdtest.ShortDir(t)
	bin := filepath.Join(dir, "nbdmapper-ceph")
	if out, err := exec.Command("go", "build", "-tags", "ceph,pacific", "-o", bin, "../../../cmd/nbdmapper").CombinedOutput(); err != nil {
		t.Fatalf("go build -tags ceph,pacific: %v\n%s", err, out)
	}
	c := cephtest.Start(t)
	const size = 64 << 20
	a, b := c.CreateImage(t, "a", size), c.CreateImage(t, "b", size)
	table := fmt.Sprintf("0 %d striped 2 128 %s 0 %s 0\n", 2*size/512, a, b)
	if err := os.WriteFile(filepath.Join(dir, "d.table"), []byte(table), 0o644); err != nil {
		t.Fatal(err)
	}
	// The guest's nbd-client starts the handshake only once the guest has
	// booted, under TCG minutes after the port connects.
	s := nbdtest.Start(t, bin, dir, "--metrics", "off", "--control", "off", "--handshake-timeout", "30m", "d=d.table")

	out := t.TempDir()
	cmd := exec.Command("bash", "run.sh", "-o", out, "-s", s.Socket, "guest/ceph.sh")
	cmd.Stderr = os.Stderr
	console, err := cmd.Output()
	var ee *exec.ExitError
	if errors.As(err, &ee) && ee.ExitCode() == 77 {
		t.Skipf("QEMU cannot run here:\n%s", console)
	}
	t.Logf("guest console:\n%s", console)
	results, _ := parseConsole(console)
	if r, ok := results["ceph_ext4"]; !ok || r.status != "PASS" {
		t.Fatalf("guest: %v (run.sh: %v)\nconsole:\n%s\nserver:\n%s\ncluster:\n%s", r, err, console, s.Stderr(), c.Logs())
	}
	m := regexp.MustCompile(`VMTEST-SUM ([0-9a-f]{64})`).FindSubmatch(console)
	if m == nil {
		t.Fatalf("the guest printed no checksum:\n%s", console)
	}

	img := filepath.Join(dir, "back.img")
	if out, err := exec.Command("nbdcopy", s.URI("d"), img).CombinedOutput(); err != nil {
		t.Fatalf("nbdcopy: %v\n%s", err, out)
	}
	if out, err := exec.Command("e2fsck", "-fn", img).CombinedOutput(); err != nil {
		t.Errorf("e2fsck of the filesystem read back from the images: %v\n%s", err, out)
	}
	f, err := exec.Command("debugfs", "-R", "cat /f", img).Output()
	if err != nil {
		t.Fatalf("debugfs: %v", err)
	}
	if sum := sha256.Sum256(f); hex.EncodeToString(sum[:]) != string(m[1]) || len(f) != 5000000 {
		t.Errorf("the file read back from the images: %d bytes, sha256 %x; the guest wrote 5000000, %s", len(f), sum, m[1])
	}
}
