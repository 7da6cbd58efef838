package metrics

import (
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/crypto/bcrypt"

	"github.com/nbdmapper/nbdmapper/backing"
	"github.com/nbdmapper/nbdmapper/internal/testing/nbdtest"
)

// promServer is a real Prometheus server on loopback, scraping one target
// every second, with its storage in a temporary directory.
type promServer struct {
	api    string // http://127.0.0.1:PORT
	cmd    *exec.Cmd
	stderr *strings.Builder
	exited chan struct{}
}

// jobs is appended under scrape_configs after the nbdmapper job; scrape is
// appended to that job (scheme, tls_config, basic_auth), indented by four.
func startPrometheus(t *testing.T, target, scrape, jobs string) *promServer {
	t.Helper()
	bin := nbdtest.Tool(t, "prometheus")
	dir := t.TempDir()
	config := fmt.Sprintf(`global:
  scrape_interval: 1s
  scrape_timeout: 1s
scrape_configs:
  - job_name: nbdmapper
    static_configs:
      - targets: [%q]
%s%s`, target, scrape, jobs)
	cfgPath := filepath.Join(dir, "prometheus.yml")
	if err := os.WriteFile(cfgPath, []byte(config), 0o644); err != nil {
		t.Fatal(err)
	}
	// Prometheus takes a listen address, not a listener: find a free
	// loopback port and hand it over.
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()

	p := &promServer{api: "http://" + addr, stderr: new(strings.Builder), exited: make(chan struct{})}
	p.cmd = exec.Command(bin,
		"--config.file="+cfgPath,
		"--storage.tsdb.path="+filepath.Join(dir, "data"),
		"--web.listen-address="+addr,
		"--log.level=warn",
	)
	p.cmd.Stderr = p.stderr
	if err := p.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { p.cmd.Wait(); close(p.exited) }()
	t.Cleanup(func() {
		p.cmd.Process.Signal(syscall.SIGTERM)
		<-p.exited
	})

	// Wait until it serves queries, or fail if it dies.
	deadline := time.Now().Add(nbdtest.Bound)
	for {
		if time.Now().After(deadline) {
			t.Fatalf("prometheus not ready after %v\n%s", nbdtest.Bound, p.stderr)
		}
		resp, err := http.Get(p.api + "/-/ready")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return p
			}
		}
		select {
		case <-p.exited:
			t.Fatalf("prometheus exited: %v\n%s", p.cmd.ProcessState, p.stderr)
		case <-time.After(100 * time.Millisecond):
		}
	}
}

type promSample struct {
	Metric map[string]string `json:"metric"`
	Value  [2]any            `json:"value"` // [unix seconds, "value"]
}

// query runs an instant query and returns its vector, failing the test on
// any error Prometheus reports (a PromQL syntax error included).
func (p *promServer) query(t *testing.T, q string) []promSample {
	t.Helper()
	resp, err := http.Get(p.api + "/api/v1/query?query=" + url.QueryEscape(q))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	var out struct {
		Status string `json:"status"`
		Error  string `json:"error"`
		Data   struct {
			ResultType string       `json:"resultType"`
			Result     []promSample `json:"result"`
		} `json:"data"`
	}
	if err := json.Unmarshal(body, &out); err != nil {
		t.Fatalf("query %q: %v\n%s", q, err, body)
	}
	if out.Status != "success" {
		t.Fatalf("query %q: %s: %s", q, out.Status, out.Error)
	}
	if out.Data.ResultType != "vector" {
		t.Fatalf("query %q: result type %s, want vector", q, out.Data.ResultType)
	}
	return out.Data.Result
}

func (s promSample) value(t *testing.T) float64 {
	t.Helper()
	str, _ := s.Value[1].(string)
	v, err := strconv.ParseFloat(str, 64)
	if err != nil {
		t.Fatalf("sample %v: %v", s, err)
	}
	return v
}

// scalar runs a query that must return exactly one sample.
func (p *promServer) scalar(t *testing.T, q string) float64 {
	t.Helper()
	res := p.query(t, q)
	if len(res) != 1 {
		t.Fatalf("query %q: %d samples, want 1: %v", q, len(res), res)
	}
	return res[0].value(t)
}

