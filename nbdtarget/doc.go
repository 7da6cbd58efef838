// Package nbdtarget serves tables as NBD exports: the fixed-newstyle
// handshake, the transmission phase with pipelined, out-of-order replies, and
// validation of every request at the protocol edge.
//
//	client -> nbdtarget -> table -> flush / discard -> backing
package nbdtarget
