package backing

import (
	"errors"
	"fmt"
	"io"
)

// ErrNotSupported is returned by Discard and Zero when the device cannot do
// the operation natively (for example a filesystem without hole punching, or
// a disk without discard). Callers treat it as "skip and count", not as an
// I/O error.
var ErrNotSupported = errors.New("operation not supported by device")

// ErrNoDescriptor is returned by File.WriteAtDSync, having written nothing,
// when it cannot have a descriptor of its own for the write (the process is
// out of them). The caller writes and syncs the usual way instead, this
// once.
var ErrNoDescriptor = errors.New("no descriptor of its own for a durable write")

// ID identifies an underlying file or block device, independent of the path
// used to reach it: (st_dev, st_ino) for files, st_rdev for block devices,
// the normalized URI for an export of another NBD server (package remote).
// Two paths to the same file or device have equal IDs.
type ID struct {
	Block bool   // a block device: Dev is st_rdev and Ino is 0
	Dev   uint64 // st_dev for files, st_rdev for block devices
	Ino   uint64 // st_ino for files
	URI   string // a remote export: its normalized URI; Dev and Ino are 0
}

func (id ID) String() string {
	if id.URI != "" {
		return id.URI
	}
	if id.Block {
		return fmt.Sprintf("blk:%d:%d", major(id.Dev), minor(id.Dev))
	}
	return fmt.Sprintf("file:%d:%d/%d", major(id.Dev), minor(id.Dev), id.Ino)
}

// Linux's encoding of dev_t (glibc's gnu_dev_major/minor).
func major(dev uint64) uint64 { return ((dev >> 32) & 0xfffff000) | ((dev >> 8) & 0xfff) }
func minor(dev uint64) uint64 { return ((dev >> 12) & 0xffffff00) | (dev & 0xff) }

// Limits describes how a device wants discards shaped, and what a request
// holds inside it. A discard engine cuts ranges inward to Granularity and
// splits them at MaxBytes.
type Limits struct {
	Granularity int64 // discard alignment and minimum size in bytes; >= 1
	MaxBytes    int64 // largest single discard call in bytes; 0 means no limit
	// DiscardZeroes: a Discard that succeeded leaves its range reading as
	// zeros and its whole blocks unallocated (a regular file's PUNCH_HOLE,
	// a Mem's pages), so that a HoleMap may count them as holes.
	DiscardZeroes bool
	// RequestMemory is the most memory one request holds inside the
	// device beyond the caller's buffer (a remote's unaligned head and
	// tail blocks), for the server to charge to its memory budget.
	RequestMemory int64
}

// Range is a byte range [Off, Off+Len) on one device.
type Range struct {
	Off, Len int64
}

// End is the first byte past the range.
func (r Range) End() int64 { return r.Off + r.Len }

// Device is a backing file or block device. Offsets and lengths are in bytes.
// Implementations must be safe for concurrent use: nbdmapper issues many
// requests to one device at once.
type Device interface {
	io.ReaderAt
	io.WriterAt

	// Name is the path the device was first opened by, for logs and labels.
	Name() string
	// ID is the identity used to open each underlying device once.
	ID() ID
	// Size is the device size in bytes.
	Size() int64

	// Sync makes every write that completed before the call durable
	// (fdatasync for files and block devices).
	Sync() error
	// Discard deallocates [off, off+n); later reads of it may return
	// anything. ErrNotSupported if the device cannot discard.
	Discard(off, n int64) error
	// Zero makes [off, off+n) read back as zeros. With mayPunch the device
	// may deallocate the range; without it the blocks stay allocated.
	// ErrNotSupported if there is no fast native way: the caller then writes
	// zeros itself, or fails a FAST_ZERO request.
	Zero(off, n int64, mayPunch bool) error
	// Holes returns the holes (unallocated ranges, which read as zeros)
	// inside [off, off+n), ascending. A device that cannot tell returns nil.
	Holes(off, n int64) ([]Range, error)
	// Limits reports the device's discard limits.
	Limits() Limits

	Close() error
}

// FastZeroer is implemented by devices whose Zero is native but not always
// fast, and which can tell in advance when it would not be: an export of
// another NBD server that advertises FAST_ZERO. ZeroFast zeroes
// [off, off+n) like Zero only where that is fast, and otherwise fails with
// ErrNotSupported, so that an NBD FAST_ZERO request can fail at once
// instead of waiting for zeros to be written. Such a device's Zero never
// returns ErrNotSupported for slowness.
type FastZeroer interface {
	ZeroFast(off, n int64, mayPunch bool) error
}
