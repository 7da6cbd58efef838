package backing

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"
)

// File is a regular file or a block device.
//
//	             regular file                     block device
//	Sync         fdatasync                        fdatasync (flushes the disk cache)
//	Discard      fallocate PUNCH_HOLE|KEEP_SIZE   ioctl BLKDISCARD
//	Zero         PUNCH_HOLE or ZERO_RANGE         ioctl BLKZEROOUT
//	Holes        lseek SEEK_DATA / SEEK_HOLE      none (all data)
//	Size         st_size                          ioctl BLKGETSIZE64
type File struct {
	f      *os.File
	fd     int
	name   string
	id     ID
	size   int64
	block  bool
	limits Limits
	calls  callGate // bounds the system calls in progress (calls.go)
	dsync  chan int // descriptors of their own for durable writes, free (file_dsync.go)
	stall  func()   // tests: runs in every call's slot, before the system call
	// Close and the calls in progress (see enter): inside counts the
	// calls in progress, closed says Close was called, released that the
	// descriptors are closed.
	inside   atomic.Int64
	closed   atomic.Bool
	released atomic.Bool
}

var _ Device = (*File)(nil)

// OpenFile opens a regular file or block device for reading and writing
// (reading only with readOnly).
func OpenFile(path string, readOnly bool) (*File, error) {
	flag := os.O_RDWR
	if readOnly {
		flag = os.O_RDONLY
	}
	f, err := os.OpenFile(path, flag, 0)
	if err != nil {
		return nil, err
	}
	d, err := newFile(f, path)
	if err != nil {
		f.Close()
		return nil, err
	}
	return d, nil
}

func newFile(f *os.File, name string) (*File, error) {
	var st unix.Stat_t
	fd := int(f.Fd())
	if err := unix.Fstat(fd, &st); err != nil {
		return nil, fmt.Errorf("stat %s: %w", name, err)
	}
	d := &File{f: f, fd: fd, name: name, calls: newCallGate(), dsync: make(chan int, DeviceCalls)}
	switch st.Mode & unix.S_IFMT {
	case unix.S_IFREG:
		d.id = ID{Dev: st.Dev, Ino: st.Ino}
		d.size = st.Size
		d.limits = Limits{Granularity: max(int64(st.Blksize), 1), DiscardZeroes: true}
	case unix.S_IFBLK:
		d.block = true
		d.id = ID{Block: true, Dev: st.Rdev}
		size, err := unix.IoctlGetUint64(fd, unix.BLKGETSIZE64)
		if err != nil {
			return nil, fmt.Errorf("%s: BLKGETSIZE64: %w", name, err)
		}
		d.size = int64(size)
		d.limits = blockLimits(st.Rdev)
	default:
		return nil, fmt.Errorf("%s: not a regular file or block device", name)
	}
	return d, nil
}

// blockLimits reads the queue's discard limits from sysfs.
func blockLimits(rdev uint64) Limits {
	dir := fmt.Sprintf("/sys/dev/block/%d:%d/queue/", major(rdev), minor(rdev))
	read := func(name string) int64 {
		b, err := os.ReadFile(dir + name)
		if err != nil {
			return 0
		}
		v, _ := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
		return v
	}
	return Limits{Granularity: max(read("discard_granularity"), 512), MaxBytes: read("discard_max_bytes")}
}

func (d *File) Name() string   { return d.name }
func (d *File) ID() ID         { return d.id }
func (d *File) Size() int64    { return d.size }
func (d *File) Limits() Limits { return d.limits }

// Close closes the file once no system call of it is in progress: at
// once if none is, or else as the last one returns. Calls made after Close
// fail with os.ErrClosed. Calls use the descriptor's number directly
// (fdatasync, fallocate, splice, lseek), and the kernel hands a closed
// number out again to the next file opened: closed under one of them, the
// descriptor could have a hole punched in some other file. Close does not
// wait, so that a device whose calls hang does not hang its closer too;
// it then keeps its descriptor until they return. The error of a close
// left to the last call is lost: Close reports only its own.
func (d *File) Close() error {
	if !d.closed.CompareAndSwap(false, true) {
		return &os.PathError{Op: "close", Path: d.name, Err: os.ErrClosed}
	}
	if d.inside.Load() == 0 {
		return d.release()
	}
	return nil
}

// release closes the descriptors, once: by Close, or by the last call out
// after it.
func (d *File) release() error {
	if !d.released.CompareAndSwap(false, true) {
		return nil
	}
	d.closeDSync()
	return d.f.Close()
}

// enter and exit bracket each method's system calls (callGate):
//
//	s, err := d.enter("op")
//	if err != nil {
//		return err
//	}
//	defer d.exit(s)
//
// enter counts the call in before it looks at closed, and Close sets closed
// before it looks at the count: so either the call sees closed and fails,
// or Close sees the call and leaves the descriptor to it.
func (d *File) enter(op string) (callSlot, error) {
	s := d.calls.enter()
	d.inside.Add(1)
	if d.closed.Load() {
		d.exit(s)
		return s, &os.PathError{Op: op, Path: d.name, Err: os.ErrClosed}
	}
	if d.stall != nil {
		d.stall()
	}
	return s, nil
}

func (d *File) exit(s callSlot) {
	if d.inside.Add(-1) == 0 && d.closed.Load() {
		d.release()
	}
	d.calls.exit(s)
}

func (d *File) ReadAt(p []byte, off int64) (int, error) {
	s, err := d.enter("read")
	if err != nil {
		return 0, err
	}
	defer d.exit(s)
	return d.f.ReadAt(p, off)
}

