package backing

import (
	"errors"
	"io"

	"golang.org/x/sys/unix"
)

// WriteAtDSync writes p at off and returns once that data is durable, with
// pwritev2(RWF_DSYNC): the kernel writes back and flushes just this range,
// not every dirty page of the file as fdatasync would. It serves NBD FUA
// writes (flush.Engine.WriteFUA). Kernels without pwritev2 flags fall back
// to a write and an fdatasync.
func (d *File) WriteAtDSync(p []byte, off int64) (int, error) {
	n := 0
	for n < len(p) {
		m, err := unix.Pwritev2(d.fd, [][]byte{p[n:]}, off+int64(n), unix.RWF_DSYNC)
		switch {
		case err == unix.EINTR:
			continue
		case n == 0 && (errors.Is(err, unix.EOPNOTSUPP) || errors.Is(err, unix.ENOSYS)):
			if n, err = d.WriteAt(p, off); err != nil {
				return n, err
			}
			return n, d.Sync()
		case err != nil:
			return n, err
		case m == 0:
			return n, io.ErrShortWrite
		}
		n += m
	}
	return n, nil
}

// WriteAtDSync writes p at off straight through the cache: it is cached like
// any write and then the whole cache is synced, so the write (and every
// write before it) survives a Crash once this returns.
func (f *Faulty) WriteAtDSync(p []byte, off int64) (int, error) {
	n, err := f.WriteAt(p, off)
	if err != nil {
		return n, err
	}
	return n, f.Sync()
}
