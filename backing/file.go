package backing

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
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
func (d *File) Close() error {
	d.closeDSync()
	return d.f.Close()
}

// enter and exit bracket each method's system calls (callGate):
// defer d.exit(d.enter()).
func (d *File) enter() callSlot {
	s := d.calls.enter()
	if d.stall != nil {
		d.stall()
	}
	return s
}

func (d *File) exit(s callSlot) { d.calls.exit(s) }

func (d *File) ReadAt(p []byte, off int64) (int, error) {
	defer d.exit(d.enter())
	return d.f.ReadAt(p, off)
}

func (d *File) WriteAt(p []byte, off int64) (int, error) {
	defer d.exit(d.enter())
	return d.f.WriteAt(p, off)
}

func (d *File) Sync() error {
	defer d.exit(d.enter())
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
	defer d.exit(d.enter())
	err := ignoringEINTR(func() error { return unix.Fallocate(d.fd, mode, off, n) })
	if errors.Is(err, unix.EOPNOTSUPP) || errors.Is(err, unix.ENOSYS) {
		return ErrNotSupported
	}
	return err
}

// blockRange issues BLKDISCARD or BLKZEROOUT, which take {start, len} in
// bytes, both 512-aligned.
func (d *File) blockRange(req uint, off, n int64) error {
	arg := [2]uint64{uint64(off), uint64(n)}
	defer d.exit(d.enter())
	err := ioctlPtr(d.fd, req, unsafe.Pointer(&arg))
	if errors.Is(err, unix.EOPNOTSUPP) || errors.Is(err, unix.ENOTTY) {
		return ErrNotSupported
	}
	return err
}

// Holes finds holes with SEEK_HOLE/SEEK_DATA. A hole that starts before off
// or runs past off+n is clipped to the range.
func (d *File) Holes(off, n int64) ([]Range, error) {
	if d.block {
		return nil, nil
	}
	defer d.exit(d.enter())
	var holes []Range
	end := off + n
	for pos := off; pos < end; {
		hole, err := unix.Seek(d.fd, pos, unix.SEEK_HOLE)
		if errors.Is(err, unix.ENXIO) || hole >= end {
			break
		}
		if err != nil {
			if errors.Is(err, unix.EINVAL) { // filesystem without SEEK_HOLE
				return nil, nil
			}
			return nil, err
		}
		data, err := unix.Seek(d.fd, hole, unix.SEEK_DATA)
		if errors.Is(err, unix.ENXIO) || data > end { // hole runs to EOF
			data = end
		} else if err != nil {
			return nil, err
		}
		holes = append(holes, Range{Off: hole, Len: data - hole})
		pos = data
	}
	return holes, nil
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
