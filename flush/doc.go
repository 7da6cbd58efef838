// Package flush turns an NBD flush into the fewest syncs that keep its
// guarantee: every write, write-zeroes or trim that was acknowledged before
// the flush arrived is on stable storage before the flush is answered.
//
//	client -> nbdtarget -> table -> flush / discard -> backing
//
// The engine sits between the table (which knows which backing devices an
// export uses) and the backing devices (which know how to sync). It is shared
// by every connection and every export of a server, because dirtiness is a
// property of a disk, not of the connection that wrote to it: NBD's
// CAN_MULTI_CONN promises that a flush on one connection covers writes
// acknowledged on all of them.
//
// # Why
//
// device-mapper before Linux 6.11 sent one empty flush per target, so a table
// of 1024 linear segments on one disk turned every fsync into 1024 flushes
// of that disk. Linux 6.11 sends one flush per device in the table. This
// engine goes further in two ways: a device that nothing has written since
// its last sync is not synced at all, and flushes that arrive while a sync of
// a device is running share the next sync instead of each issuing their own.
//
// # Algorithm
//
// Each tracked device keeps two numbers:
//
//	written  how many writes (WriteAt, Discard, Zero) have completed on it;
//	         bumped after the inner call returns, so before the client is
//	         answered
//	synced   the value of written read just before the last successful
//	         sync was issued: every write counted there is durable
//
// A flush reads need = written of each device as it arrives. A device with
// need <= synced is clean for this flush and skipped. Otherwise the flush
// needs a sync that starts after its arrival, or the running one if that
// one's start value is already >= need (which, because written only grows,
// means nothing completed between that sync's start and the flush's
// arrival). At most one sync of a device is in flight; flushes that arrive
// during it queue for the next one, and the next sync serves every one of
// them. A write that completes during a sync bumps written past the sync's
// start, so the device stays dirty.
//
// Worked example, one device; writes w1..w4 come from any connections,
// flushes F1..F5 too; [---] is a sync in flight:
//
//	time     ----------------------------------------------------------------------------------->
//	writes   w1 w2                       w3                w4
//	written   1  2                        3                 4
//	flushes                 F1    F2           F3                 F4                         F5
//	need                     2     2            3                  4                          4
//	syncs                   [----- S1 start=2 -----][----- S2 start=3 -----][- S3 start=4 -]
//	synced    0                                    2                       3               4
//
//	F1  need 2 > synced 0, nothing running: starts S1, which covers 2 writes.
//	F2  need 2 <= S1's start 2: nothing completed since S1 began; joins S1.
//	w3  completes during S1: written 3 > 2, so the device stays dirty.
//	F3  need 3 > S1's start: queues the next sync.
//	S1  ends: synced = 2, F1 and F2 are answered; the queued S2 starts at
//	    once with start = written = 3 and will answer F3.
//	w4  completes during S2; F4 (need 4 > 3) queues S3, which starts when
//	    S2 ends. Had ten flushes arrived during S2, S3 would serve them all.
//	F5  need 4 <= synced 4: skipped, no sync at all.
//
// Five flushes cost three syncs, never two at once on the device, and a
// flush on a device nobody wrote to since its last sync costs nothing.
//
// # FUA
//
// A FUA write must be durable before it is answered, but nothing else need
// be. WriteFUA sends a write that lands on one device with pwritev2
// RWF_DSYNC (the kernel writes back and flushes just that range) and leaves
// the device's dirty state alone, since that write needs no later flush.
// Devices without it, and writes spanning several devices, are written and
// then flushed on just the devices they touched.
//
// # Errors
//
// A failed sync fails every flush waiting for it. It is also sticky: Linux
// may drop dirty pages after a failed fdatasync and report success on the
// next one, so writes acknowledged before the failure may be gone without
// any later sync noticing. Every later flush of that device therefore fails
// too, as PostgreSQL does since "fsyncgate". A failed durable write of
// WriteFUA does the same (see failsDevice): it may have consumed the very
// write-back error the next fdatasync would have reported. A sync and a
// durable write of one device that overlap in the device can take each
// other's error in the same way, so one that returns 0 is answered only
// once every call of the other kind it overlapped is out of the device,
// and fails if the device failed by then (tracked.settle). A panic in a
// sync counts as a failed sync; a panic in any device call becomes an error
// wrapping backing.ErrPanic and is reported to Engine.OnPanic, on whichever
// goroutine it happened. docs/flush.md has the table of faults.
//
// # Plans and stats
//
// (*Engine).Plan computes what a flush would do now without doing it, and
// FlushPlan returns what a flush did; both are plain printable values, so
// tests compare them with golden files. Stats returns plain counters for the
// metrics package.
package flush
