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
// Each write goes through a descriptor of its own: an open file
// description of the file other than the one its other calls use, and
// than those of the durable writes beside it. The kernel reports a
// write-back error once per open file description (the errseq_t in its
// struct file), to whichever call on it checks first, so two durable writes
// on one descriptor could split an error: the one whose page was lost
// returns 0 if the other checked first. With a description each, every
// write sees every error since its description last checked, its own
// page's among them. The descriptors are opened as writes need them (at
// most DeviceCalls, the calls the File lets in at once) and kept for the
// next; ErrNoDescriptor, with nothing written, if one cannot be opened.
//
// An error other than ErrNotSupported and ErrNoDescriptor may come from the
// write or from its write-back: the caller must treat the range as possibly
// in the page cache and not durable, and the file's write-back error as
// consumed.
func (d *File) WriteAtDSync(p []byte, off int64) (int, error) {
	s, err := d.enter("pwritev2")
	if err != nil {
		return 0, err
	}
	defer d.exit(s)
	fd, err := d.takeDSync()
	if err != nil {
		return 0, err
	}
	defer d.putDSync(fd)
	n := 0
	for n < len(p) {
		m, err := unix.Pwritev2(fd, [][]byte{p[n:]}, off+int64(n), unix.RWF_DSYNC)
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

// takeDSync returns a free descriptor of the durable writes' own, opening
// one (through /proc/self/fd, so that it is this file whatever its path
// now names) if none is free.
func (d *File) takeDSync() (int, error) {
	select {
	case fd := <-d.dsync:
		return fd, nil
	default:
	}
	// With the file's own access mode: a file opened for reading only
	// must not become writable here (its write then fails with EBADF).
	fl, err := unix.FcntlInt(uintptr(d.fd), unix.F_GETFL, 0)
	if err != nil {
		return -1, fmt.Errorf("%s: %w: %w", d.name, ErrNoDescriptor, err)
	}
	fd, err := unix.Open(fmt.Sprintf("/proc/self/fd/%d", d.fd), fl&unix.O_ACCMODE|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, fmt.Errorf("%s: reopening for a durable write: %w: %w", d.name, ErrNoDescriptor, err)
	}
	return fd, nil
}

// putDSync keeps fd for the next durable write.
func (d *File) putDSync(fd int) {
	select {
	case d.dsync <- fd:
	default: // not reached: at most DeviceCalls are out at once
		unix.Close(fd)
	}
}

// closeDSync closes the free descriptors; no call is in progress (release).
func (d *File) closeDSync() {
	for {
		select {
		case fd := <-d.dsync:
			unix.Close(fd)
		default:
			return
		}
	}
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
