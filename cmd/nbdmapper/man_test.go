package main

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
)

const manDir = "../../docs/man"

// tool returns the path of a program a test runs. Missing, it fails the
// test under CI (scripts/test.sh installs the Debian package named) and
// skips it elsewhere.
func tool(t *testing.T, name, pkg string) string {
	t.Helper()
	p, err := exec.LookPath(name)
	if err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("%s not installed (Debian package %s; scripts/test.sh installs it)", name, pkg)
		}
		t.Skipf("%s not installed (Debian package %s)", name, pkg)
	}
	return p
}

// renderMan renders docs/man/NAME.md to roff with go-md2man, as
// scripts/package.sh does, into dir.
func renderMan(t *testing.T, name, dir string) string {
	t.Helper()
	md2man := tool(t, "go-md2man", "go-md2man")
	out := filepath.Join(dir, strings.TrimSuffix(name, ".md"))
	if b, err := exec.Command(md2man, "-in", filepath.Join(manDir, name), "-out", out).CombinedOutput(); err != nil {
		t.Fatalf("go-md2man %s: %v\n%s", name, err, b)
	}
	return out
}

// TestManPagesRender renders every page and formats it with man's
// warnings on, as lintian does: any warning (a bad request, a line that
// cannot be broken) fails the test.
func TestManPagesRender(t *testing.T) {
	man := tool(t, "man", "man-db")
	tool(t, "groff", "groff-base")
	pages, err := filepath.Glob(filepath.Join(manDir, "*.md"))
	if err != nil || len(pages) != 2 {
		t.Fatalf("pages %v (%v), want nbdmapper.8 and nbdmapper-table.5", pages, err)
	}
	dir := t.TempDir()
	for _, p := range pages {
		name := filepath.Base(p)
		t.Run(name, func(t *testing.T) {
			roff := renderMan(t, name, dir)
			if !regexp.MustCompile(`\.[1-8]$`).MatchString(roff) {
				t.Fatalf("%s: want NAME.SECTION.md", name)
			}
			cmd := exec.Command(man, "--warnings", "-E", "UTF-8", "-l", "-Tutf8", "-Z", roff)
			cmd.Env = append(os.Environ(), "LC_ALL=C.UTF-8", "MANWIDTH=80")
			var stdout, stderr bytes.Buffer
			cmd.Stdout, cmd.Stderr = &stdout, &stderr
			if err := cmd.Run(); err != nil || stderr.Len() != 0 {
				t.Fatalf("man --warnings %s: %v\n%s", name, err, stderr.String())
			}
			if stdout.Len() < 1000 {
				t.Fatalf("man %s printed %d bytes", name, stdout.Len())
			}
		})
	}
}

var (
	manFlagTerm = regexp.MustCompile(`\*\*--([a-z][a-z0-9-]*)\*\*`)
	helpFlag    = regexp.MustCompile(`(?m)^  -([a-z][a-z0-9-]*)`)
)

// verbFlags asks the binary for a verb's --help and returns the flags it
// lists.
func verbFlags(t *testing.T, verb string) []string {
	t.Helper()
	out, err := exec.Command(bin, verb, "--help").Output()
	if err != nil {
		t.Fatalf("%s --help: %v", verb, err)
	}
	var flags []string
	for _, m := range helpFlag.FindAllStringSubmatch(string(out), -1) {
		flags = append(flags, m[1])
	}
	return flags
}

// TestManFlags holds nbdmapper(8) to the binary: every verb has a
// subsection (`### verb[, verb...]`), every flag a verb accepts is
// described in its subsection, and no flag is named anywhere in the page
// that no verb accepts.
func TestManFlags(t *testing.T) {
	b, err := os.ReadFile(filepath.Join(manDir, "nbdmapper.8.md"))
	if err != nil {
		t.Fatal(err)
	}
	page := string(b)
	sections := make(map[string]string) // verb -> its subsection's text
	parts := regexp.MustCompile(`(?m)^#{1,3} `).Split(page, -1)
	heads := regexp.MustCompile(`(?m)^(#{1,3}) (.*)$`).FindAllStringSubmatch(page, -1)
	for i, h := range heads {
		if h[1] != "###" {
			continue
		}
		for _, v := range strings.Split(h[2], ",") {
			sections[strings.TrimSpace(v)] = parts[i+1]
		}
	}
	all := map[string]bool{"help": true, "version": true, "h": true} // nbdmapper --help, --version
	for verb := range commands {
		sec, ok := sections[verb]
		if !ok {
			t.Errorf("nbdmapper.8.md has no ### subsection for %s", verb)
			continue
		}
		described := make(map[string]bool)
		for _, m := range manFlagTerm.FindAllStringSubmatch(sec, -1) {
			described[m[1]] = true
		}
		for _, f := range verbFlags(t, verb) {
			all[f] = true
			if !described[f] {
				t.Errorf("%s --%s is not in nbdmapper.8.md's %s subsection", verb, f, verb)
			}
		}
	}
	var unknown []string
	for _, m := range regexp.MustCompile(`(?:^|[^\w-])--([a-z][a-z0-9-]*)`).FindAllStringSubmatch(page, -1) {
		if !all[m[1]] && !slices.Contains(unknown, m[1]) {
			unknown = append(unknown, m[1])
		}
	}
	if len(unknown) > 0 {
		t.Errorf("nbdmapper.8.md names flags no verb accepts: --%s", strings.Join(unknown, ", --"))
	}
}
