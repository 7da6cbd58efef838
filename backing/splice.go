package backing

import (
	"fmt"
	"io"
	"os"

	"golang.org/x/sys/unix"
)

// Splicer is a device that can move its bytes into a pipe without copying
// them through user memory: splice(2) from a file gives the pipe references
// to the page cache's pages, and a splice from the pipe into a socket
// passes them on, so a large read reply costs no copy in the server.
type Splicer interface {
	// SpliceTo moves [off, off+n) into the pipe whose write end is pipe,
	// which has room for n bytes. ok false means it moved nothing and the
	// caller reads the range instead: a range the device knows to hold
	// holes, which a sparse read answers as holes. With ok, an error
	// means part of the range may be in the pipe.
	SpliceTo(pipe int, off int64, n int) (ok bool, err error)
}

// Splice moves [off, off+n) of d into pipe through the first Splicer among
// d and the devices it wraps; ok is false if there is none, or it declined.
func Splice(d Device, pipe int, off int64, n int) (ok bool, err error) {
	for inner := d; inner != nil; {
		if s, ok := inner.(Splicer); ok {
			return s.SpliceTo(pipe, off, n)
		}
		w, ok := inner.(Wrapper)
		if !ok {
			break
		}
		inner = w.Unwrap()
	}
	return false, nil
}

var (
	_ Splicer = (*File)(nil)
	_ Splicer = (*HoleMap)(nil)
)

// SpliceTo splices the range from the file. Reading past the end is the
// short read it is for ReadAt.
func (d *File) SpliceTo(pipe int, off int64, n int) (bool, error) {
	s, err := d.enter("splice")
	if err != nil {
		return true, err
	}
	defer d.exit(s)
	for n > 0 {
		k, err := unix.Splice(d.fd, &off, pipe, nil, n, unix.SPLICE_F_MOVE)
		switch {
		case err == unix.EINTR:
			continue
		case err != nil:
			return true, &os.PathError{Op: "splice", Path: d.name, Err: err}
		case k == 0:
			return true, fmt.Errorf("splice %s at %d: %w", d.name, off, io.ErrUnexpectedEOF)
		}
		n -= int(k)
	}
	return true, nil
}

// SpliceTo declines a range with holes in the map, so that they are
// answered as holes, and splices the rest from the device below.
func (h *HoleMap) SpliceTo(pipe int, off int64, n int) (bool, error) {
	end := off + int64(n)
	if checkRange(h.size, off, int64(n)) != nil {
		return false, nil // the read reports it
	}
	holes := false
	if err := h.runs(off, end, func(_, _ int64, hole bool) { holes = holes || hole }); err != nil || holes {
		return false, nil
	}
	return Splice(h.Device, pipe, off, n)
}
