package nbdtarget

import (
	"github.com/nbdmapper/nbdmapper/table"
)

// writeFUA makes a FUA write that lands on a single mapped extent durable by
// itself (flush.Engine.WriteFUA: RWF_DSYNC where the device can), instead of
// writing it and syncing the device. handled is false when the write spans
// several extents or touches a zero or error target; WriteAt then writes
// normally and flushes the devices it touched.
func (x *Export) writeFUA(p []byte, off int64) (handled bool, err error) {
	var ext table.Extent
	n := 0
	x.Table.Map(off, int64(len(p)), func(e table.Extent) bool {
		ext = e
		n++
		return n == 1
	})
	if n != 1 || ext.Kind != table.KindMapped {
		return false, nil
	}
	x.Discard.Claim(ext.Dev, ext.Off, ext.Len)
	return true, x.Flush.WriteFUA(ext.Dev, p, ext.Off)
}
