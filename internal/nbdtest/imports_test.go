package nbdtest

import (
	"os/exec"
	"slices"
	"strings"
	"testing"
)

// TestOnlyTestsImportTestSupport keeps the test-support packages out of the
// nbdmapper binary: no package but another of them may import them outside
// its _test.go files.
func TestOnlyTestsImportTestSupport(t *testing.T) {
	const module = "github.com/nbdmapper/nbdmapper"
	support := []string{module + "/internal/cephtest", module + "/internal/fault", module + "/internal/golden", module + "/internal/nbdtest", module + "/internal/netns", module + "/internal/sparse"}
	out, err := exec.Command(Tool(t, "go"), "list", "-e", "-f", `{{.ImportPath}} {{join .Imports " "}}`, module+"/...").Output()
	if err != nil {
		t.Fatalf("go list: %v", err)
	}
	var pkgs int
	for line := range strings.Lines(string(out)) {
		fields := strings.Fields(line)
		if len(fields) == 0 {
			continue
		}
		pkgs++
		if slices.Contains(support, fields[0]) {
			continue // test support may build on test support
		}
		for _, imp := range fields[1:] {
			for _, s := range support {
				if imp == s {
					t.Errorf("%s imports %s outside its tests", fields[0], imp)
				}
			}
		}
	}
	if pkgs < 5 {
		t.Fatalf("go list saw only %d packages:\n%s", pkgs, out)
	}
}
