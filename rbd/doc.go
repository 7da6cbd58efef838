// Package rbd makes a Ceph RBD image a backing device: a table line whose
// device is written as qemu writes it,
//
//	rbd:POOL/IMAGE[@SNAP][:conf=FILE][:id=NAME][:keyring=FILE][:KEY=VALUE...]
//
// maps onto an image of a Ceph cluster, read and written through librbd
// (github.com/ceph/go-ceph) in the server's own process: no rbd-nbd,
// krbd or qemu-nbd in between, and no extra hop.
//
//	client -> nbdtarget -> mapped -> table -> flush / discard -> backing
//	                                                              |  Device (a file, a disk)
//	                                                              |- remote.Device -> NBD
//	                                                              `- rbd image -> librbd -> RADOS -> OSDs
//
// It sits at the bottom of the data flow beside backing's files and
// package remote's exports, and is reached the same way: a backing.Pool
// asks the Scheme that cmd/nbdmapper installs whether a name is an rbd:
// name. The Pool opens each image once, by the name's normal form (Name),
// so that to the flush engine it is one device (a client FLUSH calls
// rbd_flush once for each image written since its last flush, however many
// table lines map onto it) and to the discard engine too (trims merged per
// image become rbd_discard calls).
//
// # Build tag
//
// librbd is C: opening images needs cgo and Debian's librbd-dev and
// librados-dev, so it is built only with `-tags ceph`. Without the tag
// the names still parse (nbdmapper check reports malformed ones), and
// opening one fails with ErrNoCeph, which says how to build with it.
//
// # Failures
//
// librados retries a request itself while an OSD or monitor is away
// (resending it when the cluster map changes); the Scheme's Timeout bounds
// that (rados_osd_op_timeout, rados_mon_op_timeout, client_mount_timeout),
// after which the request fails and the client sees EIO. A write librbd
// acknowledged with its cache off is on the OSDs' disks; with the cache on
// (the conf file's `rbd cache`), rbd_flush writes it back, and a flush
// that fails fails every later flush of the image (the flush engine's
// sticky failure), so a lost write is never reported as flushed.
package rbd
