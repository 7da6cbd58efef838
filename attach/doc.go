// Package attach is the kernel side of nbdmapper: it connects an NBD export
// to a /dev/nbdX device so that filesystems, fio and dmsetup can use it.
//
//	mkfs / fio -> /dev/nbdX (kernel nbd) -> socket -> nbdtarget -> table -> ...
//
// It sits outside the server's data flow: it speaks only the NBD wire
// protocol, as a client, and drives the kernel through the same ioctls as
// nbd-client, in the same order:
//
//	handshake (OPT_GO)             size, transmission flags, block sizes
//	NBD_SET_BLKSIZE                512..4096, a power of two
//	NBD_SET_SIZE_BLOCKS            size / block size
//	NBD_CLEAR_SOCK                 forget any stale sockets
//	NBD_SET_FLAGS                  the server's transmission flags
//	NBD_SET_TIMEOUT                only when asked for
//	NBD_SET_SOCK                   once per connection
//	NBD_DO_IT                      blocks until disconnect
//
// NBD_SET_FLAGS is the step that matters for nbdmapper: without it the
// kernel believes the server has no FLUSH, FUA or TRIM, so fsync never
// reaches the backing disks and discards are silently dropped (go-nbd's
// client makes this mistake). Several connections are only accepted by the
// kernel when the server advertised CAN_MULTI_CONN.
package attach
