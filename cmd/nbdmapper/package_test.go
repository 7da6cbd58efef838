package main

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// buildPackage runs scripts/package.sh and unpacks the .deb it builds into
// a scratch root, as dpkg would install it. It returns the .deb and the
// root.
func buildPackage(t *testing.T) (deb, root string) {
	t.Helper()
	tool(t, "dpkg-deb", "dpkg")
	tool(t, "go-md2man", "go-md2man")
	dir := t.TempDir()
	out, err := exec.Command("../../scripts/package.sh", filepath.Join(dir, "dist")).Output()
	if err != nil {
		var stderr []byte
		if ee, ok := err.(*exec.ExitError); ok {
			stderr = ee.Stderr
		}
		t.Fatalf("scripts/package.sh: %v\n%s", err, stderr)
	}
	deb = strings.TrimSpace(string(out))
	root = filepath.Join(dir, "root")
	if b, err := exec.Command("dpkg-deb", "-x", deb, root).CombinedOutput(); err != nil {
		t.Fatalf("dpkg-deb -x: %v\n%s", err, b)
	}
	return deb, root
}

// TestPackage builds the Debian package and checks it as a user would
// meet it: lintian finds nothing beyond the documented overrides
// (scripts/debian/lintian-overrides), every file is where the package
// promises, the installed binary prints its version and checks the
// example table, the man pages render without warnings, and
// systemd-analyze verifies the installed units against the installed
// binary at /usr/sbin/nbdmapper.
func TestPackage(t *testing.T) {
	lintian := tool(t, "lintian", "lintian")
	deb, root := buildPackage(t)

	t.Run("lintian", func(t *testing.T) {
		cmd := exec.Command(lintian, "-I", "--fail-on", "error,warning,info", deb)
		var stdout, stderr bytes.Buffer
		cmd.Stdout, cmd.Stderr = &stdout, &stderr
		if err := cmd.Run(); err != nil || stdout.Len() != 0 {
			t.Fatalf("lintian: %v\n%s%s", err, stdout.String(), stderr.String())
		}
	})

	t.Run("files", func(t *testing.T) {
		for _, p := range []string{
			"usr/sbin/nbdmapper",
			"usr/lib/systemd/system/nbdmapper.service",
			"usr/lib/systemd/system/nbdmapper.socket",
			"usr/lib/systemd/system/nbdmapper-control.socket",
			"usr/lib/systemd/system/nbdmapper-metrics.socket",
			"usr/share/man/man8/nbdmapper.8.gz",
			"usr/share/man/man5/nbdmapper-table.5.gz",
			"usr/share/bash-completion/completions/nbdmapper",
			"usr/share/zsh/vendor-completions/_nbdmapper",
			"usr/share/doc/nbdmapper/examples/example.table",
			"usr/share/doc/nbdmapper/copyright",
			"etc/nbdmapper/tables",
		} {
			if _, err := os.Stat(filepath.Join(root, p)); err != nil {
				t.Errorf("package lacks /%s: %v", p, err)
			}
		}
		unit, err := os.ReadFile(filepath.Join(root, "usr/lib/systemd/system/nbdmapper.service"))
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Contains(unit, []byte("\nExecStart=/usr/sbin/nbdmapper serve --tables /etc/nbdmapper/tables ")) {
			t.Errorf("nbdmapper.service does not run /usr/sbin/nbdmapper on /etc/nbdmapper/tables:\n%s", unit)
		}
	})

	installed := filepath.Join(root, "usr/sbin/nbdmapper")
	t.Run("version", func(t *testing.T) {
		out, err := exec.Command(installed, "version").Output()
		if err != nil {
			t.Fatalf("installed nbdmapper version: %v", err)
		}
		if !strings.HasPrefix(string(out), "nbdmapper ") || !strings.Contains(string(out), "\ngo: go") {
			t.Fatalf("installed nbdmapper version printed\n%s", out)
		}
	})

	t.Run("check example", func(t *testing.T) {
		example := filepath.Join(root, "usr/share/doc/nbdmapper/examples/example.table")
		out, err := exec.Command(installed, "check", example).CombinedOutput()
		if err != nil || string(out) != "0 2097152 zero\n" {
			t.Fatalf("installed nbdmapper check example.table: %v\n%s", err, out)
		}
	})

	t.Run("man", func(t *testing.T) {
		man := tool(t, "man", "man-db")
		for _, page := range []string{"usr/share/man/man8/nbdmapper.8.gz", "usr/share/man/man5/nbdmapper-table.5.gz"} {
			cmd := exec.Command(man, "--warnings", "-E", "UTF-8", "-l", "-Tutf8", "-Z", filepath.Join(root, page))
			cmd.Env = append(os.Environ(), "LC_ALL=C.UTF-8", "MANWIDTH=80")
			var stderr bytes.Buffer
			cmd.Stderr = &stderr
			if err := cmd.Run(); err != nil || stderr.Len() != 0 {
				t.Errorf("man --warnings %s: %v\n%s", page, err, stderr.String())
			}
		}
	})

	// systemd-analyze verify fails on an ExecStart that does not exist,
	// so it runs in a mount namespace where the package's /usr/sbin is
	// the system's.
	t.Run("systemd-analyze verify", func(t *testing.T) {
		analyze := tool(t, "systemd-analyze", "systemd")
		unshare := tool(t, "unshare", "util-linux")
		units, err := filepath.Glob(filepath.Join(root, "usr/lib/systemd/system/*"))
		if err != nil || len(units) != 4 {
			t.Fatalf("units %v (%v)", units, err)
		}
		script := `mount --bind "$1/usr/sbin" /usr/sbin && shift && exec "$@"`
		args := append([]string{"-r", "-m", "sh", "-c", script, "sh", root, analyze, "verify", "--man=no"}, units...)
		out, err := exec.Command(unshare, args...).CombinedOutput()
		if err != nil || len(out) != 0 {
			t.Fatalf("systemd-analyze verify on the installed units: %v\n%s", err, out)
		}
	})
}
