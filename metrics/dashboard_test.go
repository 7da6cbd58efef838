package metrics

import (
	"encoding/json"
	"os"
	"os/exec"
	"regexp"
	"slices"
	"strings"
	"testing"

	dto "github.com/prometheus/client_model/go"

	"github.com/nbdmapper/nbdmapper/internal/testing/nbdtest"
)

const (
	dashboardFile  = "../deploy/grafana/dashboards/nbdmapper.json"
	prometheusFile = "../deploy/prometheus/prometheus.yml"
	docsFile       = "../docs/metrics.md"
)

// nodeDiskMetrics are the node_exporter series the dashboard may use; they
// come from node_exporter's diskstats collector, not from this registry.
var nodeDiskMetrics = []string{
	"node_disk_reads_completed_total",
	"node_disk_writes_completed_total",
	"node_disk_discards_completed_total",
	"node_disk_flush_requests_total",
	"node_disk_read_bytes_total",
	"node_disk_written_bytes_total",
	"node_disk_io_time_seconds_total",
}

type dashPanel struct {
	Type       string          `json:"type"`
	Title      string          `json:"title"`
	Datasource json.RawMessage `json:"datasource"`
	Targets    []struct {
		Expr       string          `json:"expr"`
		Datasource json.RawMessage `json:"datasource"`
	} `json:"targets"`
	Panels []dashPanel `json:"panels"`
}

type dashboard struct {
	Panels     []dashPanel `json:"panels"`
	Templating struct {
		List []struct {
			Name  string          `json:"name"`
			Type  string          `json:"type"`
			Query json.RawMessage `json:"query"`
		} `json:"list"`
	} `json:"templating"`
}

// dashboardQueries returns every PromQL expression of the dashboard: panel
// targets (rows included) and query variables, keyed by where they are.
func dashboardQueries(t *testing.T) map[string]string {
	t.Helper()
	b, err := os.ReadFile(dashboardFile)
	if err != nil {
		t.Fatal(err)
	}
	var d dashboard
	if err := json.Unmarshal(b, &d); err != nil {
		t.Fatalf("%s: %v", dashboardFile, err)
	}
	out := make(map[string]string)
	var walk func([]dashPanel)
	walk = func(ps []dashPanel) {
		for _, p := range ps {
			for i, tg := range p.Targets {
				out[p.Title+"/"+string(rune('A'+i))] = tg.Expr
			}
			walk(p.Panels)
		}
	}
	walk(d.Panels)
	for _, v := range d.Templating.List {
		if v.Type != "query" {
			continue
		}
		var q struct{ Query string }
		if err := json.Unmarshal(v.Query, &q); err != nil {
			t.Fatalf("variable %s: query: %v", v.Name, err)
		}
		out["$"+v.Name] = q.Query
	}
	return out
}

var metricName = regexp.MustCompile(`\b(?:nbdmapper|go|process|node)_[a-z0-9_]+\b`)

// TestDashboardMetricsExist parses the dashboard, extracts every metric
// name its expressions use, and checks each against the registry (or, for
// node_exporter's node_disk_* series, against nodeDiskMetrics).
func TestDashboardMetricsExist(t *testing.T) {
	r := startRig(t)
	fams := gather(t, r.metrics)
	queries := dashboardQueries(t)
	if len(queries) < 20 {
		t.Fatalf("dashboard has %d queries; expected the full set of panels", len(queries))
	}
	used := make(map[string]bool)
	for where, q := range queries {
		names := metricName.FindAllString(q, -1)
		if len(names) == 0 {
			t.Errorf("%s: no metric name in %q", where, q)
		}
		for _, n := range names {
			if strings.HasPrefix(n, "node_") {
				if !slices.Contains(nodeDiskMetrics, n) {
					t.Errorf("%s: %s is not a known node_exporter disk metric", where, n)
				}
				continue
			}
			fam := familyOf(fams, n)
			if fam == "" {
				t.Errorf("%s: %s is not in the registry", where, n)
				continue
			}
			used[fam] = true
		}
	}
	for _, must := range []string{
		"nbdmapper_requests_total", "nbdmapper_request_bytes_total",
		"nbdmapper_request_duration_seconds", "nbdmapper_request_errors_total",
		"nbdmapper_device_syncs_total", "nbdmapper_device_flushes_total",
		"nbdmapper_device_discard_ranges_received_total", "nbdmapper_device_discard_calls_total",
	} {
		if !used[must] {
			t.Errorf("dashboard does not use %s", must)
		}
	}
}

