package metrics

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"runtime/debug"
	"slices"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/prometheus/exporter-toolkit/web"

	"github.com/nbdmapper/nbdmapper/discard"
	"github.com/nbdmapper/nbdmapper/flush"
	"github.com/nbdmapper/nbdmapper/nbdtarget"
	"github.com/nbdmapper/nbdmapper/remote"
)

// Config says what New reads from. Any field may be nil; its metrics are
// then left out.
type Config struct {
	// Server is the protocol server. Its Exports give the table metrics
	// and the export label values; its Stats the front-end counters.
	Server *nbdtarget.Server
	// Flush and Discard are the engines every export shares.
	Flush   *flush.Engine
	Discard *discard.Engine
	// Remotes opened the remote exports (NBD URIs) the tables use.
	Remotes *remote.Scheme
	// Version goes into nbdmapper_build_info; empty means the main
	// module's version from the build info.
	Version string
}

// Metrics is a private registry holding every nbdmapper metric, the Go
// runtime and process collectors, and the histograms fed by the Observe
// hooks.
type Metrics struct {
	// Routes are further handlers Serve mounts beside /metrics, by path
	// (the serve command's /status and /table). Set before Serve.
	Routes map[string]http.Handler

	// WebConfigFile, if set, is a Prometheus web configuration file (TLS,
	// client certificates, basic auth), as node_exporter's
	// --web.config.file takes it; Serve applies it through the Prometheus
	// exporter-toolkit, which re-reads it for every connection and
	// request. Logger receives that toolkit's messages. Set before Serve.
	WebConfigFile string
	Logger        *slog.Logger

	reg *prometheus.Registry

	// The histograms fed by the Observe hooks; each deletes, at a scrape,
	// the series of exports or devices that are gone.
	requestSeconds *histograms // export, op
	syncSeconds    *histograms // device
	discardSeconds *histograms // device, op
	remoteSeconds  *histograms // device, op
}

// Latency buckets for the classic histograms, 50µs to 10s: a page-cache
// write on a file is tens of microseconds, an fdatasync of a real disk is
// milliseconds to seconds. The native histograms need no bucket choice.
var latencyBuckets = []float64{
	0.00005, 0.0001, 0.00025, 0.0005,
	0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
	0.1, 0.25, 0.5, 1, 2.5, 5, 10,
}

// histogramOpts returns classic buckets plus native histogram settings:
// factor 1.1 (8 buckets per power of two, ~5% error on quantiles), at most
// 160 buckets, reset at most hourly when that is exceeded.
func histogramOpts(name, help string) prometheus.HistogramOpts {
	return prometheus.HistogramOpts{
		Name:                            name,
		Help:                            help,
		Buckets:                         latencyBuckets,
		NativeHistogramBucketFactor:     1.1,
		NativeHistogramMaxBucketNumber:  160,
		NativeHistogramMinResetDuration: time.Hour,
	}
}

// New builds the registry and points the Observe hooks of the server and
// engines in cfg at its histograms (after any hook already set), so it must
// be called before they serve. Every label combination the configuration
// implies is created with value 0.
func New(cfg Config) *Metrics {
	m := &Metrics{reg: prometheus.NewRegistry()}
	devices := deviceNames(cfg)
	live := func() map[string]bool { return liveDevices(cfg) }
	m.reg.MustRegister(
		collectors.NewGoCollector(),
		collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}),
		newStatsCollector(cfg, devices, buildVersion(cfg.Version)),
	)

	if s := cfg.Server; s != nil {
		m.requestSeconds = newHistograms(histogramOpts(
			"nbdmapper_request_duration_seconds",
			"Time from decoding an NBD request to queueing its reply, by export and op."),
			[]string{"export", "op"}, func() map[string]bool {
				return names(s.ExportList(), func(x *nbdtarget.Export) string { return x.Name })
			})
		m.reg.MustRegister(m.requestSeconds)
		for _, x := range s.ExportList() {
			for _, op := range requestOps() {
				m.requestSeconds.observer(key{x.Name, op})
			}
		}
		prev := s.Observe
		s.Observe = func(export, op string, bytes int64, errno uint32, d time.Duration) {
			if prev != nil {
				prev(export, op, bytes, errno, d)
			}
			m.ObserveRequest(export, op, bytes, errno, d)
		}
	}
	if e := cfg.Flush; e != nil {
		m.syncSeconds = newHistograms(histogramOpts(
			"nbdmapper_device_sync_duration_seconds",
			"Time one sync (fdatasync) of a backing device took."),
			[]string{"device"}, live)
		m.reg.MustRegister(m.syncSeconds)
		for _, d := range devices {
			m.syncSeconds.observer(key{d})
		}
		prev := e.Observe
		e.Observe = func(device string, d time.Duration) {
			if prev != nil {
				prev(device, d)
			}
			m.ObserveSync(device, d)
		}
	}
	if e := cfg.Discard; e != nil {
		m.discardSeconds = newHistograms(histogramOpts(
			"nbdmapper_device_discard_duration_seconds",
			"Time one discard or zeroing call on a backing device took, by op (discard, zero)."),
			[]string{"device", "op"}, live)
		m.reg.MustRegister(m.discardSeconds)
		for _, d := range devices {
			for _, op := range discardOps {
				m.discardSeconds.observer(key{d, op})
			}
		}
		prev := e.Observe
		e.Observe = func(device, op string, d time.Duration) {
			if prev != nil {
				prev(device, op, d)
			}
			m.ObserveDiscard(device, op, d)
		}
	}
	if sc := cfg.Remotes; sc != nil {
		m.remoteSeconds = newHistograms(histogramOpts(
			"nbdmapper_remote_round_trip_seconds",
			"Time from sending a request to a remote export to its last reply, by remote device and op."),
			[]string{"device", "op"}, func() map[string]bool { return names(sc.Devices(), (*remote.Device).Name) })
		m.reg.MustRegister(m.remoteSeconds)
		for _, d := range sc.Devices() {
			for _, op := range remote.Ops() {
				m.remoteSeconds.observer(key{d.Name(), op})
			}
		}
		sc.Observe(m.ObserveRemote)
	}
	return m
}

