package nbdtest

import (
	"os/exec"
	"strings"
	"testing"
)

// TestOnlyTestsImportTestSupport keeps the test-support packages (all of
// internal/testing) out of the nbdmapper binary: no package but another of
// them may import them outside its _test.go files.
func TestOnlyTestsImportTestSupport(t *testing.T) {
	const module = "github.com/nbdmapper/nbdmapper"
	support := module + "/internal/testing/"
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
		if strings.HasPrefix(fields[0], support) {
			continue // test support may build on test support
		}
		for _, imp := range fields[1:] {
			if strings.HasPrefix(imp, support) {
				t.Errorf("%s imports %s outside its tests", fields[0], imp)
			}
		}
	}
	if pkgs < 5 {
		t.Fatalf("go list saw only %d packages:\n%s", pkgs, out)
	}
}
