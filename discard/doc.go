// Package discard turns TRIM and WRITE_ZEROES requests into the fewest,
// best-ordered calls on each backing device.
//
//	client -> nbdtarget -> table -> flush / discard -> backing
//
// A table scatters one virtual range over many device ranges, and clients
// send many small trims; issued as they come, the device sees random-order
// discards of pieces that are often smaller than it can deallocate (mkfs.btrfs,
// discarding once per DUP mirror, alternates between two far-apart offsets;
// docs/decisions/discard-group-commit.md). So trims are batched by group commit, per
// device: a trim's part for a device with no discard in flight is issued at
// once, and the parts that arrive while the device has discards in flight
// gather into the device's batch, issued as soon as the discards that were
// in flight on that device when it began have completed (Engine.Window
// instead holds the batches open for a fixed time). Per device, so that a
// device whose discards are slow or hang holds back only its own trims: a
// trim of another device never waits for it, and a trim over both is
// issued at once on the idle one and answered when both are done. Each
// device's batch is planned:
//
//  1. sort the device's ranges ascending and merge overlapping and adjacent
//     ones (Merge);
//  2. take out any range a write claimed while the trim waited (Subtract);
//  3. cut each range inward to the device's discard granularity and split it
//     at the device's maximum discard size (Align). A discard is advisory,
//     so shrinking is allowed; merging comes first so that adjacent pieces
//     smaller than a granule still add up to whole granules.
//
// Each device's calls are made in ascending order, and a trim is answered
// when the batches of every device it touched are done; the batches of
// different devices are issued independently and concurrently.
//
// Worked example: three trims gather on a device with a 4 KiB granularity,
// and a write to 20K+2K arrives while they wait. One column is 1 KiB; | marks
// a granule boundary:
//
//	           |...|...|...|...|...|...|
//	in                         [------]      trim 1: 16K+8K
//	in          [-------]                    trim 2:  1K+9K
//	in                   [---]               trim 3: 10K+5K
//	claimed                        []        write:  20K+2K
//	merged      [------------] [--]  []      1K+14K 16K+4K 22K+2K
//	calls          [------]    [--]          4K+8K  16K+4K
//
// Three trims become two calls, ascending; the written bytes are never
// discarded; 1K..4K, 12K..15K and 22K..24K are not whole granules and are
// left alone.
//
// (discard/testdata holds these drawings for every planner case; Plan.String
// prints them.)
//
// Ordering with writes. NBD leaves the order of requests in flight together
// to the server, but a write that arrives while a trim is still held here
// must not be undone by it. The write path calls Claim before touching a
// device: Claim cuts the range out of the device's gathering batch, and
// waits for any discard already issued that overlaps it. A trim that
// arrives after the Claim is concurrent with the write, so either outcome
// is correct.
//
// A device that answers backing.ErrNotSupported is remembered and skipped
// from then on, and counted, not reported: a discard is only a hint.
//
// Failures. A device's error reaches exactly the trims and write-zeroes that
// waited for that device's calls; other devices in the same batch are
// unaffected. A panic in a device call, on whatever goroutine the engine
// made it (the caller's, one per further device, or, for Limits, the batch
// timer's or a Claim's), becomes an error wrapping backing.ErrPanic and is
// reported to Engine.OnPanic; the in-flight bookkeeping is released as
// after any call.
//
// Memory. What gathers is bounded by Engine.MaxRanges and MaxBytes per
// device (with a window, over all devices): a device's full batch is issued
// alone, so a healthy device's trims never push out the batch gathering
// behind a hung one. The devices are the tables', so the bound does not
// depend on what clients send. The ranges written while a batch gathers are
// merged whenever they double, so a batch holds at most max(2*MaxRanges, 64)
// of them however many writes arrive, and one holding more than MaxRanges
// merged is issued early. A plan holds one range per merged range: a range
// longer than the device's MaxBytes is split into calls only as they are
// issued. Written zeros come from one shared read-only buffer
// (backing.WriteZeros).
//
// WRITE_ZEROES shares the planning but not the cutting (every byte must read
// back as zeros) and is not held back: Zero tries the device's native
// zeroing (punching holes unless NO_HOLE) and falls back to writing zeros,
// or, for FAST_ZERO, fails with backing.ErrNotSupported instead.
package discard
