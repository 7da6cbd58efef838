package metrics

import (
	"os/exec"
	"strings"
	"testing"

	"github.com/nbdmapper/nbdmapper/internal/testing/nbdtest"
)

const module = "github.com/nbdmapper/nbdmapper"

// TestOnlyMetricsImportsPrometheus keeps Prometheus out of the data path:
// no package of the module but metrics may import github.com/prometheus/...,
// not even in its tests. The others expose plain Stats instead.
func TestOnlyMetricsImportsPrometheus(t *testing.T) {
	gocmd := nbdtest.Tool(t, "go")
	out, err := exec.Command(gocmd, "list", "-e",
		"-f", `{{.ImportPath}} {{join .Imports " "}} {{join .TestImports " "}} {{join .XTestImports " "}}`,
		module+"/...").Output()
	if err != nil {
		t.Fatalf("go list: %v", err)
	}
	var pkgs int
	var metricsSeen bool
	for line := range strings.Lines(string(out)) {
		fields := strings.Fields(line)
		if len(fields) == 0 {
			continue
		}
		pkg, imports := fields[0], fields[1:]
		pkgs++
		for _, imp := range imports {
			if !strings.HasPrefix(imp, "github.com/prometheus/") {
				continue
			}
			if pkg == module+"/metrics" {
				metricsSeen = true
				continue
			}
			t.Errorf("%s imports %s: only package metrics may import Prometheus", pkg, imp)
		}
	}
	// The check must have seen the module, metrics' own imports included.
	if pkgs < 5 || !metricsSeen {
		t.Fatalf("go list saw %d packages, metrics importing Prometheus: %v\n%s", pkgs, metricsSeen, out)
	}
}
