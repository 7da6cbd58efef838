package main

import (
	"flag"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"github.com/nbdmapper/nbdmapper/backing"
	"github.com/nbdmapper/nbdmapper/rbd"
	"github.com/nbdmapper/nbdmapper/remote"
)

// remoteFlags are serve's settings for table devices that are NBD URIs
// (package remote; docs/remote.md) and, for their deadline, rbd: images
// (package rbd; docs/ceph.md).
type remoteFlags struct {
	connections int
	timeout     time.Duration
	backoffMax  time.Duration
	queueDepth  int
}

func (f *remoteFlags) register(fs *flag.FlagSet) {
	fs.IntVar(&f.connections, "remote-connections", remote.DefaultConnections, "connections to each remote export that advertises CAN_MULTI_CONN (others get one)")
	fs.DurationVar(&f.timeout, "remote-timeout", remote.DefaultTimeout, "deadline of each request to a remote export or rbd: image, reconnections and retries included; then EIO")
	fs.DurationVar(&f.backoffMax, "remote-backoff-max", remote.DefaultBackoffMax, "longest wait between attempts to reconnect to a remote export")
	fs.IntVar(&f.queueDepth, "remote-queue-depth", remote.DefaultQueueDepth, "requests in flight on each connection to a remote export")
}

func (f *remoteFlags) check() error {
	if f.connections < 1 || f.connections > 64 {
		return fmt.Errorf("--remote-connections %d: want 1 to 64", f.connections)
	}
	if f.timeout <= 0 {
		return fmt.Errorf("--remote-timeout %v: want a positive duration", f.timeout)
	}
	if f.backoffMax <= 0 {
		return fmt.Errorf("--remote-backoff-max %v: want a positive duration", f.backoffMax)
	}
	if f.queueDepth < 1 || f.queueDepth > 1024 {
		return fmt.Errorf("--remote-queue-depth %d: want 1 to 1024", f.queueDepth)
	}
	return nil
}

// scheme is the opener of NBD URIs that serve's pool asks first.
func (f *remoteFlags) scheme(log *slog.Logger, onPanic func(v any, stack []byte)) *remote.Scheme {
	return &remote.Scheme{Options: remote.Options{
		Connections: f.connections,
		Timeout:     f.timeout,
		BackoffMax:  f.backoffMax,
		QueueDepth:  f.queueDepth,
		Logger:      log,
		OnPanic:     onPanic,
	}}
}

// rbdScheme is the opener of rbd: images (package rbd), whose requests
// share remote exports' deadline.
func (f *remoteFlags) rbdScheme() *rbd.Scheme {
	return &rbd.Scheme{Options: rbd.Options{Timeout: f.timeout}}
}

// remoteLines lists the remote exports among devs, one status line each:
// `remote URI: STATE connections N/M reconnects R retries T timeouts O
// rtt MEAN unflushed U`, and `lost: ERROR` once flushes of it fail.
func remoteLines(devs []backing.Device, s *remote.Scheme) string {
	if s == nil {
		return ""
	}
	byName := make(map[string]remote.Stats)
	for _, st := range s.Stats() {
		byName[st.Name] = st
	}
	var b strings.Builder
	for _, d := range devs {
		st, ok := byName[d.Name()]
		if !ok {
			continue
		}
		rtt := time.Duration(0)
		if st.RoundTrips > 0 {
			rtt = time.Duration(st.RoundTripSeconds / float64(st.RoundTrips) * float64(time.Second))
		}
		fmt.Fprintf(&b, "remote %s: %s connections %d/%d reconnects %d retries %d timeouts %d rtt %v in flight %d unflushed %d",
			st.Name, st.State, st.Connections, st.Wanted, st.Reconnects, st.Retries, st.Timeouts, rtt.Round(time.Microsecond), st.InFlight, st.Unflushed)
		if st.Lost {
			fmt.Fprintf(&b, " lost: %s", strings.ReplaceAll(st.LostError, "\n", " "))
		} else if st.State != remote.StateUp && st.LastError != "" {
			fmt.Fprintf(&b, " last error: %s", strings.ReplaceAll(st.LastError, "\n", " "))
		}
		b.WriteByte('\n')
	}
	return b.String()
}

// logRemoteStats logs each remote export's counters at shutdown.
func logRemoteStats(log *slog.Logger, s *remote.Scheme) {
	for _, st := range s.Stats() {
		log.Info("remote", "device", st.Name, "state", st.State, "connects", st.Connects, "reconnects", st.Reconnects,
			"drops", st.Drops, "dial_errors", st.DialErrors, "retries", st.Retries, "timeouts", st.Timeouts,
			"flushes", st.Requests["flush"], "trims", st.Requests["trim"], "writes", st.Requests["write"],
			"reads", st.Requests["read"], "error_replies", st.ErrorReplies, "lost", st.Lost)
	}
}
