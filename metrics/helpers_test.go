package metrics

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"path/filepath"
	"strings"
	"testing"

	dto "github.com/prometheus/client_model/go"

	"github.com/nbdmapper/nbdmapper/backing"
	"github.com/nbdmapper/nbdmapper/discard"
	"github.com/nbdmapper/nbdmapper/flush"
	"github.com/nbdmapper/nbdmapper/internal/testing/nbdtest"
	"github.com/nbdmapper/nbdmapper/internal/testing/sparse"
	"github.com/nbdmapper/nbdmapper/mapped"
	"github.com/nbdmapper/nbdmapper/nbdtarget"
	"github.com/nbdmapper/nbdmapper/remote"
	"github.com/nbdmapper/nbdmapper/table"
)

// rig is a real nbdmapper in the test process: two sparse backing files,
// each wrapped in a backing.Recorder under the flush engine, exports over
// them served on a unix socket, and the metrics served on loopback TCP.
type rig struct {
	socket     string
	metricsURL string
	metrics    *Metrics
	server     *nbdtarget.Server
	flush      *flush.Engine
	discard    *discard.Engine
	recorders  map[string]*backing.Recorder // by device name (path)
	disks      []string
	remote     string // the URI of the export "far" maps onto
}

const (
	diskBytes  = 8 << 20
	segSectors = 1024 // 512 KiB segments
)

// startRig serves three exports: "main", 8 linear segments of 512 KiB
// alternating between the two disks (so each disk holds 4 of them back to
// back), then a zero and an error segment; "small", one linear segment
// on disk 0 past everything "main" uses; and "far", one linear segment on
// a remote export (another nbdmapper server in this process, over a third
// file) named by its NBD URI.
//
//	main:  | d0:0 | d1:0 | d0:1 | d1:1 | ... | d1:3 | zero | error |
//	small: | d0:8 |
//	far:   | nbd+unix:///r?socket=...:0 |
func startRig(t *testing.T) *rig {
	t.Helper()
	return startRigWeb(t, "")
}

// startRigWeb is startRig with the metrics listener protected by a web
// config file (see Metrics.WebConfigFile); "" serves plain HTTP.
func startRigWeb(t *testing.T, webConfig string) *rig {
	t.Helper()
	dir := t.TempDir()
	r := &rig{recorders: make(map[string]*backing.Recorder)}
	for i := range 2 {
		r.disks = append(r.disks, sparse.Create(t, filepath.Join(dir, fmt.Sprintf("disk%d.img", i)), diskBytes))
	}
	var main strings.Builder
	for i := range 8 {
		fmt.Fprintf(&main, "%d %d linear %s %d\n", i*segSectors, segSectors, r.disks[i%2], (i/2)*segSectors)
	}
	fmt.Fprintf(&main, "%d %d zero\n", 8*segSectors, segSectors)
	fmt.Fprintf(&main, "%d %d error\n", 9*segSectors, segSectors)
	small := fmt.Sprintf("0 %d linear %s %d\n", segSectors, r.disks[0], 8*segSectors)
	r.remote = serveRemote(t, sparse.Create(t, filepath.Join(dir, "remote.img"), diskBytes))
	far := fmt.Sprintf("0 %d linear %s 0\n", segSectors, r.remote)

	r.flush = flush.New()
	r.discard = discard.New()
	remotes := &remote.Scheme{}
	pool := &backing.Pool{Schemes: []backing.Scheme{remotes}, Forget: r.discard.Forget, Wrap: func(d backing.Device) backing.Device {
		rec := backing.NewRecorder(d)
		r.recorders[d.Name()] = rec
		return r.flush.Track(rec)
	}}
	t.Cleanup(func() { pool.Close() })
	var exports []*nbdtarget.Export
	for _, x := range []struct{ name, text string }{{"main", main.String()}, {"small", small}, {"far", far}} {
		tb, err := table.Parse(x.name+".table", strings.NewReader(x.text), pool)
		if err != nil {
			t.Fatalf("table %s: %v", x.name, err)
		}
		exports = append(exports, &nbdtarget.Export{
			Name: x.name, Dev: mapped.New(x.name, tb, r.flush, r.discard),
		})
	}
	r.server = &nbdtarget.Server{Exports: exports}
	r.metrics = New(Config{Server: r.server, Flush: r.flush, Discard: r.discard, Remotes: remotes, Version: "test"})

	r.socket = nbdtest.ServeUnix(t, r.server, nbdtarget.ErrServerClosed)

	r.metrics.WebConfigFile = webConfig
	ml, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.metrics.Serve(ctx, ml) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("metrics.Serve: %v", err)
		}
	})
	r.metricsURL = "http://" + ml.Addr().String() + "/metrics"
	return r
}