// waitScrapedAfter waits until Prometheus holds a scrape of the target
// taken after since. Scrapes happen every second, so this always ends; if
// the target is down it fails instead.
func (p *promServer) waitScrapedAfter(t *testing.T, since time.Time) {
	t.Helper()
	deadline := time.Now().Add(nbdtest.Bound)
	for {
		if time.Now().After(deadline) {
			t.Fatalf("no scrape of nbdmapper after %v", nbdtest.Bound)
		}
		res := p.query(t, `timestamp(nbdmapper_build_info)`)
		if len(res) == 1 && res[0].value(t) > float64(since.UnixMilli())/1000 {
			return
		}
		if len(res) == 1 {
			if up := p.query(t, `up{job="nbdmapper"}`); len(up) == 1 && up[0].value(t) != 1 {
				t.Fatalf("prometheus reports the nbdmapper target down")
			}
		}
		select {
		case <-p.exited:
			t.Fatalf("prometheus exited: %v\n%s", p.cmd.ProcessState, p.stderr)
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// TestPrometheusScrapesWhatDevicesSaw runs a real Prometheus scraping a real
// nbdmapper (in this process, so that recording devices can watch the
// disks) while fio writes with fsync and then trims through the NBD engine.
// The flush and discard counters Prometheus stored must equal what reached
// the backing devices. Every dashboard query must also evaluate.
//
// It runs over plain HTTP and over HTTPS with a web config that requires a
// client certificate and basic auth; there a second Prometheus job without
// credentials must find the target down.
func TestPrometheusScrapesWhatDevicesSaw(t *testing.T) {
	nbdtest.Tool(t, "fio")
	nbdtest.Tool(t, "prometheus")
	t.Run("http", func(t *testing.T) {
		r := startRig(t)
		target := strings.TrimSuffix(strings.TrimPrefix(r.metricsURL, "http://"), "/metrics")
		p := startPrometheus(t, target, "", "")
		scrapeWhatDevicesSaw(t, r, p)
	})
	t.Run("https with client certificate and basic auth", func(t *testing.T) {
		dir := t.TempDir()
		ca := nbdtest.NewCA(t, "test CA")
		srv, cli := ca.Server(t), ca.Client(t, "prometheus")
		nbdtest.CertDir(t, dir, ca, &srv, &cli)
		f := func(name string) string { return filepath.Join(dir, name) }
		hash, err := bcrypt.GenerateFromPassword([]byte("s3cret"), bcrypt.MinCost)
		if err != nil {
			t.Fatal(err)
		}
		os.WriteFile(f("password"), []byte("s3cret"), 0o600)
		web := fmt.Sprintf(`tls_server_config:
  cert_file: %s
  key_file: %s
  client_auth_type: RequireAndVerifyClientCert
  client_ca_file: %s
basic_auth_users:
  prometheus: %s
`, f("server-cert.pem"), f("server-key.pem"), f("ca-cert.pem"), hash)
		if err := os.WriteFile(f("web.yml"), []byte(web), 0o600); err != nil {
			t.Fatal(err)
		}
		r := startRigWeb(t, f("web.yml"))
		target := strings.TrimSuffix(strings.TrimPrefix(r.metricsURL, "http://"), "/metrics")
		scrape := fmt.Sprintf(`    scheme: https
    tls_config:
      ca_file: %s
      cert_file: %s
      key_file: %s
      server_name: localhost
    basic_auth:
      username: prometheus
      password_file: %s
`, f("ca-cert.pem"), f("client-cert.pem"), f("client-key.pem"), f("password"))
		anonymous := fmt.Sprintf(`  - job_name: anonymous
    scheme: https
    tls_config:
      ca_file: %s
      server_name: localhost
    static_configs:
      - targets: [%q]
  - job_name: no-password
    scheme: https
    tls_config:
      ca_file: %s
      cert_file: %s
      key_file: %s
      server_name: localhost
    static_configs:
      - targets: [%q]
`, f("ca-cert.pem"), target, f("ca-cert.pem"), f("client-cert.pem"), f("client-key.pem"), target)
		p := startPrometheus(t, target, scrape, anonymous)
		scrapeWhatDevicesSaw(t, r, p)
		for _, job := range []string{"anonymous", "no-password"} {
			if up := p.scalar(t, fmt.Sprintf(`up{job=%q}`, job)); up != 0 {
				t.Errorf("job %s without credentials: up = %v, want 0", job, up)
			}
		}
		// Say why, as Prometheus saw it.
		for _, tg := range p.targets(t) {
			t.Logf("target %s: health %s, error %q", tg.Job, tg.Health, tg.LastError)
			if tg.Job == "no-password" && !strings.Contains(tg.LastError, "401") {
				t.Errorf("scrape without a password failed with %q, want HTTP 401", tg.LastError)
			}
		}
	})
}

type promTarget struct {
	Job       string `json:"scrapePool"`
	Health    string `json:"health"`
	LastError string `json:"lastError"`
}

// targets lists the active scrape targets and their last scrape's error.
func (p *promServer) targets(t *testing.T) []promTarget {
	t.Helper()
	resp, err := http.Get(p.api + "/api/v1/targets?state=active")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var out struct {
		Data struct {
			ActiveTargets []promTarget `json:"activeTargets"`
		} `json:"data"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&out); err != nil {
		t.Fatal(err)
	}
	return out.Data.ActiveTargets
}

func scrapeWhatDevicesSaw(t *testing.T, r *rig, p *promServer) {
	fio := nbdtest.Tool(t, "fio")
	p.waitScrapedAfter(t, time.Now())

	// 4 MiB is the linear part of "main": 8 segments over both disks.
	out, err := exec.Command(fio,
		"--ioengine=nbd", "--uri="+r.uri("main"), "--size=4m", "--randrepeat=1",
		"--name=write", "--rw=randwrite", "--bs=4k", "--iodepth=4", "--fsync=16",
		"--name=trim", "--stonewall", "--rw=randtrim", "--bs=64k", "--iodepth=8",
	).CombinedOutput()
	if err != nil {
		t.Fatalf("fio: %v\n%s", err, out)
	}
	end := time.Now()
	p.waitScrapedAfter(t, end)

	flushReqs := r.server.Stats().Exports[0].Ops["flush"].Requests
	trimReqs := r.server.Stats().Exports[0].Ops["trim"].Requests
	if flushReqs == 0 || trimReqs == 0 {
		t.Fatalf("fio sent %d flushes and %d trims; the workload should send both", flushReqs, trimReqs)
	}
	type check struct {
		query string
		want  float64
	}
	checks := []check{
		{`nbdmapper_requests_total{export="main",op="flush"}`, float64(flushReqs)},
		{`nbdmapper_requests_total{export="main",op="trim"}`, float64(trimReqs)},
		{`nbdmapper_flushes_total`, float64(r.flush.Stats().Flushes)},
		{`sum(nbdmapper_request_errors_total)`, 0},
		{`up{job="nbdmapper"}`, 1},
	}
	var syncs, calls float64
	for _, disk := range r.disks {
		rec := r.recorders[disk]
		sel := fmt.Sprintf(`{device=%q}`, disk)
		checks = append(checks,
			check{"nbdmapper_device_syncs_total" + sel, float64(rec.Count(backing.OpSync))},
			check{"nbdmapper_device_sync_duration_seconds_count" + sel, float64(rec.Count(backing.OpSync))},
			check{"nbdmapper_device_discard_calls_total" + sel, float64(rec.Count(backing.OpDiscard))},
			check{"nbdmapper_device_discard_bytes_total" + sel, float64(discardBytes(rec))},
		)
		syncs += float64(rec.Count(backing.OpSync))
		calls += float64(rec.Count(backing.OpDiscard))
	}
	for _, c := range checks {
		if got := p.scalar(t, c.query); got != c.want {
			t.Errorf("%s = %v in Prometheus, want %v", c.query, got, c.want)
		}
	}
	ranges := p.scalar(t, `sum(nbdmapper_device_discard_ranges_received_total)`)
	t.Logf("fio: %d flushes -> %v syncs on %d disks; %d trims -> %v ranges on the disks -> %v discard calls",
		flushReqs, syncs, len(r.disks), trimReqs, ranges, calls)
	if syncs == 0 || calls == 0 {
		t.Errorf("no syncs (%v) or no discard calls (%v) reached the disks", syncs, calls)
	}
	if ranges < calls {
		t.Errorf("%v discard ranges received but %v calls issued: merging cannot add calls", ranges, calls)
	}

	// Every dashboard query must be valid PromQL and, apart from the
	// node_exporter ones, find data.
	vars := strings.NewReplacer(`$__rate_interval`, `5s`, `$instance`, `.*`,
		`$export`, `.*`, `$device`, `.*`, `$nbd`, `nbd0`)
	for where, q := range dashboardQueries(t) {
		if strings.HasPrefix(where, "$") {
			continue // label_values(): a Grafana function, not PromQL
		}
		res := p.query(t, vars.Replace(q))
		if len(res) == 0 && !strings.Contains(q, "node_") && !strings.Contains(q, "> 0") {
			t.Errorf("dashboard %s: no data for %s", where, vars.Replace(q))
		}
	}
}
