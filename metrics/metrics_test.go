package metrics

import (
	"bytes"
	"fmt"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/nbdmapper/nbdmapper/backing"
	"github.com/nbdmapper/nbdmapper/discard"
	"github.com/nbdmapper/nbdmapper/flush"
	"github.com/nbdmapper/nbdmapper/internal/testing/nbdtest"
	"github.com/nbdmapper/nbdmapper/internal/testing/sparse"
	"github.com/nbdmapper/nbdmapper/mapped"
	"github.com/nbdmapper/nbdmapper/nbdtarget"
	"github.com/nbdmapper/nbdmapper/table"
)

// workload writes every linear segment of "main", flushes twice, trims the
// linear part whole, reads the error segment once and flushes "small".
const workload = `
buf = b'x' * 4096
for i in range(8):
    h.pwrite(buf, i * 524288)
h.flush()
h.flush()
h.trim(8 * 524288, 0)
try:
    h.pread(512, 9 * 524288)
except nbd.Error as e:
    assert e.errnum == errno.EIO, e
else:
    raise AssertionError("read of the error target succeeded")
`

func runWorkload(t *testing.T, r *rig) {
	t.Helper()
	r.nbdsh(t, "main", "import errno\n"+workload)
	r.nbdsh(t, "small", "h.pwrite(b'y' * 4096, 0)\nh.flush()")
}

// TestLint runs client_golang's linter (the rules of promtool check metrics)
// over the whole registry, before and after traffic.
func TestLint(t *testing.T) {
	r := startRig(t)
	for _, stage := range []string{"idle", "after workload"} {
		if stage != "idle" {
			runWorkload(t, r)
		}
		problems, err := testutil.GatherAndLint(r.metrics.Gatherer())
		if err != nil {
			t.Fatalf("%s: gather: %v", stage, err)
		}
		for _, p := range problems {
			t.Errorf("%s: %s: %s", stage, p.Metric, p.Text)
		}
	}
}

// TestZeroFromStart checks that every series the configuration implies is
// there, at 0, before the first request.
func TestZeroFromStart(t *testing.T) {
	r := startRig(t)
	fams := gather(t, r.metrics)
	disk0, disk1 := r.disks[0], r.disks[1]

	type series struct {
		name   string
		labels map[string]string
	}
	var want []series
	for _, x := range []string{"main", "small"} {
		for _, op := range nbdtarget.Ops {
			want = append(want,
				series{"nbdmapper_requests_total", map[string]string{"export": x, "op": op}},
				series{"nbdmapper_request_bytes_total", map[string]string{"export": x, "op": op}})
			for _, e := range []string{"EPERM", "EIO", "ENOMEM", "EINVAL", "ENOSPC", "EOVERFLOW", "ENOTSUP", "ESHUTDOWN"} {
				want = append(want, series{"nbdmapper_request_errors_total", map[string]string{"export": x, "op": op, "errno": e}})
			}
			if op != "disc" {
				want = append(want, series{"nbdmapper_request_duration_seconds", map[string]string{"export": x, "op": op}})
			}
		}
		want = append(want,
			series{"nbdmapper_requests_in_flight", map[string]string{"export": x}},
			series{"nbdmapper_connections_active", map[string]string{"export": x}},
			series{"nbdmapper_connections_total", map[string]string{"export": x}})
	}
	for _, d := range []string{disk0, disk1} {
		for _, name := range []string{
			"nbdmapper_device_flushes_total", "nbdmapper_device_syncs_total",
			"nbdmapper_device_syncs_skipped_total", "nbdmapper_device_flushes_coalesced_total",
			"nbdmapper_device_sync_errors_total", "nbdmapper_device_dirty", "nbdmapper_device_failed",
			"nbdmapper_device_sync_duration_seconds",
			"nbdmapper_device_discard_ranges_received_total", "nbdmapper_device_discard_received_bytes_total",
			"nbdmapper_device_discard_calls_total", "nbdmapper_device_discard_bytes_total",
			"nbdmapper_device_discard_ranges_merged_total", "nbdmapper_device_discard_unsupported_total",
			"nbdmapper_device_discard_errors_total", "nbdmapper_device_zero_ranges_received_total",
			"nbdmapper_device_zero_calls_total",
		} {
			want = append(want, series{name, map[string]string{"device": d}})
		}
		for _, op := range []string{"discard", "zero"} {
			want = append(want, series{"nbdmapper_device_discard_duration_seconds", map[string]string{"device": d, "op": op}})
		}
	}
	want = append(want, series{"nbdmapper_flushes_total", nil})
	for _, s := range want {
		m := find(fams, s.name, s.labels)
		if m == nil {
			t.Errorf("%s%v: missing", s.name, s.labels)
			continue
		}
		if v := value(m); v != 0 {
			t.Errorf("%s%v = %v before any request, want 0", s.name, s.labels, v)
		}
	}

	// Static table metrics have their real values from the start.
	statics := []wantValue{
		{"nbdmapper_export_size_bytes", map[string]string{"export": "main"}, 10 * segSectors * 512},
		{"nbdmapper_export_size_bytes", map[string]string{"export": "small"}, segSectors * 512},
		{"nbdmapper_export_segments", map[string]string{"export": "main", "target": "linear"}, 8},
		{"nbdmapper_export_segments", map[string]string{"export": "main", "target": "zero"}, 1},
		{"nbdmapper_export_segments", map[string]string{"export": "main", "target": "error"}, 1},
		{"nbdmapper_export_segments", map[string]string{"export": "main", "target": "striped"}, 0},
		{"nbdmapper_export_segments", map[string]string{"export": "small", "target": "linear"}, 1},
		{"nbdmapper_export_backing_devices", map[string]string{"export": "main"}, 2},
		{"nbdmapper_export_backing_devices", map[string]string{"export": "small"}, 1},
		{"nbdmapper_device_size_bytes", map[string]string{"device": disk0}, diskBytes},
		{"nbdmapper_device_size_bytes", map[string]string{"device": disk1}, diskBytes},
		{"nbdmapper_build_info", map[string]string{"version": "test"}, 1},
	}
	checkValues(t, fams, statics)
	for _, typ := range table.Targets() {
		if find(fams, "nbdmapper_export_segments", map[string]string{"export": "small", "target": typ}) == nil {
			t.Errorf("nbdmapper_export_segments{export=small,target=%s} missing", typ)
		}
	}
}

