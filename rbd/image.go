//go:build ceph

package rbd

import (
	"errors"
	"fmt"
	"io"
	"strconv"
	"sync"
	"syscall"

	"github.com/ceph/go-ceph/rados"
	librbd "github.com/ceph/go-ceph/rbd"

	"github.com/nbdmapper/nbdmapper/backing"
)

// Supported says whether this binary can open rbd: devices: it was built
// with `-tags ceph`.
const Supported = true

// image is an open RBD image: a connection of its own to the cluster
// (librados' threads and sockets), the pool's I/O context and the image.
// librbd's handles are safe for concurrent use, and each call blocks one
// thread of the Go runtime for its round trip, as a file's pread does.
type image struct {
	name     string
	id       backing.ID
	size     int64
	readOnly bool

	conn  *rados.Conn
	ioctx *rados.IOContext
	img   *librbd.Image

	closeOnce sync.Once
	closeErr  error
}

var _ backing.Device = (*image)(nil)

// zeroBlock is what Zero asks rbd_writesame to repeat.
var zeroBlock = make([]byte, 512)

func open(name string, n Name, readOnly bool, opt Options) (_ backing.Device, err error) {
	fail := func(op string, err error) error { return fmt.Errorf("%s: %w", op, errnoOf(err)) }
	var conn *rados.Conn
	if n.ID != "" {
		conn, err = rados.NewConnWithUser(n.ID)
	} else {
		conn, err = rados.NewConn()
	}
	if err != nil {
		return nil, fail("rados_create", err)
	}
	ok := false
	defer func() {
		if !ok {
			conn.Shutdown()
		}
	}()
	if n.Conf != "" {
		err = conn.ReadConfigFile(n.Conf)
	} else {
		err = conn.ReadDefaultConfigFile()
	}
	if err != nil && (n.Conf != "" || !errors.Is(errnoOf(err), syscall.ENOENT)) {
		return nil, fail("read conf "+n.Conf, err)
	}
	secs := strconv.FormatFloat(opt.Timeout.Seconds(), 'f', -1, 64)
	settings := [][2]string{
		// The deadline of each request, librados' resends included, and
		// of connecting: then the request fails with ETIMEDOUT.
		{"rados_osd_op_timeout", secs},
		{"rados_mon_op_timeout", secs},
		{"client_mount_timeout", secs},
	}
	if n.Keyring != "" {
		settings = append(settings, [2]string{"keyring", n.Keyring})
	}
	for _, kv := range append(settings, n.Options...) {
		if err := conn.SetConfigOption(kv[0], kv[1]); err != nil {
			return nil, fail("set "+kv[0], err)
		}
	}
	if err := conn.Connect(); err != nil {
		return nil, fail("connect", err)
	}
	ioctx, err := conn.OpenIOContext(n.Pool)
	if err != nil {
		return nil, fail("open pool "+n.Pool, err)
	}
	defer func() {
		if !ok {
			ioctx.Destroy()
		}
	}()
	snap := librbd.NoSnapshot
	if n.Snap != "" {
		snap = n.Snap
	}
	var img *librbd.Image
	if readOnly {
		img, err = librbd.OpenImageReadOnly(ioctx, n.Image, snap)
	} else {
		img, err = librbd.OpenImage(ioctx, n.Image, snap)
	}
	if err != nil {
		return nil, fail("open image "+n.Pool+"/"+n.Image, err)
	}
	size, err := img.GetSize()
	if err != nil {
		img.Close()
		return nil, fail("size", err)
	}
	ok = true
	return &image{
		name: name, id: backing.ID{URI: n.String()}, size: int64(size), readOnly: readOnly,
		conn: conn, ioctx: ioctx, img: img,
	}, nil
}

// errnoOf turns a go-ceph error, which carries a negative errno, into a
// syscall.Errno that the server's errno mapping knows (EROFS is EPERM to
// a client, ENOSPC is ENOSPC, the rest EIO), keeping librbd's text.
func errnoOf(err error) error {
	var ce interface{ ErrorCode() int }
	if errors.As(err, &ce) && ce.ErrorCode() < 0 {
		return &cephError{err: err, errno: syscall.Errno(-ce.ErrorCode())}
	}
	return err
}

type cephError struct {
	err   error
	errno syscall.Errno
}

