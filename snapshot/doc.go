// Package snapshot implements device-mapper's snapshot, snapshot-origin and
// snapshot-merge targets as stacked backing devices, with exception stores
// byte-compatible with dm-snapshot's: a COW device written here can be
// activated (and merged) by the kernel's dm-snapshot, and one the kernel
// wrote can be served (and merged) here.
//
//	client -> nbdtarget -> table -> flush / discard -> backing
//	                         |                            ^
//	                         +-> snapshot.Snapshot -------+  (a stacked Device:
//	                             snapshot.Origin             COW logic inside,
//	                                                         real devices below)
//
// The table package's snapshot and snapshot-origin targets map their whole
// line to one extent on a Snapshot or Origin, which are backing.Devices
// whose ReadAt and WriteAt do the copy-on-write work on the origin and COW
// devices below them. Everything above (the export, the flush and discard
// engines) treats them like any other device; their Devices methods name
// the real devices underneath, so that a flush reaches those, deduplicated
// with everything else.
//
// Snapshots of one origin find each other through a per-process registry
// keyed by the origin's backing.ID, as dm finds them through the origin's
// block device: a snapshot-origin loaded in one table copies chunks out to
// snapshots loaded in others.
//
// Stores (see format.go for the persistent layout):
//
//	P   persistent: exceptions are committed to metadata areas on the COW
//	    device before a write is acknowledged; a full COW invalidates the
//	    snapshot (status "Invalid", all I/O fails, valid = 0 on disk).
//	PO  persistent with overflow: a full COW fails snapshot writes and
//	    reports "Overflow"; reads keep working. A copy-out from the origin
//	    that does not fit still invalidates, as in dm.
//	N   transient: exceptions in memory only; chunks allocated from 0.
//
// Exceptions of concurrent first writes are committed together, in
// allocation order (pending.go); a snapshot-merge device merges its COW
// back into the origin in the background, in the kernel's order and with
// its on-disk steps (merge.go); a snapshot loaded on a COW another one
// uses takes that one's store over when activated (handover.go).
// Settings shared by the whole process, such as the merge rate, are set
// with Configure; Stats counts commits, batching and merges.
package snapshot
