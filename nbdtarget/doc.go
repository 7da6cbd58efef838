// Package nbdtarget serves tables as NBD exports: the fixed-newstyle
// handshake, the transmission phase with pipelined, out-of-order replies, and
// validation of every request at the protocol edge.
//
//	client -> nbdtarget -> table -> flush / discard -> backing
//
// wire.go holds the whole wire format (magics, options, replies, flags,
// commands, errnos and message layouts). handshake.go negotiates an export
// (GO, INFO, LIST, ABORT, EXPORT_NAME, STRUCTURED_REPLY, LIST/SET_META_CONTEXT
// for base:allocation, STARTTLS). tls.go holds the rest of TLS: the
// off/on/require modes, certificates that reload while connections stay up,
// and per-export access by client certificate. transmit.go runs one connection on a leader/follower
// pool of goroutines: the one holding the read token decodes a request (and a
// write's payload), passes the token to another, checks the request once
// (check), calls the Export and writes the reply under a mutex, so replies
// leave as requests finish. Two requests on one connection:
//
//	g1    read h=1 READ @0..4K | [ReadAt ..........................] reply h=1
//	g2                           read h=2 WRITE @8K + payload | [WriteAt] reply h=2
//	wire  .................................................... h=2 ...... h=1
//
// A request the client may not send (bad range, flag or command, oversized,
// read-only) gets the spec's errno and the connection goes on; only a stream
// that can no longer be parsed (bad magic, bad client flags, EOF mid-message)
// ends the connection, and never another one. errnoOf is the one mapping
// from Go errors to NBD errors.
//
// Server.Stats gives plain counters per export and op; Server.Observe lets
// package metrics time each request without this package importing
// Prometheus.
package nbdtarget
