package backing

import "golang.org/x/sys/unix"

// Cacher is implemented by devices that can bring a range into their cache
// without the caller reading it (readahead), for NBD_CMD_CACHE.
type Cacher interface {
	Cache(off, n int64) error
}

// Wrapper is implemented by devices that wrap another one (embedding it and
// overriding some methods), so that helpers such as Cache and ReadSparse
// can reach an optional method of the device inside. A Wrapper must not
// change what reads of the device return: those helpers go past it.
type Wrapper interface {
	Unwrap() Device
}

// Cache brings [off, off+n) of d into its cache: natively where d, or a
// device it wraps, is a Cacher; otherwise by reading the range through buf
// (which must not be empty) and dropping the data. It fails where a read
// would.
func Cache(d Device, off, n int64, buf []byte) error {
	for inner := d; inner != nil; {
		if c, ok := inner.(Cacher); ok {
			return c.Cache(off, n)
		}
		w, ok := inner.(Wrapper)
		if !ok {
			break
		}
		inner = w.Unwrap()
	}
	for end := off + n; off < end; {
		m := min(end-off, int64(len(buf)))
		if _, err := d.ReadAt(buf[:m], off); err != nil {
			return err
		}
		off += m
	}
	return nil
}

// Cache starts readahead of [off, off+n) into the page cache
// (posix_fadvise WILLNEED) and returns without waiting for it.
func (d *File) Cache(off, n int64) error {
	s, err := d.enter("fadvise")
	if err != nil {
		return err
	}
	defer d.exit(s)
	return unix.Fadvise(d.fd, off, n, unix.FADV_WILLNEED)
}