// TestCountersMatchDevices drives a known workload with nbdsh and checks
// the scraped counters against the server's own bookkeeping and against
// what the recording devices saw.
func TestCountersMatchDevices(t *testing.T) {
	r := startRig(t)
	runWorkload(t, r)
	fams := gather(t, r.metrics)
	disk0, disk1 := r.disks[0], r.disks[1]
	rec0, rec1 := r.recorders[disk0], r.recorders[disk1]

	checks := []wantValue{
		{"nbdmapper_requests_total", map[string]string{"export": "main", "op": "write"}, 8},
		{"nbdmapper_request_bytes_total", map[string]string{"export": "main", "op": "write"}, 8 * 4096},
		{"nbdmapper_requests_total", map[string]string{"export": "main", "op": "flush"}, 2},
		{"nbdmapper_requests_total", map[string]string{"export": "main", "op": "trim"}, 1},
		{"nbdmapper_request_bytes_total", map[string]string{"export": "main", "op": "trim"}, 8 * 524288},
		{"nbdmapper_requests_total", map[string]string{"export": "main", "op": "read"}, 1},
		{"nbdmapper_request_errors_total", map[string]string{"export": "main", "op": "read", "errno": "EIO"}, 1},
		{"nbdmapper_request_errors_total", map[string]string{"export": "main", "op": "write", "errno": "EIO"}, 0},
		{"nbdmapper_requests_total", map[string]string{"export": "small", "op": "flush"}, 1},
		{"nbdmapper_request_duration_seconds", map[string]string{"export": "main", "op": "write"}, 8},
		{"nbdmapper_request_duration_seconds", map[string]string{"export": "main", "op": "read"}, 1},
		{"nbdmapper_connections_total", map[string]string{"export": "main"}, 1},
		{"nbdmapper_connections_active", map[string]string{"export": "main"}, 0},
		{"nbdmapper_requests_in_flight", map[string]string{"export": "main"}, 0},

		// What reached the disks, as the recorders saw it.
		{"nbdmapper_device_syncs_total", map[string]string{"device": disk0}, float64(rec0.Count(backing.OpSync))},
		{"nbdmapper_device_syncs_total", map[string]string{"device": disk1}, float64(rec1.Count(backing.OpSync))},
		{"nbdmapper_device_sync_duration_seconds", map[string]string{"device": disk0}, float64(rec0.Count(backing.OpSync))},
		{"nbdmapper_device_discard_calls_total", map[string]string{"device": disk0}, float64(rec0.Count(backing.OpDiscard))},
		{"nbdmapper_device_discard_calls_total", map[string]string{"device": disk1}, float64(rec1.Count(backing.OpDiscard))},
		{"nbdmapper_device_discard_duration_seconds", map[string]string{"device": disk1, "op": "discard"}, float64(rec1.Count(backing.OpDiscard))},
		{"nbdmapper_device_discard_bytes_total", map[string]string{"device": disk0}, float64(discardBytes(rec0))},
		{"nbdmapper_device_discard_bytes_total", map[string]string{"device": disk1}, float64(discardBytes(rec1))},

		// The trim covered 4 back-to-back segments on each disk: 4 ranges
		// in, merged into one call, 3 merged away.
		{"nbdmapper_device_discard_ranges_received_total", map[string]string{"device": disk0}, 4},
		{"nbdmapper_device_discard_received_bytes_total", map[string]string{"device": disk1}, 4 * 524288},
		{"nbdmapper_device_discard_calls_total", map[string]string{"device": disk0}, 1},
		{"nbdmapper_device_discard_ranges_merged_total", map[string]string{"device": disk0}, 3},
		{"nbdmapper_device_discard_ranges_merged_total", map[string]string{"device": disk1}, 3},

		// main flushed twice with both disks written once: one sync each,
		// the second flush skipped; small's flush needs disk 0 again.
		{"nbdmapper_device_syncs_total", map[string]string{"device": disk1}, 1},
		{"nbdmapper_device_flushes_total", map[string]string{"device": disk1}, 2},
		{"nbdmapper_device_syncs_skipped_total", map[string]string{"device": disk1}, 1},
		{"nbdmapper_device_flushes_total", map[string]string{"device": disk0}, 3},
		{"nbdmapper_flushes_total", nil, 3},
	}
	checkValues(t, fams, checks)
}