func (d *File) WriteAt(p []byte, off int64) (int, error) {
	s, err := d.enter("write")
	if err != nil {
		return 0, err
	}
	defer d.exit(s)
	return d.f.WriteAt(p, off)
}

func (d *File) Sync() error {
	s, err := d.enter("fdatasync")
	if err != nil {
		return err
	}
	defer d.exit(s)
	return ignoringEINTR(func() error { return unix.Fdatasync(d.fd) })
}

func (d *File) Discard(off, n int64) error {
	if d.block {
		return d.blockRange(unix.BLKDISCARD, off, n)
	}
	return d.fallocate(unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, off, n)
}

func (d *File) Zero(off, n int64, mayPunch bool) error {
	if d.block {
		return d.blockRange(unix.BLKZEROOUT, off, n)
	}
	if mayPunch {
		if err := d.fallocate(unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, off, n); err == nil {
			return nil
		}
	}
	return d.fallocate(unix.FALLOC_FL_ZERO_RANGE|unix.FALLOC_FL_KEEP_SIZE, off, n)
}

func (d *File) fallocate(mode uint32, off, n int64) error {
	s, err := d.enter("fallocate")
	if err != nil {
		return err
	}
	defer d.exit(s)
	err = ignoringEINTR(func() error { return unix.Fallocate(d.fd, mode, off, n) })
	if errors.Is(err, unix.EOPNOTSUPP) || errors.Is(err, unix.ENOSYS) {
		return ErrNotSupported
	}
	return err
}

// blockRange issues BLKDISCARD or BLKZEROOUT, which take {start, len} in
// bytes, both 512-aligned.
func (d *File) blockRange(req uint, off, n int64) error {
	arg := [2]uint64{uint64(off), uint64(n)}
	s, err := d.enter("ioctl")
	if err != nil {
		return err
	}
	defer d.exit(s)
	err = ioctlPtr(d.fd, req, unsafe.Pointer(&arg))
	if errors.Is(err, unix.EOPNOTSUPP) || errors.Is(err, unix.ENOTTY) {
		return ErrNotSupported
	}
	return err
}

// Holes finds holes with SEEK_HOLE/SEEK_DATA. A hole that starts before off
// or runs past off+n is clipped to the range.
func (d *File) Holes(off, n int64) ([]Range, error) {
	holes, _, err := d.HolesTo(off, n)
	return holes, err
}

// HolesTo is Holes that also says how far its answer reaches: [off+n,
// known) holds no hole. SEEK_HOLE finds the next hole wherever it is, so
// when it finds none in the range it has found how far the data after the
// range runs (to the file's end, if there is no other hole), which costs
// tmpfs a walk of every page of that data (see HoleMap.window).
func (d *File) HolesTo(off, n int64) (holes []Range, known int64, err error) {
	end := off + n
	if d.block {
		return nil, end, nil
	}
	s, err := d.enter("lseek")
	if err != nil {
		return nil, end, err
	}
	defer d.exit(s)
	known = end
	for pos := off; pos < end; {
		hole, err := unix.Seek(d.fd, pos, unix.SEEK_HOLE)
		if errors.Is(err, unix.ENXIO) {
			break
		}
		if err != nil {
			if errors.Is(err, unix.EINVAL) { // filesystem without SEEK_HOLE
				return nil, end, nil
			}
			return nil, end, err
		}
		if hole >= end { // the data at pos runs past the range, to hole
			known = min(hole, d.size)
			break
		}
		data, err := unix.Seek(d.fd, hole, unix.SEEK_DATA)
		if errors.Is(err, unix.ENXIO) || data > end { // hole runs to EOF
			data = end
		} else if err != nil {
			return nil, end, err
		}
		holes = append(holes, Range{Off: hole, Len: data - hole})
		pos = data
	}
	return holes, known, nil
}

// ioctlPtr passes a pointer argument; x/sys/unix has typed helpers for
// integers (IoctlGetUint64 above) but none for BLKDISCARD's {start, len}.
func ioctlPtr(fd int, req uint, arg unsafe.Pointer) error {
	_, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), uintptr(req), uintptr(arg))
	if errno != 0 {
		return errno
	}
	return nil
}

func ignoringEINTR(fn func() error) error {
	for {
		err := fn()
		if err != unix.EINTR {
			return err
		}
	}
}

// resolve turns a `major:minor` device name into a path under /dev, using
// /dev/block/M:m where udev made it, else the DEVNAME sysfs reports.
func resolve(name string) (string, bool) {
	maj, mnr, ok := strings.Cut(name, ":")
	if !ok || !isDigits(maj) || !isDigits(mnr) {
		return name, false
	}
	link := filepath.Join("/dev/block", name)
	if _, err := os.Stat(link); err == nil {
		return link, true
	}
	uevent, err := os.ReadFile(filepath.Join("/sys/dev/block", name, "uevent"))
	if err != nil {
		return name, true
	}
	for _, line := range strings.Split(string(uevent), "\n") {
		if dev, ok := strings.CutPrefix(line, "DEVNAME="); ok {
			return filepath.Join("/dev", dev), true
		}
	}
	return name, true
}

func isDigits(s string) bool {
	if s == "" {
		return false
	}
	for _, c := range s {
		if c < '0' || c > '9' {
			return false
		}
	}
	return true
}

func checkRange(size, off, n int64) error {
	if off < 0 || n < 0 || off > size || n > size-off {
		return fmt.Errorf("range %d+%d outside device of %d bytes: %w", off, n, size, unix.EINVAL)
	}
	return nil
}
