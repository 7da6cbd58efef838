// Package mapped is the live-device layer: a mapped device, as dm calls
// it, is one named virtual device with an active table that can change
// under its users. It sits between the protocol and the engines:
//
//	client -> nbdtarget (protocol) -> mapped.Device -> table (map) -> flush / discard -> backing
//
// A Device owns its active table (swapped atomically on resume), its place
// in the flush and discard engines, its in-flight accounting and its
// suspend state. It offers every request kind a client can send — read,
// write (with FUA), flush, trim, write-zeroes, cache, block status — each
// walking the table once, in bounded pieces where the range is long. The
// same object is the backing device that another table names as
// /dev/mapper/NAME, so a stacked device goes through the same mapping code
// as an export.
//
// Lifecycle, as dmsetup's:
//
//	Load(t)    hold t as the inactive table (reload)
//	Suspend()  stop admitting I/O, wait for I/O in flight, flush every
//	           device below; new I/O waits (it is held, not failed)
//	Resume()   make the inactive table active, if one is loaded, and
//	           release held I/O
//
// A request that entered before a resume finishes on the table it entered
// with; one that was validated against a larger table than the one it
// finds fails with ErrBeyondEnd.
package mapped