// TestHoleMapSkips trims the same range of a sparse file twice: the first
// trim punches the file and teaches its hole map the holes, the second
// finds them known and is answered without the file system, which the
// skipped counter shows (the discard engine above counts both calls). The
// server is built as serve builds it, the flush engine's tracking right
// above the hole map (the rig's recorders would hide the map).
func TestHoleMapSkips(t *testing.T) {
	file := sparse.Create(t, filepath.Join(t.TempDir(), "d.img"), diskBytes)
	f, d := flush.New(), discard.New()
	pool := &backing.Pool{Wrap: f.Track}
	t.Cleanup(func() { pool.Close() })
	tb, err := table.Parse("t.table", strings.NewReader(fmt.Sprintf("0 %d linear %s 0\n", diskBytes/512, file)), pool)
	if err != nil {
		t.Fatal(err)
	}
	srv := &nbdtarget.Server{Exports: []*nbdtarget.Export{{Name: "t", Dev: mapped.New("t", tb, f, d)}}}
	m := New(Config{Server: srv, Flush: f, Discard: d, Version: "test"})
	sock := nbdtest.ServeUnix(t, srv, nbdtarget.ErrServerClosed)
	script := "h.trim(2 << 20, 1 << 20)\nh.trim(2 << 20, 1 << 20)"
	if out, err := nbdtest.Nbdsh(t, "-u", nbdtest.URI(sock, "t"), "-c", script).CombinedOutput(); err != nil {
		t.Fatalf("nbdsh: %v\n%s", err, out)
	}
	dev := map[string]string{"device": file}
	checkValues(t, gather(t, m), []wantValue{
		{"nbdmapper_device_hole_map_skipped_total", dev, 1},
		{"nbdmapper_device_discard_calls_total", dev, 2},
		{"nbdmapper_device_hole_map_known_chunks", dev, 8},
	})
}

func discardBytes(r *backing.Recorder) int64 {
	var n int64
	for _, c := range r.Calls(backing.OpDiscard) {
		if c.Err == nil {
			n += c.Len
		}
	}
	return n
}

