package golden

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// recorder is a testing.TB that records failures instead of failing.
type recorder struct {
	testing.TB
	failed []string
}

func (r *recorder) Helper()                   {}
func (r *recorder) Errorf(f string, a ...any) { r.failed = append(r.failed, f) }
func (r *recorder) Fatalf(f string, a ...any) { r.failed = append(r.failed, f) }
func (r *recorder) Fatal(a ...any)            { r.failed = append(r.failed, "fatal") }

func TestCheck(t *testing.T) {
	path := filepath.Join(t.TempDir(), "x.golden")
	if err := os.WriteFile(path, []byte("a\nb\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		name, path, got string
		fail            bool
	}{
		{"equal", path, "a\nb\n", false},
		{"second line differs", path, "a\nc\n", true},
		{"missing trailing newline", path, "a\nb", true},
		{"no golden file", path + ".missing", "a\nb\n", true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			r := &recorder{TB: t}
			Check(r, tc.path, tc.got)
			if (len(r.failed) > 0) != tc.fail {
				t.Fatalf("Check failed with %q, want failure %v", r.failed, tc.fail)
			}
		})
	}
}

func TestFirstDiff(t *testing.T) {
	got := firstDiff("a\nb\nc\n", "a\nB\nc\n")
	if !strings.HasPrefix(got, "line 2:") || !strings.Contains(got, `"b"`) || !strings.Contains(got, `"B"`) {
		t.Fatalf("firstDiff = %q, want line 2 with both versions", got)
	}
}

func TestUpdateRewrites(t *testing.T) {
	path := filepath.Join(t.TempDir(), "x.golden")
	old := *update
	*update = true
	defer func() { *update = old }()
	Check(t, path, "new\n")
	b, err := os.ReadFile(path)
	if err != nil || string(b) != "new\n" {
		t.Fatalf("after -update the file holds %q, %v; want %q", b, err, "new\n")
	}
}