// liveDevices names the backing devices open now: those the tables use,
// and those the engines know of (a table's devices are open until it is
// closed; the engines forget a device once it is).
func liveDevices(cfg Config) map[string]bool {
	set := names(deviceNames(cfg), func(n string) string { return n })
	if e := cfg.Flush; e != nil {
		for _, d := range e.Stats().Devices {
			set[d.Name] = true
		}
	}
	if e := cfg.Discard; e != nil {
		for _, d := range e.Stats().Devices {
			set[d.Name] = true
		}
	}
	return set
}

// names is the set of the names of xs.
func names[T any](xs []T, name func(T) string) map[string]bool {
	set := make(map[string]bool, len(xs))
	for _, x := range xs {
		set[name(x)] = true
	}
	return set
}

// requestOps are the op label values of the request histogram: every op
// the server reports except DISC, which has no reply and so no duration.
func requestOps() []string {
	var ops []string
	for _, op := range nbdtarget.Ops {
		if op != "disc" {
			ops = append(ops, op)
		}
	}
	return ops
}

// discardOps are the op label values of the discard engine's calls.
var discardOps = []string{discard.OpDiscard.String(), discard.OpZero.String()}

// deviceNames lists every backing device the tables use, by name, in order
// of first use: the device label values known from the start.
func deviceNames(cfg Config) []string {
	if cfg.Server == nil {
		return nil
	}
	var names []string
	seen := make(map[string]bool)
	for _, x := range cfg.Server.ExportList() {
		for _, d := range x.Dev.Table().Devices() {
			if n := d.Name(); !seen[n] {
				seen[n] = true
				names = append(names, n)
			}
		}
	}
	return names
}

func buildVersion(v string) string {
	if v != "" {
		return v
	}
	if bi, ok := debug.ReadBuildInfo(); ok && bi.Main.Version != "" {
		return bi.Main.Version
	}
	return "unknown"
}

// ObserveRequest records one completed NBD request; it is the protocol
// server's Observe hook. bytes and errno are counted by the server's own
// Stats; only the duration is recorded here.
func (m *Metrics) ObserveRequest(export, op string, bytes int64, errno uint32, d time.Duration) {
	m.requestSeconds.observer(key{export, op}).Observe(d.Seconds())
}

// ObserveSync records one sync of a backing device; it is the flush
// engine's Observe hook.
func (m *Metrics) ObserveSync(device string, d time.Duration) {
	m.syncSeconds.observer(key{device}).Observe(d.Seconds())
}

// ObserveDiscard records one discard or zeroing call on a backing device;
// it is the discard engine's Observe hook.
func (m *Metrics) ObserveDiscard(device, op string, d time.Duration) {
	m.discardSeconds.observer(key{device, op}).Observe(d.Seconds())
}

// ObserveRemote records one request's round trip to a remote export; it
// is the remote scheme's Observe hook.
func (m *Metrics) ObserveRemote(device, op string, d time.Duration) {
	m.remoteSeconds.observer(key{device, op}).Observe(d.Seconds())
}

// Gatherer is the registry, for tests and for embedding in another handler.
func (m *Metrics) Gatherer() prometheus.Gatherer { return m.reg }

// Handler serves the registry in the Prometheus text format, OpenMetrics
// or protobuf (native histograms need protobuf), as the scraper asks.
func (m *Metrics) Handler() http.Handler {
	return promhttp.HandlerFor(m.reg, promhttp.HandlerOpts{
		Registry:          m.reg, // promhttp_metric_handler_errors_total
		EnableOpenMetrics: true,
	})
}

// Serve serves /metrics (and Routes) on l until ctx is done, then shuts the HTTP server
// down. It returns nil after a shutdown caused by ctx.
func (m *Metrics) Serve(ctx context.Context, l net.Listener) error {
	mux := http.NewServeMux()
	mux.Handle("/metrics", m.Handler())
	paths := []string{"/metrics"}
	for path, h := range m.Routes {
		mux.Handle(path, h)
		paths = append(paths, path)
	}
	slices.Sort(paths)
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/" {
			http.NotFound(w, r)
			return
		}
		w.Header().Set("Content-Type", "text/html; charset=utf-8")
		io.WriteString(w, "<html><body>")
		for _, p := range paths {
			fmt.Fprintf(w, "<a href=%q>%s</a><br>\n", p, p)
		}
		io.WriteString(w, "</body></html>\n")
	})
	logger := m.Logger
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	// Failed TLS handshakes and the like are the client's problem: debug.
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second,
		ErrorLog: slog.NewLogLogger(logger.Handler(), slog.LevelDebug)}
	shut := make(chan struct{})
	stop := context.AfterFunc(ctx, func() {
		defer close(shut)
		sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		srv.Shutdown(sctx)
	})
	err := web.Serve(l, srv, &web.FlagConfig{WebConfigFile: &m.WebConfigFile}, logger)
	if !stop() {
		<-shut // ctx ended: wait until Shutdown has drained the connections
		return nil
	}
	if errors.Is(err, http.ErrServerClosed) {
		return nil
	}
	return err
}

// ValidateWebConfig checks a web configuration file as Serve will read it,
// so that a bad file is an error at startup rather than a log line at the
// first scrape.
func ValidateWebConfig(path string) error {
	if err := web.Validate(path); err != nil {
		return fmt.Errorf("web config %s: %w", path, err)
	}
	return nil
}
