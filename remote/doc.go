// Package remote makes an export of another NBD server a backing device:
// a table line whose device is an NBD URI (nbd://host/export,
// nbd+unix:///export?socket=PATH, nbds:// and nbds+unix:// with TLS) maps
// onto another machine's disk.
//
//	client -> nbdtarget -> mapped -> table -> flush / discard -> backing
//	                                                              |  Device (a file, a disk)
//	                                                              `- remote.Device -> NBD -> nbdkit, qemu-nbd,
//	                                                                                        nbd-server, nbdmapper
//
// It sits at the bottom of the data flow beside backing's files, and is
// reached the same way: a backing.Pool asks the Scheme that cmd/nbdmapper
// installs whether a name is an NBD URI, so backing itself never imports
// this package. The Pool opens each export once, by the URI's normal form,
// so that to the flush engine it is one device (a client FLUSH sends one
// NBD_CMD_FLUSH to each dirty remote, concurrently, sharing it with
// flushes that arrive meanwhile) and to the discard engine too (trims
// merged per remote and cut at its limits).
//
// # The client
//
// Fixed newstyle, with NBD_OPT_GO and NBD_INFO_BLOCK_SIZE, structured
// replies and the base:allocation context (handshake.go); the wire numbers
// are package wire's, which the server shares. Requests are pipelined on
// each connection (conn.go) with a bounded number in flight, and spread
// over several connections when the server advertises CAN_MULTI_CONN.
// Every request is cut to the remote's block-size limits (io.go): aligned
// to its minimum block (heads and tails read, patched and written back),
// READ and WRITE no longer than its maximum payload or 32 MiB, commands
// without payload no longer than its maximum. FUA, TRIM, WRITE_ZEROES
// with FAST_ZERO, CACHE and BLOCK_STATUS are passed through where the
// remote advertises them. The reply parser (reply.go) checks every length
// against the request before it reads a payload byte, so nothing a remote
// sends can write outside a buffer or make it hold unbounded memory.
//
// # Failures
//
// A connection that fails (a read or write error, a protocol violation, a
// request without a reply past its deadline, ESHUTDOWN) is closed; its
// requests are sent again on another connection, or on the same slot once
// it reconnects, with exponential backoff between attempts. Each request
// has one deadline (Options.Timeout) from its first send: past it, it fails
// with ErrTimeout, which the NBD client sees as EIO. Nothing is retried
// without bound, and nothing waits without a deadline.
//
// Writes the remote acknowledged are in its cache until a flush; a remote
// that restarts loses them. NBD cannot tell a restart from a dropped
// connection, so the device assumes the worst: when a connection drops, or
// a new one is made, while acknowledged writes are not yet covered by a
// flush, every later flush of the device fails with ErrUnflushedLost —
// sticky, as a failed fdatasync is in the flush engine. Reads and writes
// go on once the remote is back; flushes of it do not come back until the
// server restarts, because no later flush could vouch for those writes.
//
//	writes    w1 w2                  w3 (waits, then goes on the new connection)
//	acked      1  2                      3
//	flushes          F (covers 2)                 F ok
//	flushed    0     2                            3
//	conn      [===== up ====X drop ~~ backoff ~~ [===== up =====
//	                         acked 2 = flushed 2: nothing unflushed, nothing lost
//
//	writes    w1 w2 w3 w4
//	conn      [===== up ====X drop ~~ backoff ~~ [===== up =====
//	                         acked 4 > flushed 0: every later flush fails
//
// Writes and write-zeroes count as unflushed until a flush covers them;
// trims (a trimmed range may read back as anything) and FUA writes
// (durable when acknowledged) do not.
//
// Every goroutine that touches the network (each connection's reader and
// watchdog, each slot's reconnection loop, the goroutines that send the
// pieces of a split request) contains its panics: a panic ends that
// connection or fails that request with EIO, never the server.
package remote
