package main

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"net/http"

	"github.com/nbdmapper/nbdmapper/discard"
	"github.com/nbdmapper/nbdmapper/flush"
	"github.com/nbdmapper/nbdmapper/metrics"
	"github.com/nbdmapper/nbdmapper/nbdtarget"
	"github.com/nbdmapper/nbdmapper/remote"
)

// defaultMetricsAddr is where serve exposes /metrics unless --metrics says
// otherwise: loopback only, since the metrics name files and exports.
const defaultMetricsAddr = "127.0.0.1:9810"

// startMetrics serves Prometheus metrics for srv and the engines at
// http://addr/metrics (https and/or basic auth per the web config file
// webConfig, if set), and routes beside it, until stop is called. It sets their Observe hooks, so
// call it after building them and before srv.Serve. addr "" or "off"
// disables metrics; stop is then a no-op. The listener is opened here, so a
// busy port is an error at startup rather than a log line later. A
// listener l passed by systemd, if not nil, is served instead of addr.
func startMetrics(addr, webConfig string, l net.Listener, log *slog.Logger, srv *nbdtarget.Server, f *flush.Engine, d *discard.Engine, r *remote.Scheme, routes map[string]http.Handler) (stop func(), err error) {
	if l == nil && (addr == "" || addr == "off") {
		return func() {}, nil
	}
	m := metrics.New(metrics.Config{Server: srv, Flush: f, Discard: d, Remotes: r})
	m.Routes = routes
	if webConfig != "" {
		if err := metrics.ValidateWebConfig(webConfig); err != nil {
			return nil, fmt.Errorf("--metrics-web-config: %w", err)
		}
		m.WebConfigFile, m.Logger = webConfig, log
	}
	if l == nil {
		if l, err = net.Listen("tcp", addr); err != nil {
			return nil, fmt.Errorf("--metrics: %w", err)
		}
	}
	log.Info("metrics", "addr", l.Addr().String(), "path", "/metrics", "web_config", webConfig)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		if err := m.Serve(ctx, l); err != nil {
			log.Error("metrics", "err", err)
		}
	}()
	return func() { cancel(); <-done }, nil
}
