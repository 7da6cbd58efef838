package main

import (
	"bytes"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/nbdmapper/nbdmapper/internal/testing/nbdtest"
)

const (
	unitDir        = "../../deploy/systemd"
	unitBinary     = "/usr/local/bin/nbdmapper"
	systemdDocFile = "../../docs/systemd.md"
)

var unitFiles = []string{"nbdmapper.service", "nbdmapper.socket", "nbdmapper-metrics.socket", "nbdmapper-control.socket"}

// installUnits copies the unit files into a temporary directory with
// ExecStart pointing at the binary built for the tests, because
// systemd-analyze verify fails on a command that does not exist, and
// returns the copies' paths.
func installUnits(t *testing.T) []string {
	t.Helper()
	dir := t.TempDir()
	var paths []string
	for _, name := range unitFiles {
		b, err := os.ReadFile(filepath.Join(unitDir, name))
		if err != nil {
			t.Fatal(err)
		}
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, bytes.ReplaceAll(b, []byte(unitBinary), []byte(bin)), 0o644); err != nil {
			t.Fatal(err)
		}
		paths = append(paths, p)
	}
	return paths
}

// TestUnitsVerify runs systemd-analyze verify on deploy/systemd, which
// checks every directive and the units' references to each other.
func TestUnitsVerify(t *testing.T) {
	analyze := nbdtest.Tool(t, "systemd-analyze")
	out, err := exec.Command(analyze, append([]string{"verify", "--man=no"}, installUnits(t)...)...).CombinedOutput()
	if err != nil || len(out) != 0 {
		t.Fatalf("systemd-analyze verify: %v\n%s", err, out)
	}
}

// TestUnitsSecurity scores the service with systemd-analyze security and
// requires docs/systemd.md to state that score.
func TestUnitsSecurity(t *testing.T) {
	analyze := nbdtest.Tool(t, "systemd-analyze")
	service := installUnits(t)[0]
	out, err := exec.Command(analyze, "security", "--offline=yes", "--no-pager", service).CombinedOutput()
	if err != nil {
		t.Fatalf("systemd-analyze security: %v\n%s", err, out)
	}
	m := regexp.MustCompile(`Overall exposure level for nbdmapper\.service: (\d+\.\d) (\w+)`).FindSubmatch(out)
	if m == nil {
		t.Fatalf("no overall exposure level in\n%s", out)
	}
	score, verdict := string(m[1]), string(m[2])
	t.Logf("exposure %s %s", score, verdict)
	if verdict != "SAFE" {
		t.Errorf("exposure %s %s, want SAFE\n%s", score, verdict, out)
	}
	doc, err := os.ReadFile(systemdDocFile)
	if err != nil {
		t.Fatal(err)
	}
	if want := "exposure level " + score + " " + verdict; !strings.Contains(string(doc), want) {
		t.Errorf("%s does not record %q", systemdDocFile, want)
	}
}

// TestUnitsExecStart runs the service's command line (with a tables
// directory that does not exist), so a flag the binary does not know fails
// here rather than at boot.
func TestUnitsExecStart(t *testing.T) {
	b, err := os.ReadFile(filepath.Join(unitDir, "nbdmapper.service"))
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`(?m)^ExecStart=(\S+) (.*)$`).FindSubmatch(b)
	if m == nil || string(m[1]) != unitBinary {
		t.Fatalf("no ExecStart=%s ... in nbdmapper.service", unitBinary)
	}
	args := strings.Fields(string(m[2]))
	missing := filepath.Join(t.TempDir(), "no-tables")
	for i, a := range args {
		if a == "/etc/nbdmapper/tables" {
			args[i] = missing
		}
	}
	out, err := exec.Command(bin, args...).CombinedOutput()
	var ee *exec.ExitError
	if !errors.As(err, &ee) || ee.ExitCode() != 1 || !strings.Contains(string(out), "--tables: open "+missing) {
		t.Fatalf("%s %s: %v, want exit 1 on the missing tables directory\n%s", bin, strings.Join(args, " "), err, out)
	}
}