// TestPromtoolCheckMetrics runs `promtool check metrics` on a live scrape
// over HTTP, after traffic, and wants no output at all.
func TestPromtoolCheckMetrics(t *testing.T) {
	promtool := nbdtest.Tool(t, "promtool")
	r := startRig(t)
	runWorkload(t, r)
	page := r.scrape(t)
	if !bytes.Contains(page, []byte("nbdmapper_device_syncs_total{")) {
		t.Fatalf("scrape lacks nbdmapper_device_syncs_total:\n%s", page)
	}
	cmd := exec.Command(promtool, "check", "metrics")
	cmd.Stdin = bytes.NewReader(page)
	out, err := cmd.CombinedOutput()
	if err != nil || len(bytes.TrimSpace(out)) > 0 {
		t.Errorf("promtool check metrics: %v\n%s", err, out)
	}
}

// TestServe checks the HTTP side: /metrics in the text format, an index at
// /, 404 elsewhere.
func TestServe(t *testing.T) {
	r := startRig(t)
	page := string(r.scrape(t))
	for _, want := range []string{
		"# TYPE nbdmapper_requests_total counter",
		"# TYPE nbdmapper_request_duration_seconds histogram",
		"# TYPE go_goroutines gauge",
		"# TYPE process_cpu_seconds_total counter",
	} {
		if !strings.Contains(page, want) {
			t.Errorf("scrape lacks %q", want)
		}
	}
	lines := strings.Split(page, "\n")
	if i := slices.IndexFunc(lines, func(l string) bool { return strings.Contains(l, "offset") }); i >= 0 {
		t.Errorf("a label mentions an offset: %s", lines[i])
	}
}

// TestHistograms checks that the duration histograms carry both classic
// buckets (for the dashboard and any Prometheus) and native buckets (for a
// Prometheus with native histograms enabled), and count every observation.
func TestHistograms(t *testing.T) {
	r := startRig(t)
	runWorkload(t, r)
	fams := gather(t, r.metrics)
	for _, c := range []struct {
		name   string
		labels map[string]string
		count  uint64
	}{
		{"nbdmapper_request_duration_seconds", map[string]string{"export": "main", "op": "write"}, 8},
		{"nbdmapper_device_sync_duration_seconds", map[string]string{"device": r.disks[1]}, 1},
		{"nbdmapper_device_discard_duration_seconds", map[string]string{"device": r.disks[0], "op": "discard"}, 1},
	} {
		m := find(fams, c.name, c.labels)
		if m == nil {
			t.Errorf("%s%v: missing", c.name, c.labels)
			continue
		}
		h := m.GetHistogram()
		if h.GetSampleCount() != c.count {
			t.Errorf("%s%v: %d samples, want %d", c.name, c.labels, h.GetSampleCount(), c.count)
		}
		if got := len(h.GetBucket()); got != len(latencyBuckets) {
			t.Errorf("%s%v: %d classic buckets, want %d", c.name, c.labels, got, len(latencyBuckets))
		}
		if last := h.GetBucket()[len(h.GetBucket())-1]; last.GetCumulativeCount() != c.count {
			t.Errorf("%s%v: %d samples up to %vs, want all %d", c.name, c.labels, last.GetCumulativeCount(), last.GetUpperBound(), c.count)
		}
		// Factor 1.1 is schema 3: 2^(2^-3) = 1.09 per bucket.
		if h.Schema == nil || h.GetSchema() != 3 {
			t.Errorf("%s%v: native schema %v, want 3", c.name, c.labels, h.Schema)
		}
		// Native bucket counts are delta-encoded: bucket i holds the sum
		// of the first i+1 deltas. With the zero bucket they hold every
		// observation.
		native, running := h.GetZeroCount(), int64(0)
		for _, d := range h.GetPositiveDelta() {
			running += d
			native += uint64(running)
		}
		if len(h.GetPositiveSpan()) == 0 || native != c.count {
			t.Errorf("%s%v: native buckets hold %d samples in %d spans, want %d", c.name, c.labels, native, len(h.GetPositiveSpan()), c.count)
		}
	}
}

