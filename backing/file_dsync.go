package backing

import (
	"errors"
	"fmt"
	"io"

	"golang.org/x/sys/unix"
)

// WriteAtDSync writes p at off and returns once that data is durable, with
// pwritev2(RWF_DSYNC): the kernel writes back and flushes just this range,
// not every dirty page of the file as fdatasync would. It serves NBD FUA
// writes (flush.Engine.WriteFUA). Kernels without pwritev2 flags get
// ErrNotSupported and nothing written: the caller falls back to a write and
// a sync it tracks, so that a failure of that sync is remembered like any
// other (an untracked fdatasync here would consume the file's write-back
// error unseen).
//
// An error other than ErrNotSupported may come from the write or from its
// write-back: the caller must treat the range as possibly in the page cache
// and not durable, and the file's write-back error as consumed.
func (d *File) WriteAtDSync(p []byte, off int64) (int, error) {
	d.enter()
	defer d.exit()
	n := 0
	for n < len(p) {
		m, err := unix.Pwritev2(d.fd, [][]byte{p[n:]}, off+int64(n), unix.RWF_DSYNC)
		switch {
		case err == unix.EINTR:
			continue
		case n == 0 && (errors.Is(err, unix.EOPNOTSUPP) || errors.Is(err, unix.ENOSYS)):
			return 0, fmt.Errorf("pwritev2 RWF_DSYNC: %w", ErrNotSupported)
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
// write before it) survives a Crash once this returns. What is injected for
// OpDSync runs first (see Inject).
func (f *Faulty) WriteAtDSync(p []byte, off int64) (int, error) {
	if err := f.hook(OpDSync); err != nil {
		return 0, err
	}
	n, err := f.WriteAt(p, off)
	if err != nil {
		return n, err
	}
	return n, f.Sync()
}