// serveRemote serves file as export "r" of another nbdmapper server in
// this process, the remote host of the rig's export "far", and returns its
// URI.
func serveRemote(t *testing.T, file string) string {
	f := flush.New()
	pool := &backing.Pool{Wrap: f.Track}
	t.Cleanup(func() { pool.Close() })
	tb, err := table.Parse("r.table", strings.NewReader(fmt.Sprintf("0 %d linear %s 0\n", diskBytes/512, file)), pool)
	if err != nil {
		t.Fatal(err)
	}
	srv := &nbdtarget.Server{Exports: []*nbdtarget.Export{{Name: "r", Dev: mapped.New("r", tb, f, discard.New())}}}
	return nbdtest.URI(nbdtest.ServeUnix(t, srv, nbdtarget.ErrServerClosed), "r")
}

// uri is the NBD URI of an export of the rig.
func (r *rig) uri(export string) string {
	return nbdtest.URI(r.socket, export)
}

// nbdsh runs a Python snippet against an export with nbdsh (h is connected).
func (r *rig) nbdsh(t *testing.T, export, script string) {
	t.Helper()
	out, err := nbdtest.Nbdsh(t, "-u", r.uri(export), "-c", script).CombinedOutput()
	if err != nil {
		t.Fatalf("nbdsh: %v\n%s", err, out)
	}
}

// scrape fetches the metrics page as a plain scraper would.
func (r *rig) scrape(t *testing.T) []byte {
	t.Helper()
	resp, err := http.Get(r.metricsURL)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("GET %s: %s", r.metricsURL, resp.Status)
	}
	return b
}

// gather returns the registry's families by name.
func gather(t *testing.T, m *Metrics) map[string]*dto.MetricFamily {
	t.Helper()
	mfs, err := m.Gatherer().Gather()
	if err != nil {
		t.Fatal(err)
	}
	out := make(map[string]*dto.MetricFamily, len(mfs))
	for _, mf := range mfs {
		out[mf.GetName()] = mf
	}
	return out
}

// find returns the sample of family name whose labels include want, or nil.
func find(fams map[string]*dto.MetricFamily, name string, want map[string]string) *dto.Metric {
	mf := fams[name]
	if mf == nil {
		return nil
	}
next:
	for _, m := range mf.GetMetric() {
		have := make(map[string]string)
		for _, l := range m.GetLabel() {
			have[l.GetName()] = l.GetValue()
		}
		for k, v := range want {
			if have[k] != v {
				continue next
			}
		}
		return m
	}
	return nil
}

// wantValue is the value one sample of a family must have.
type wantValue struct {
	name   string
	labels map[string]string // a subset of the sample's labels
	want   float64
}

// checkValues fails t for every wanted sample that is missing from fams or
// has another value.
func checkValues(t *testing.T, fams map[string]*dto.MetricFamily, wants []wantValue) {
	t.Helper()
	for _, w := range wants {
		m := find(fams, w.name, w.labels)
		if m == nil {
			t.Errorf("%s%v: missing", w.name, w.labels)
			continue
		}
		if v := value(m); v != w.want {
			t.Errorf("%s%v = %v, want %v", w.name, w.labels, v, w.want)
		}
	}
}

// value is a counter's or gauge's value, or a histogram's sample count.
func value(m *dto.Metric) float64 {
	switch {
	case m.Counter != nil:
		return m.GetCounter().GetValue()
	case m.Gauge != nil:
		return m.GetGauge().GetValue()
	case m.Histogram != nil:
		return float64(m.GetHistogram().GetSampleCount())
	}
	return -1
}