// familyOf maps a series name to its family in fams: itself, or a
// histogram's or summary's _bucket, _sum or _count series. "" if unknown.
func familyOf(fams map[string]*dto.MetricFamily, name string) string {
	if fams[name] != nil {
		return name
	}
	for _, suffix := range []string{"_bucket", "_sum", "_count"} {
		base, ok := strings.CutSuffix(name, suffix)
		if !ok || fams[base] == nil {
			continue
		}
		switch fams[base].GetType() {
		case dto.MetricType_HISTOGRAM, dto.MetricType_GAUGE_HISTOGRAM:
			return base
		case dto.MetricType_SUMMARY:
			if suffix != "_bucket" {
				return base
			}
		}
	}
	return ""
}

// TestDashboardDatasourceVariable checks that the dashboard declares a
// datasource variable and that every panel and query goes through it, so
// the dashboard imports into any Grafana whatever its data source is named.
func TestDashboardDatasourceVariable(t *testing.T) {
	b, err := os.ReadFile(dashboardFile)
	if err != nil {
		t.Fatal(err)
	}
	var d dashboard
	if err := json.Unmarshal(b, &d); err != nil {
		t.Fatal(err)
	}
	if !slices.ContainsFunc(d.Templating.List, func(v struct {
		Name  string          `json:"name"`
		Type  string          `json:"type"`
		Query json.RawMessage `json:"query"`
	}) bool {
		return v.Type == "datasource" && v.Name == "datasource" && string(v.Query) == `"prometheus"`
	}) {
		t.Fatal(`no templating variable "datasource" of type datasource for prometheus`)
	}
	const want = `{"type":"prometheus","uid":"${datasource}"}`
	check := func(where string, raw json.RawMessage) {
		var v any
		if err := json.Unmarshal(raw, &v); err != nil {
			t.Errorf("%s: datasource: %v", where, err)
			return
		}
		got, _ := json.Marshal(v)
		if string(got) != want {
			t.Errorf("%s: datasource %s, want %s", where, got, want)
		}
	}
	var walk func([]dashPanel)
	walk = func(ps []dashPanel) {
		for _, p := range ps {
			if p.Type != "row" {
				check(p.Title, p.Datasource)
				for i, tg := range p.Targets {
					check(p.Title+"/"+string(rune('A'+i)), tg.Datasource)
				}
			}
			walk(p.Panels)
		}
	}
	walk(d.Panels)
}

// TestPrometheusConfig runs `promtool check config` on the shipped
// Prometheus configuration.
func TestPrometheusConfig(t *testing.T) {
	promtool := nbdtest.Tool(t, "promtool")
	out, err := exec.Command(promtool, "check", "config", prometheusFile).CombinedOutput()
	if err != nil {
		t.Fatalf("promtool check config: %v\n%s", err, out)
	}
	if !strings.Contains(string(out), "SUCCESS") {
		t.Fatalf("promtool check config did not report SUCCESS:\n%s", out)
	}
}

// TestDocsListEveryMetric checks docs/metrics.md against the registry:
// every nbdmapper_ family is documented, and every documented name exists.
func TestDocsListEveryMetric(t *testing.T) {
	r := startRig(t)
	fams := gather(t, r.metrics)
	b, err := os.ReadFile(docsFile)
	if err != nil {
		t.Fatal(err)
	}
	documented := make(map[string]bool)
	for _, n := range metricName.FindAllString(string(b), -1) {
		if !strings.HasPrefix(n, "nbdmapper_") {
			continue
		}
		fam := familyOf(fams, n)
		if fam == "" {
			t.Errorf("%s mentions %s, which is not in the registry", docsFile, n)
			continue
		}
		documented[fam] = true
	}
	for name := range fams {
		if strings.HasPrefix(name, "nbdmapper_") && !documented[name] {
			t.Errorf("%s does not document %s", docsFile, name)
		}
	}
}
