package main

import (
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/nbdmapper/nbdmapper/internal/testing/nbdtest"
)

const completionDir = "../../deploy/completion"

// complete sources the bash completion, completes words (the last one
// being completed) with the real binary as the command, and returns the
// candidates sorted.
func complete(t *testing.T, dir string, words ...string) []string {
	t.Helper()
	bash := tool(t, "bash", "bash")
	file, err := filepath.Abs(filepath.Join(completionDir, "nbdmapper.bash"))
	if err != nil {
		t.Fatal(err)
	}
	script := `source "$1" || exit 1; shift; COMP_WORDS=("$@"); COMP_CWORD=$(($# - 1)); _nbdmapper; printf '%s\n' "${COMPREPLY[@]}"`
	cmd := exec.Command(bash, append([]string{"--norc", "-c", script, "bash", file}, words...)...)
	cmd.Dir = dir
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("complete %q: %v", words, err)
	}
	got := strings.Fields(string(out))
	slices.Sort(got)
	return got
}

// TestBashCompletion completes verbs, flags (which the completion asks of
// the binary), export names from a running server's `ls`, table files and
// NAME=TABLE_FILE arguments.
func TestBashCompletion(t *testing.T) {
	dir := nbdtest.ShortDir(t)
	writeFile(t, filepath.Join(dir, "disk.table"), "0 8 zero\n")
	writeFile(t, filepath.Join(dir, "data.table"), "0 16 zero\n")
	ctl := filepath.Join(dir, "control")
	nbdtest.Start(t, bin, dir, "--metrics", "off", "--control", ctl, "disk=disk.table", "data=data.table")

	for _, tc := range []struct {
		name  string
		words []string
		want  []string
	}{
		{"verbs", []string{"st"}, []string{"status"}},
		{"verbs r", []string{"re"}, []string{"reload", "remove", "resume"}},
		{"flags from the binary", []string{"serve", "--soc"}, []string{"--socket", "--socket-mode"}},
		{"attach flags", []string{"attach", "--con"}, []string{"--connect", "--connections"}},
		{"tls values", []string{"serve", "--tls", "r"}, []string{"require"}},
		{"exports from ls", []string{"suspend", "--control", ctl, "d"}, []string{"data", "disk"}},
		{"exports with --control=", []string{"info", "--control=" + ctl, "da"}, []string{"data"}},
		{"only one export", []string{"resume", "--control", ctl, "disk", ""}, nil},
		{"reload: export, then file", []string{"reload", "--control", ctl, "disk", "dis"}, []string{"disk.table"}},
		{"check: table file", []string{"check", "da"}, []string{"data.table"}},
		{"serve NAME=file", []string{"serve", "x=di"}, []string{"x=disk.table"}},
		{"help: verbs", []string{"help", "ver"}, []string{"version"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := complete(t, dir, append([]string{bin}, tc.words...)...); !slices.Equal(got, tc.want) {
				t.Errorf("complete %q: %q, want %q", tc.words, got, tc.want)
			}
		})
	}

	// /dev/nbdX: whatever nbd devices this machine has.
	want, err := filepath.Glob("/dev/nbd[0-9]*")
	if err != nil {
		t.Fatal(err)
	}
	want = slices.DeleteFunc(want, func(p string) bool { return !regexp.MustCompile(`^/dev/nbd[0-9]+$`).MatchString(p) })
	slices.Sort(want)
	if got := complete(t, dir, bin, "detach", "/dev/nb"); !slices.Equal(got, want) {
		t.Errorf("detach /dev/nb: %q, want %q", got, want)
	}
}

// TestCompletionVerbs: both completions offer exactly the verbs the
// binary has, and zsh parses its file.
func TestCompletionVerbs(t *testing.T) {
	var verbs []string
	for v := range commands {
		verbs = append(verbs, v)
	}
	slices.Sort(verbs)
	want := append([]string{"--help", "--version"}, verbs...)
	if got := complete(t, t.TempDir(), bin, ""); !slices.Equal(got, want) {
		t.Errorf("bash completes %q, want %q", got, want)
	}
	zsh := tool(t, "zsh", "zsh")
	file := filepath.Join(completionDir, "_nbdmapper")
	if out, err := exec.Command(zsh, "-n", file).CombinedOutput(); err != nil {
		t.Fatalf("zsh -n: %v\n%s", err, out)
	}
	b, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	var zverbs []string
	for _, m := range regexp.MustCompile(`(?m)^\t\t'([a-z]+):`).FindAllStringSubmatch(string(b), -1) {
		zverbs = append(zverbs, m[1])
	}
	slices.Sort(zverbs)
	if !slices.Equal(zverbs, verbs) {
		t.Errorf("zsh completes verbs %q, want %q", zverbs, verbs)
	}
}
