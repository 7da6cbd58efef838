// Package nbdtarget serves tables as NBD exports: the fixed-newstyle
// handshake, the transmission phase with pipelined, out-of-order replies, and
// validation of every request at the protocol edge.
//
//	client -> nbdtarget -> table -> flush / discard -> backing
//
// wire.go holds the whole wire format (magics, options, replies, flags,
// commands, errnos and message layouts). handshake.go negotiates an export
// (GO, INFO, LIST, ABORT, EXPORT_NAME, STRUCTURED_REPLY, LIST/SET_META_CONTEXT
// for base:allocation). transmit.go runs one connection: a reader goroutine
// decodes requests and reads write payloads, checks each once (check) and hands
// it to a worker; workers call the Export and write replies under a mutex as
// they finish. Two requests on one connection:
//
//	reader   READ h=1 @0..4K    WRITE h=2 @8K..12K + payload
//	worker1  [ReadAt ........................] reply h=1
//	worker2            [WriteAt ...] reply h=2
//	wire     .................................. h=2 ... h=1
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
