// Package snapshot implements device-mapper's snapshot and snapshot-origin
// targets as stacked backing devices, with exception stores byte-compatible
// with dm-snapshot's: a COW device written here can be activated by the
// kernel's dm-snapshot, and one the kernel wrote can be served here.
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
// Not implemented: snapshot-merge, and dm's exception handover between two
// tables sharing one COW device (a second snapshot on the same COW device
// is refused).
package snapshot
