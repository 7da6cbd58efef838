package flush

import (
	"errors"

	"github.com/nbdmapper/nbdmapper/backing"
	"golang.org/x/sys/unix"
)

// DSyncWriter is implemented by devices that can make a single write durable
// by itself (backing.File with pwritev2 RWF_DSYNC), without syncing whatever
// else is dirty on the device. WriteAtDSync returns backing.ErrNotSupported,
// having written nothing, where the device cannot do it after all.
type DSyncWriter interface {
	WriteAtDSync(p []byte, off int64) (int, error)
}

// WriteFUA writes p at off on d and returns once that write is durable: the
// NBD FUA flag on a write that lands on one device. Where the device can, the
// write goes out with RWF_DSYNC, which costs one write-through of this range
// and leaves the device's dirty state alone (the write is durable, so no
// later flush needs to cover it). Otherwise it is a write followed by a
// flush of d alone, which shares syncs with concurrent flushes and, like
// any flush, fails the device if its sync fails.
//
// A failed durable write fails the device too (see failsDevice): every later
// flush of it returns ErrSyncFailed, and so does every FUA write, which
// cannot tell its own data from pages a failed sync dropped.
func (e *Engine) WriteFUA(d backing.Device, p []byte, off int64) error {
	if t := e.lookup(d); t != nil && !t.noDSync.Load() {
		if w, ok := t.Device.(DSyncWriter); ok {
			err := t.writeDurable(w, p, off)
			switch {
			case errors.Is(err, backing.ErrNotSupported):
				t.noDSync.Store(true) // nothing was written; write and flush
			case !errors.Is(err, backing.ErrNoDescriptor):
				return err
			} // ErrNoDescriptor: nothing was written; write and flush this once
		}
	}
	if err := e.write(d, p, off); err != nil {
		return err
	}
	return e.Flush([]backing.Device{d})
}

// writeDurable is WriteFUA's RWF_DSYNC path: the durable write, and what
// it does to the device when it fails.
func (t *tracked) writeDurable(w DSyncWriter, p []byte, off int64) error {
	t.mu.Lock()
	ticket := t.enter(durableCall)
	t.mu.Unlock()
	err := t.writeDSync(w, p, off)
	unsupported := errors.Is(err, backing.ErrNotSupported) || errors.Is(err, backing.ErrNoDescriptor)
	if err != nil && !unsupported {
		// Part of it may sit in the page cache: count it as dirty.
		t.written.Add(1)
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if err != nil && !unsupported && failsDevice(err) {
		t.failLocked(err)
	}
	// A sync of the device that fails meanwhile may take this write's pages
	// with it and consume the error this write's own sync would have seen
	// (the kernel reports a write-back error once per open file): settle
	// waits for such a sync, and fails the write with it.
	return t.settle(ticket, err)
}

// writeDSync is w.WriteAtDSync with a panic turned into an error.
func (t *tracked) writeDSync(w DSyncWriter, p []byte, off int64) (err error) {
	defer backing.Recover(&err, t.Name(), t.e.OnPanic)
	_, err = w.WriteAtDSync(p, off)
	return err
}

// write is d.WriteAt with a panic turned into an error (a tracked device
// does that itself; an untracked one may not).
func (e *Engine) write(d backing.Device, p []byte, off int64) (err error) {
	defer backing.Recover(&err, d.Name(), e.OnPanic)
	_, err = d.WriteAt(p, off)
	return err
}

// failsDevice says whether a failed durable write (pwritev2 RWF_DSYNC) must
// fail the device's later flushes. Such a write is a write into the page
// cache followed by a write-back and cache flush of its range, and one errno
// reports either half. If the write-back half failed, the kernel has
// already handed the file's write-back error to this call (errseq: each
// error is reported once per open file), so the next fdatasync would return
// 0 over pages that may be lost, written by this request or by any other
// acknowledged before it. So every error fails the device unless the
// kernel can only return it before copying anything:
//
//	EINVAL  bad offset or flags          checked before the copy
//	EBADF   fd not open for writing      checked before the copy
//	EFBIG   past the file size limit     checked before the copy
//	EPERM   immutable, append-only, seal checked before the copy
//
// ENOSPC and EDQUOT stay fatal although they usually mean the write found
// no room: thin provisioning, NFS and delayed allocation report them from
// write-back too, and nothing tells the two apart. EROFS stays fatal: ext4
// returns it once its journal aborted after an I/O error. A panic is fatal:
// nothing is known about what the device did.
func failsDevice(err error) bool {
	for _, before := range []error{unix.EINVAL, unix.EBADF, unix.EFBIG, unix.EPERM} {
		if errors.Is(err, before) {
			return false
		}
	}
	return true
}
