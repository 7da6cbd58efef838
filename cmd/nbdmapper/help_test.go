package main

import (
	"bytes"
	"errors"
	"os"

	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// TestVersion builds the binary with VCS stamping as scripts/package.sh
// does and checks that version and --version print the checkout's
// revision, whether it has changes, and the toolchain's Go version. The
// go command stamps only a checkout whose .git is a directory (not a
// source tarball, nor a git worktree, whose .git is a file): there the
// output must have no revision.
func TestVersion(t *testing.T) {
	vbin := filepath.Join(t.TempDir(), "nbdmapper")
	if out, err := exec.Command("go", "build", "-buildvcs=auto", "-o", vbin, ".").CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	goVersion, err := exec.Command("go", "env", "GOVERSION").Output()
	if err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command(vbin, "version").Output()
	if err != nil {
		t.Fatalf("version: %v", err)
	}
	if dashed, err := exec.Command(vbin, "--version").Output(); err != nil || !bytes.Equal(dashed, out) {
		t.Fatalf("--version printed %q (%v), version %q", dashed, err, out)
	}
	lines := strings.Split(strings.TrimSuffix(string(out), "\n"), "\n")
	if !strings.HasPrefix(lines[0], "nbdmapper ") || len(lines[0]) <= len("nbdmapper ") {
		t.Errorf("first line %q, want nbdmapper VERSION", lines[0])
	}
	want := "go: " + strings.TrimSpace(string(goVersion))
	if !slices.Contains(lines, want) {
		t.Errorf("no %q in\n%s", want, out)
	}
	if fi, err := os.Stat("../../.git"); err != nil || !fi.IsDir() {
		if strings.Contains(string(out), "revision:") {
			t.Errorf("a revision without a .git directory:\n%s", out)
		}
		return
	}
	head, err := exec.Command("git", "rev-parse", "HEAD").Output()
	if err != nil {
		t.Fatal(err)
	}
	if want := "revision: " + strings.TrimSpace(string(head)); !slices.Contains(lines, want) {
		t.Errorf("no %q in\n%s", want, out)
	}
	porcelain, err := exec.Command("git", "status", "--porcelain").Output()
	if err != nil {
		t.Fatal(err)
	}
	if want := "modified: " + map[bool]string{true: "true", false: "false"}[len(porcelain) > 0]; !slices.Contains(lines, want) {
		t.Errorf("no %q in\n%s", want, out)
	}
}

// TestVerbHelp asks every verb for --help: each prints its usage line,
// an example of itself and its flags on stdout, and exits 0.
func TestVerbHelp(t *testing.T) {
	var names []string
	for name := range commands {
		names = append(names, name)
		if _, ok := lookupHelp(name); !ok {
			t.Errorf("verb %s has no help", name)
		}
	}
	for _, h := range verbHelps {
		if _, ok := commands[h.name]; !ok {
			t.Errorf("help for %s, which is no verb", h.name)
		}
	}
	slices.Sort(names)
	for _, name := range names {
		t.Run(name, func(t *testing.T) {
			for _, args := range [][]string{{name, "--help"}, {name, "-h"}, {"help", name}} {
				cmd := exec.Command(bin, args...)
				var stdout, stderr bytes.Buffer
				cmd.Stdout, cmd.Stderr = &stdout, &stderr
				if err := cmd.Run(); err != nil {
					t.Fatalf("%s: %v\n%s", args, err, stderr.String())
				}
				out := stdout.String()
				if !strings.HasPrefix(out, "usage: nbdmapper "+name) || !strings.Contains(out, "\nexample:\n  nbdmapper "+name) {
					t.Errorf("%s printed\n%s", args, out)
				}
			}
		})
	}
	out, err := exec.Command(bin, "--help").Output()
	if err != nil || !strings.HasPrefix(string(out), "usage:\n  nbdmapper serve") {
		t.Errorf("--help: %v\n%s", err, out)
	}
}

// TestUnknownVerb: a mistyped verb exits 2 naming the nearest verb; one
// far from all verbs names none.
func TestUnknownVerb(t *testing.T) {
	for _, tc := range []struct{ typed, want string }{
		{"stauts", `unknown verb "stauts"; did you mean "status"?`},
		{"tabel", `did you mean "table"?`},
		{"remvoe", `did you mean "remove"?`},
		{"reloda", `did you mean "reload"?`},
		{"serv", `did you mean "serve"?`},
		{"atach", `did you mean "attach"?`},
		{"vers", `did you mean "version"?`},
		{"frobnicate", `unknown verb "frobnicate" (nbdmapper help lists the verbs)`},
	} {
		t.Run(tc.typed, func(t *testing.T) {
			cmd := exec.Command(bin, tc.typed, "x")
			var stderr bytes.Buffer
			cmd.Stderr = &stderr
			err := cmd.Run()
			var ee *exec.ExitError
			if !errors.As(err, &ee) || ee.ExitCode() != 2 {
				t.Fatalf("%v, want exit status 2", err)
			}
			if !strings.Contains(stderr.String(), tc.want) {
				t.Errorf("stderr %q, want %q", stderr.String(), tc.want)
			}
		})
	}
}
