// Package discard turns TRIM and WRITE_ZEROES requests into the fewest,
// best-ordered calls on each backing device: ranges are collected per device,
// sorted ascending, merged and issued as a batch.
//
//	client -> nbdtarget -> table -> flush / discard -> backing
//
// PLACEHOLDER: issues each range at once; issue 4 replaces the internals
// (sorting, merging, alignment, cross-request coalescing, plans, stats)
// behind the same API.
package discard

import (
	"errors"

	"github.com/nbdmapper/nbdmapper/backing"
)

// Extent is a byte range on one backing device.
type Extent struct {
	Dev      backing.Device
	Off, Len int64
}

// Engine plans and issues discards and zeroing. One Engine is shared by
// every connection and export of a server.
type Engine struct{}

// New returns an engine with default settings.
func New() *Engine { return &Engine{} }

// Discard deallocates the extents (advisory: a device that cannot discard is
// skipped). It returns when every device call has completed.
func (e *Engine) Discard(exts []Extent) error {
	for _, x := range exts {
		if err := x.Dev.Discard(x.Off, x.Len); err != nil && !errors.Is(err, backing.ErrNotSupported) {
			return err
		}
	}
	return nil
}

// Zero makes the extents read back as zeros. mayPunch allows deallocation
// (NBD_CMD_WRITE_ZEROES without NO_HOLE). With fast, a device without a fast
// native zeroing method fails with backing.ErrNotSupported instead of having
// zeros written.
func (e *Engine) Zero(exts []Extent, mayPunch, fast bool) error {
	for _, x := range exts {
		err := x.Dev.Zero(x.Off, x.Len, mayPunch)
		if errors.Is(err, backing.ErrNotSupported) && !fast {
			err = writeZeros(x)
		}
		if err != nil {
			return err
		}
	}
	return nil
}

// Claim removes [off, off+n) on dev from any discard that is still pending,
// so that a write which arrived after a trim is never undone by it.
func (e *Engine) Claim(dev backing.Device, off, n int64) {}

func writeZeros(x Extent) error {
	const chunk = 1 << 20
	buf := make([]byte, min(chunk, x.Len))
	for off := x.Off; off < x.Off+x.Len; {
		n := min(int64(len(buf)), x.Off+x.Len-off)
		if _, err := x.Dev.WriteAt(buf[:n], off); err != nil {
			return err
		}
		off += n
	}
	return nil
}
