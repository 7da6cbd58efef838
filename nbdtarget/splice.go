package nbdtarget

import (
	"errors"
	"os"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// Large reads on plain sockets are spliced: the data moves from the page
// cache into a pipe and from the pipe into the socket by reference
// (splice(2)), never through a buffer of ours, which saves both of the
// copies a pread and a write make. The pipe is filled before the reply's
// header is written, so a read error is an ordinary error reply, as it is
// for a read into a buffer. Reads shorter than spliceMin cost fewer system
// calls through a buffer; reads longer than spliceMax (a pipe's room) and
// TLS connections, whose bytes must pass through user memory to be
// encrypted, use the buffer too.
//
// A pipe's room is counted in pages, not bytes: splice from the page cache
// gives the pipe one buffer per page (or part of a page) it takes from, so
// a read spans one page more than its length fills when it starts inside a
// page. Such a read of spliceMax bytes spans 257 pages of a 256-page pipe:
//
//	file pages   |    0    |    1    | ... |   255   |   256   |
//	read          [.......................................]
//	              off = 512                    off + 1 MiB = 256 pages + 512
//
// The head up to the first page boundary (under a page) is read into a
// buffer and sent with the reply's header; the rest, page-aligned, is
// spliced. Reads that fit the pipe's pages are spliced whole.
const (
	spliceMin = 128 << 10
	spliceMax = 1 << 20
	// maxPipes bounds the pipes the server holds, two descriptors each; a
	// read that finds none free is read into a buffer.
	maxPipes = 16
)

// pipe is a pipe with room for at least spliceMax bytes, empty while in
// the pool.
type pipe struct {
	r, w  int
	pages int // the pipe buffers it holds: the pages a splice may span
}

// pageSize is the unit of a pipe's room (pipe.pages).
var pageSize = int64(os.Getpagesize())

// head returns how much of a read of n bytes at off to read into a buffer
// so that the rest, from the next page boundary on, spans at most pages
// pages: 0 if the whole read fits.
func head(off, n, pages int64) int64 {
	lead := off % pageSize
	if (lead+n+pageSize-1)/pageSize <= pages {
		return 0
	}
	return min(pageSize-lead, n)
}

// pipePool lends pipes to spliced reads, making them as needed up to
// maxPipes.
type pipePool struct {
	mu      sync.Mutex
	free    []*pipe
	made    int
	noRoom  time.Time             // when a pipe last could not get room for spliceMax
	newPipe func() (*pipe, error) // makePipe, unless a test replaces it
}

// noRoomWait is how long the pool makes no pipe after one could not get
// room for spliceMax, which happens when the user's pipe buffers are spent
// (fs.pipe-user-pages-soft) or the limit on a pipe's size is lower
// (fs.pipe-max-size): reads then go through buffers without paying for the
// failed calls each time, and splice again once the pipes of other
// processes may have gone. Free pipes are still lent.
const noRoomWait = 10 * time.Second

// errNoRoom says a pipe could not be given room for spliceMax.
var errNoRoom = errors.New("no pipe with room for a spliced request")

// get returns an empty pipe, or nil if none is free and no more can be made.
func (pp *pipePool) get() *pipe {
	pp.mu.Lock()
	defer pp.mu.Unlock()
	if n := len(pp.free); n > 0 {
		p := pp.free[n-1]
		pp.free = pp.free[:n-1]
		return p
	}
	if pp.made >= maxPipes || time.Since(pp.noRoom) < noRoomWait {
		return nil
	}
	mk := makePipe
	if pp.newPipe != nil {
		mk = pp.newPipe
	}
	p, err := mk()
	if err != nil {
		if errors.Is(err, errNoRoom) {
			pp.noRoom = time.Now()
		}
		return nil // or out of descriptors, for now
	}
	pp.noRoom = time.Time{}
	pp.made++
	return p
}

// makePipe makes a pipe with room for spliceMax. It is non-blocking, so
// that a pipe that is not empty when it should be fails the splice
// (EAGAIN) instead of blocking it.
func makePipe() (*pipe, error) {
	var fds [2]int
	if err := unix.Pipe2(fds[:], unix.O_CLOEXEC|unix.O_NONBLOCK); err != nil {
		return nil, err
	}
	room, err := unix.FcntlInt(uintptr(fds[1]), unix.F_SETPIPE_SZ, spliceMax)
	if err != nil || room < spliceMax {
		unix.Close(fds[0])
		unix.Close(fds[1])
		return nil, errNoRoom
	}
	return &pipe{r: fds[0], w: fds[1], pages: int(int64(room) / pageSize)}, nil
}

// put returns an empty pipe to the pool.
func (pp *pipePool) put(p *pipe) {
	pp.mu.Lock()
	pp.free = append(pp.free, p)
	pp.mu.Unlock()
}

// drop closes a pipe that may not be empty.
func (pp *pipePool) drop(p *pipe) {
	unix.Close(p.r)
	unix.Close(p.w)
	pp.mu.Lock()
	pp.made--
	pp.mu.Unlock()
}

// close closes the free pipes.
func (pp *pipePool) close() {
	pp.mu.Lock()
	free := pp.free
	pp.free = nil
	pp.made -= len(free)
	pp.mu.Unlock()
	for _, p := range free {
		unix.Close(p.r)
		unix.Close(p.w)
	}
}

// spliceRead moves read j's data into a pipe (mapped.Device.Splice), for
// sendSpliced to pass on, after a head read into j.buf where the read
// spans more pages than the pipe holds; ok false means it was not spliced
// and is to be read into a buffer.
func (c *conn) spliceRead(j *job) (ok bool, err error) {
	r := &j.req
	if c.raw == nil || c.tls != nil || c.srv.NoSplice || r.Length < spliceMin || r.Length > spliceMax {
		return false, nil
	}
	p := c.srv.pipes.get()
	if p == nil {
		return false, nil
	}
	settled := false
	defer func() {
		if !settled { // a panic below (protect answers it): contents unknown
			c.srv.pipes.drop(p)
		}
	}()
	off, n := int64(r.Offset), int64(r.Length)
	if h := head(off, n, int64(p.pages)); h > 0 {
		j.setBuf(int(h))
	}
	ok, j.errOff, err = c.x.Dev.Splice(p.w, off, n, j.buf)
	settled = true
	switch {
	case !ok:
		c.srv.pipes.put(p)
		j.dropBuf() // the whole read goes through a buffer
	case err != nil:
		c.srv.pipes.drop(p)
	default:
		j.pipe = p
	}
	return ok, err
}

// sendSpliced sends a spliced read's reply: the header and any head read
// into j.buf through bw, then the pipe's bytes straight into the socket,
// waiting in the network poller while the socket is full. The pipe goes
// back to the pool empty, or is dropped if the write failed.
func (c *conn) sendSpliced(j *job, hdr []byte) {
	p := j.pipe
	j.pipe = nil
	c.lockSend()
	defer c.unlockSend()
	if c.werr == nil {
		_, c.werr = c.bw.Write(hdr)
	}
	if c.werr == nil {
		_, c.werr = c.bw.Write(j.buf)
	}
	if c.werr == nil {
		c.werr = c.bw.Flush()
	}
	if c.werr == nil {
		c.werr = c.spliceOut(p, int(j.req.Length)-len(j.buf))
	}
	if c.werr != nil {
		c.srv.pipes.drop(p)
		return
	}
	c.srv.pipes.put(p)
	// Counted once moved, not before the reply leaves as requests are
	// (handle): a failed send is not counted, and the count shows when a
	// reply is all in the socket (TestUnixSocketTakesWholeReply).
	c.st.splicedBytes.Add(int64(int(j.req.Length) - len(j.buf)))
}

// spliceOut moves n bytes from p into the socket.
func (c *conn) spliceOut(p *pipe, n int) error {
	var serr error
	err := c.raw.Write(func(fd uintptr) bool {
		for n > 0 {
			k, err := unix.Splice(p.r, nil, int(fd), nil, n, unix.SPLICE_F_MOVE|unix.SPLICE_F_NONBLOCK)
			switch {
			case err == unix.EINTR:
				continue
			case err == unix.EAGAIN:
				return false // the socket is full: wait until it drains
			case err != nil:
				serr = err
				return true
			}
			n -= int(k)
			c.writing()
		}
		return true
	})
	if err != nil {
		return err
	}
	return serr
}

// rawConn returns nc's descriptor access for splicing, or nil.
func rawConn(nc any) syscall.RawConn {
	sc, ok := nc.(syscall.Conn)
	if !ok {
		return nil
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return nil
	}
	return rc
}
