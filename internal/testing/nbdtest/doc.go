// Package nbdtest gives tests real NBD peers to talk to: a python3 that has
// libnbd's bindings and nbdsh commands run with it, the nbdmapper binary
// built from this module, `nbdmapper serve` as a child process, an
// in-process server on a fresh unix socket, and other NBD servers (nbdkit
// with its log filter, qemu-nbd) as the remote exports of a table (Peer).
//
// It sits beside the data flow, not in it: only test files import it, and
// it imports nothing from this module, so that the tests of any package
// (nbdtarget's own included) can use it without an import cycle.
//
//	bin := nbdtest.Binary(t)                     // go build ./cmd/nbdmapper
//	s := nbdtest.Start(t, bin, dir, "d=d.table") // nbdmapper serve --socket dir/nbd.sock d=d.table
//	out, err := nbdtest.Nbdsh(t, "-u", s.URI("d"), "-c", "h.flush()").CombinedOutput()
//	s.Stop(t)                                    // SIGTERM, clean exit required
package nbdtest