func (e *cephError) Error() string { return e.err.Error() }
func (e *cephError) Unwrap() error { return e.errno }

func (m *image) fail(op string, err error) error {
	return fmt.Errorf("%s: %s: %w", m.name, op, errnoOf(err))
}

func (m *image) Name() string   { return m.name }
func (m *image) ID() backing.ID { return m.id }
func (m *image) Size() int64    { return m.size }

func (m *image) ReadAt(p []byte, off int64) (int, error) {
	n, err := m.img.ReadAt(p, off)
	if err != nil && err != io.EOF {
		return n, m.fail("rbd_read", err)
	}
	return n, err
}

func (m *image) WriteAt(p []byte, off int64) (int, error) {
	if m.readOnly {
		return 0, m.fail("rbd_write", syscall.EROFS)
	}
	n, err := m.img.WriteAt(p, off)
	if err != nil {
		return n, m.fail("rbd_write", err)
	}
	return n, nil
}

// Sync calls rbd_flush: with librbd's cache on it writes the cache back;
// off, every acknowledged write is already on the OSDs and it returns at
// once.
func (m *image) Sync() error {
	if m.readOnly {
		return nil
	}
	if err := m.img.Flush(); err != nil {
		return m.fail("rbd_flush", err)
	}
	return nil
}

func (m *image) Discard(off, n int64) error {
	if m.readOnly {
		return m.fail("rbd_discard", syscall.EROFS)
	}
	if _, err := m.img.Discard(uint64(off), uint64(n)); err != nil {
		return m.fail("rbd_discard", err)
	}
	return nil
}

// Zero asks rbd_writesame to repeat a block of zeros, which librbd turns
// into a discard that zeroes (rbd_discard_on_zeroed_write_same): whole
// objects are removed, partial ones zeroed. That may deallocate, so
// without mayPunch, and for lengths that are not whole blocks, it is
// ErrNotSupported and the caller writes zeros.
func (m *image) Zero(off, n int64, mayPunch bool) error {
	if m.readOnly {
		return m.fail("rbd_writesame", syscall.EROFS)
	}
	if !mayPunch || n%int64(len(zeroBlock)) != 0 {
		return backing.ErrNotSupported
	}
	if _, err := m.img.WriteSame(uint64(off), uint64(n), zeroBlock, 0); err != nil {
		return m.fail("rbd_writesame", err)
	}
	return nil
}

// Holes lists the ranges of [off, off+n) that no object of the image
// holds, from rbd_diff_iterate2 against the image's creation (the object
// map answers it without reading objects when the image has fast-diff).
//
//	objects   |  data  |        |  data  |
//	[off, off+n)   [--------------------------)
//	holes                |xxxxxxxx|       |xxx|
func (m *image) Holes(off, n int64) ([]backing.Range, error) {
	var holes []backing.Range
	at, end := off, off+n
	err := m.img.DiffIterate(librbd.DiffIterateConfig{
		SnapName:      librbd.NoSnapshot,
		Offset:        uint64(off),
		Length:        uint64(n),
		IncludeParent: librbd.IncludeParent,
		WholeObject:   librbd.EnableWholeObject,
		Callback: func(o, l uint64, exists int, _ interface{}) int {
			if exists == 0 {
				return 0
			}
			s, e := max(int64(o), at), min(int64(o+l), end)
			if s > at {
				holes = append(holes, backing.Range{Off: at, Len: s - at})
			}
			at = max(at, e)
			return 0
		},
	})
	if err != nil {
		return nil, m.fail("rbd_diff_iterate2", err)
	}
	if at < end {
		holes = append(holes, backing.Range{Off: at, Len: end - at})
	}
	return holes, nil
}

// Limits: librbd takes discards of any size and alignment (it zeroes the
// parts of objects a discard does not cover whole), so the discard engine
// merges and passes them on as they come.
func (m *image) Limits() backing.Limits { return backing.Limits{Granularity: 512} }

func (m *image) Close() error {
	m.closeOnce.Do(func() {
		m.closeErr = m.img.Close()
		if m.closeErr != nil {
			m.closeErr = m.fail("close", m.closeErr)
		}
		m.ioctx.Destroy()
		m.conn.Shutdown()
	})
	return m.closeErr
}
