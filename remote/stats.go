package remote

import (
	"time"

	"github.com/nbdmapper/nbdmapper/wire"
)

// State is a remote device's connection state.
type State string

const (
	StateUp       State = "up"       // every connection it wants is up
	StateDegraded State = "degraded" // some are up, the others reconnecting
	StateDown     State = "down"     // none is up: requests wait for a reconnection, within their deadline
	StateClosed   State = "closed"
)

// Stats are one remote device's counters, read by the metrics package and
// `nbdmapper status`.
type Stats struct {
	Name string // as the table named it
	URI  string // normal form: the identity
	Size int64

	State State
	// Connections are up now, of Wanted (Options.Connections with
	// CAN_MULTI_CONN, else 1).
	Connections, Wanted int
	// Connects counts connections made, the first ones included;
	// Reconnects those made after a loss; Drops connections lost;
	// DialErrors failed attempts to connect.
	Connects, Reconnects, Drops, DialErrors uint64
	// Retries counts requests sent again because their connection
	// dropped; Timeouts requests failed with EIO at their deadline.
	Retries, Timeouts uint64
	// Requests counts requests by op (read, write, flush, ...), once each
	// however often retried; ErrorReplies those the remote answered with
	// an error.
	Requests     map[string]uint64
	ErrorReplies uint64
	InFlight     int64
	// RoundTrips and RoundTripSeconds give the mean time from sending a
	// request to its last reply; LastRoundTrip is the latest one's.
	RoundTrips       uint64
	RoundTripSeconds float64
	LastRoundTrip    time.Duration
	// Unflushed is how many acknowledged writes and write-zeroes no flush
	// has covered yet (trims do not count: a lost trim loses no data).
	Unflushed uint64
	// Lost says a connection dropped or was remade with Unflushed > 0:
	// every flush of the remote fails from then on (LostError says when
	// and how many), until the server restarts.
	Lost      bool
	LostError string
	// LastError is the latest connection loss or failed attempt.
	LastError string
}

// Stats returns a snapshot of the device's counters.
func (d *Device) Stats() Stats {
	d.mu.Lock()
	up := 0
	var inflight int64
	for _, c := range d.conns {
		if c != nil {
			up++
			inflight += c.inflight.Load()
		}
	}
	s := Stats{
		Name: d.name, URI: d.id.URI, Size: d.size,
		Connections: up, Wanted: len(d.conns), LastError: d.lastErr, InFlight: inflight,
	}
	switch {
	case d.closed:
		s.State = StateClosed
	case up == len(d.conns):
		s.State = StateUp
	case up > 0:
		s.State = StateDegraded
	default:
		s.State = StateDown
	}
	d.mu.Unlock()
	s.Connects, s.Reconnects = d.st.connects.Load(), d.st.reconnects.Load()
	s.Drops, s.DialErrors = d.st.drops.Load(), d.st.dialErrors.Load()
	s.Retries, s.Timeouts, s.ErrorReplies = d.st.retries.Load(), d.st.timeouts.Load(), d.st.errorReplies.Load()
	s.Requests = make(map[string]uint64, wire.NumCmds)
	for i := range d.st.requests {
		if i != int(wire.CmdDisc) {
			s.Requests[wire.CmdNames[i]] = d.st.requests[i].Load()
		}
	}
	s.RoundTrips = d.st.roundTrips.Load()
	s.RoundTripSeconds = time.Duration(d.st.roundTripNanos.Load()).Seconds()
	s.LastRoundTrip = time.Duration(d.st.lastRoundTrip.Load())
	if a, f := d.acked.Load(), d.flushed.Load(); a > f {
		s.Unflushed = a - f
	}
	if err := d.gapErr(); err != nil {
		s.Lost, s.LostError = true, err.Error()
	}
	return s
}

// Ops lists the op names of Stats.Requests, in NBD command order.
func Ops() []string {
	var ops []string
	for i, n := range wire.CmdNames {
		if i != int(wire.CmdDisc) {
			ops = append(ops, n)
		}
	}
	return ops
}