// TestRemoteCounters drives the export over a remote NBD export and
// checks the remote series: what was sent to the remote, its connections,
// and round trips, beside the flush engine's view of the same device.
func TestRemoteCounters(t *testing.T) {
	r := startRig(t)
	r.nbdsh(t, "far", "h.pwrite(b'z' * 8192, 4096)\nh.flush()\nh.flush()\nh.pread(4096, 0)")
	fams := gather(t, r.metrics)
	dev := map[string]string{"device": r.remote}
	op := func(o string) map[string]string { return map[string]string{"device": r.remote, "op": o} }
	checkValues(t, fams, []wantValue{
		{"nbdmapper_remote_requests_total", op("write"), 1},
		{"nbdmapper_remote_requests_total", op("read"), 1},
		// Two client flushes, one NBD flush: the second found the remote clean.
		{"nbdmapper_remote_requests_total", op("flush"), 1},
		{"nbdmapper_device_syncs_total", dev, 1},
		{"nbdmapper_device_syncs_skipped_total", dev, 1},
		{"nbdmapper_remote_round_trip_seconds", op("write"), 1},
		{"nbdmapper_remote_round_trip_seconds", op("flush"), 1},
		{"nbdmapper_remote_connections", dev, 4},
		{"nbdmapper_remote_connections_wanted", dev, 4},
		{"nbdmapper_remote_reconnects_total", dev, 0},
		{"nbdmapper_remote_retries_total", dev, 0},
		{"nbdmapper_remote_unflushed_writes", dev, 0},
		{"nbdmapper_remote_writes_lost", dev, 0},
		{"nbdmapper_remote_requests_in_flight", dev, 0},
	})
}

// TestGoneSeriesDeleted: the histograms of an export that was removed, and
// of a backing device no table holds any more (the pool closed it), go at
// the next scrape; a server whose exports and devices come and go would
// otherwise keep a histogram of every one it ever had. An export made
// again under the same name starts afresh.
func TestGoneSeriesDeleted(t *testing.T) {
	r := startRig(t)
	runWorkload(t, r)
	r.nbdsh(t, "far", "h.pwrite(b'z' * 4096, 0)\nh.flush()")
	remoteDev := r.remote
	series := func() (request, sync, remote map[string]bool) {
		fams := gather(t, r.metrics)
		label := func(name, l string) map[string]bool {
			set := make(map[string]bool)
			if mf := fams[name]; mf != nil {
				for _, m := range mf.GetMetric() {
					for _, lp := range m.GetLabel() {
						if lp.GetName() == l {
							set[lp.GetValue()] = true
						}
					}
				}
			}
			return set
		}
		return label("nbdmapper_request_duration_seconds", "export"),
			label("nbdmapper_device_sync_duration_seconds", "device"),
			label("nbdmapper_remote_round_trip_seconds", "device")
	}
	request, sync, rem := series()
	if !request["small"] || !request["far"] || !sync[r.disks[1]] || !rem[remoteDev] {
		t.Fatalf("before: exports %v, synced devices %v, remotes %v", request, sync, rem)
	}
	remove := func(name string) *nbdtarget.Export {
		x, err := r.server.RemoveExport(name, true)
		if err != nil {
			t.Fatal(err)
		}
		if err := x.Dev.Close(); err != nil {
			t.Fatal(err)
		}
		return x
	}
	small := remove("small")
	remove("far")
	request, sync, rem = series()
	if request["small"] || request["far"] || !request["main"] {
		t.Errorf("after removing small and far, the request histograms are of %v, want main's only", request)
	}
	if len(rem) != 0 {
		t.Errorf("after removing far, its remote's histograms are still there: %v", rem)
	}
	if !sync[r.disks[0]] || !sync[r.disks[1]] {
		t.Errorf("main still holds both disks, but their sync histograms are %v", sync)
	}
	remove("main")
	if _, sync, _ = series(); len(sync) != 0 {
		t.Errorf("with every export gone, sync histograms of %v are left", sync)
	}

	// small again: a new device over disk 0, under the old name.
	tb, err := table.Parse("small.table", strings.NewReader(small.Dev.Table().String()), &backing.Pool{Wrap: r.flush.Track})
	if err != nil {
		t.Fatal(err)
	}
	if err := r.server.AddExport(&nbdtarget.Export{Name: "small", Dev: mapped.New("small", tb, r.flush, r.discard)}); err != nil {
		t.Fatal(err)
	}
	r.nbdsh(t, "small", "h.pwrite(b'y' * 4096, 0)")
	m := find(gather(t, r.metrics), "nbdmapper_request_duration_seconds", map[string]string{"export": "small", "op": "write"})
	if m == nil || m.GetHistogram().GetSampleCount() != 1 {
		t.Errorf("small made again: its write histogram is %v, want one write", m)
	}
}
