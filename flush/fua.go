package flush

import "github.com/nbdmapper/nbdmapper/backing"

// DSyncWriter is implemented by devices that can make a single write durable
// by itself (backing.File with pwritev2 RWF_DSYNC), without syncing whatever
// else is dirty on the device.
type DSyncWriter interface {
	WriteAtDSync(p []byte, off int64) (int, error)
}

// WriteFUA writes p at off on d and returns once that write is durable: the
// NBD FUA flag on a write that lands on one device. Where the device can, the
// write goes out with RWF_DSYNC, which costs one write-through of this range
// and leaves the device's dirty state alone (the write is durable, so no
// later flush needs to cover it). Otherwise it is a write followed by a
// flush of d alone, which shares syncs with concurrent flushes.
func (e *Engine) WriteFUA(d backing.Device, p []byte, off int64) error {
	if t := e.lookup(d); t != nil {
		if w, ok := t.Device.(DSyncWriter); ok {
			_, err := w.WriteAtDSync(p, off)
			if err != nil {
				// Part of it may sit in the page cache: count it as dirty.
				t.written.Add(1)
			}
			return err
		}
	}
	if _, err := d.WriteAt(p, off); err != nil {
		return err
	}
	return e.Flush([]backing.Device{d})
}
