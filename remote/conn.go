package remote

import (
	"bufio"
	"errors"
	"fmt"
	"net"
	"runtime/debug"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nbdmapper/nbdmapper/backing"
	"github.com/nbdmapper/nbdmapper/wire"
)

// errDown marks a call whose connection ended before its last reply: it
// is sent again on another connection, within its deadline.
var errDown = errors.New("connection to the remote lost")

// conn is one connection to a remote export in the transmission phase.
// Requests are pipelined: any goroutine writes a request (under wmu, one
// at a time, the payload straight from the caller's buffer), and one
// reader goroutine takes the replies as they come, in any order, and
// hands each to the call waiting for it. The reader alone finishes calls,
// so a call's buffers are never touched after its caller is woken.
type conn struct {
	d     *Device
	nc    net.Conn
	x     Export
	rr    replyReader
	since time.Time

	wmu  sync.Mutex
	wbuf [wire.RequestSize]byte

	mu       sync.Mutex
	calls    map[uint64]*call
	handle   uint64
	dead     bool
	cause    error
	inflight atomic.Int64

	gone chan struct{} // closed once the reader has finished every call
}

func newConn(d *Device, nc net.Conn, x Export) *conn {
	return &conn{
		d: d, nc: nc, x: x, since: time.Now(),
		rr:    replyReader{br: bufio.NewReaderSize(nc, 128<<10), structured: x.Structured, metaID: x.MetaID},
		calls: make(map[uint64]*call),
		gone:  make(chan struct{}),
	}
}

// start runs the connection's reader and watchdog.
func (cn *conn) start() {
	cn.d.wg.Add(2)
	go cn.readLoop()
	go cn.watch()
}

// send puts c on the wire. It returns false, having done nothing, if the
// connection is already dead; otherwise the reader will finish c, with its
// replies or with errDown.
func (cn *conn) send(c *call) bool {
	cn.mu.Lock()
	if cn.dead {
		cn.mu.Unlock()
		return false
	}
	cn.handle++
	c.req.Handle = cn.handle
	cn.calls[cn.handle] = c
	cn.inflight.Add(1)
	cn.mu.Unlock()

	c.sent = time.Now()
	cn.wmu.Lock()
	cn.nc.SetWriteDeadline(c.deadline)
	b := wire.AppendRequest(cn.wbuf[:0], c.req)
	var err error
	if len(c.payload) > 0 {
		bufs := net.Buffers{b, c.payload}
		_, err = bufs.WriteTo(cn.nc)
	} else {
		_, err = cn.nc.Write(b)
	}
	cn.wmu.Unlock()
	if err != nil {
		cn.fail(fmt.Errorf("sending %s: %w", cmdName(c.req.Type), err))
	}
	return true
}

// fail ends the connection; the reader then finishes its calls.
func (cn *conn) fail(err error) {
	cn.mu.Lock()
	if !cn.dead {
		cn.dead, cn.cause = true, err
	}
	cn.mu.Unlock()
	cn.nc.Close()
}

// disconnect asks the server politely to end the session (NBD_CMD_DISC),
// then closes the connection. A connection busy writing (a remote that
// does not read) is just closed: Close must not wait for it.
func (cn *conn) disconnect() {
	if cn.wmu.TryLock() {
		cn.nc.SetWriteDeadline(time.Now().Add(time.Second))
		cn.nc.Write(wire.AppendRequest(cn.wbuf[:0], wire.Request{Type: wire.CmdDisc}))
		cn.wmu.Unlock()
	}
	cn.fail(errClosed)
}

func (cn *conn) lookup(handle uint64) *call {
	cn.mu.Lock()
	defer cn.mu.Unlock()
	return cn.calls[handle]
}

// readLoop reads replies until the connection fails, then reports the loss
// to the device (which decides whether unflushed writes may have been lost)
// before finishing the calls left, so that a flush retried after the loss
// sees its verdict. A panic here is contained: it ends this connection
// only.
func (cn *conn) readLoop() {
	defer cn.d.wg.Done()
	err := cn.replies()
	cn.fail(err)
	cn.mu.Lock()
	cause := cn.cause
	left := cn.calls
	cn.calls = nil
	cn.mu.Unlock()
	cn.d.lost(cn, cause)
	for _, c := range left {
		cn.finish(c, errDown, false)
	}
	close(cn.gone)
}

func (cn *conn) replies() (err error) {
	defer backing.Recover(&err, cn.d.name, cn.d.opts.OnPanic)
	for {
		c, last, err := cn.rr.next(cn.lookup)
		if err != nil {
			return err
		}
		if last {
			cn.finish(c, nil, true)
		}
	}
}

// finish hands c back to its caller, taking it out of the calls in flight
// first if it is still there (registered). Until then it stays in them, so
// that if anything here panics (an Observe hook), the reader's cleanup
// still finishes it, with errDown. The device's view of what the remote
// acknowledged changes here, on the reader, before the caller is woken and
// before a later loss of this connection is reported: a write (or
// write-zeroes) without FUA counts as acknowledged and unflushed from its
// reply on; a flush's reply covers every write acknowledged before it was
// sent.
func (cn *conn) finish(c *call, err error, registered bool) {
	d := cn.d
	if err == nil {
		switch {
		case c.errno == wire.ESHUTDOWN:
			err = errShutdown
			cn.fail(err)
		case c.errno != 0:
			d.st.errorReplies.Add(1)
		case c.req.Type == wire.CmdFlush:
			d.flushedUpTo(c.flushStart)
		case c.req.Flags&wire.CfFUA == 0 && mustPersist(c.req.Type):
			d.acked.Add(1)
		}
		d.roundTrip(c.req.Type, time.Since(c.sent))
	}
	if registered {
		cn.mu.Lock()
		delete(cn.calls, c.req.Handle)
		cn.mu.Unlock()
	}
	cn.inflight.Add(-1)
	c.err = err
	c.done <- struct{}{}
}

// mustPersist says whether an acknowledged cmd is lost data if the remote
// restarts before a flush: writes and write-zeroes are. A trim is not: the
// trimmed range may read back as anything, its old bytes included.
func mustPersist(cmd uint16) bool {
	return cmd == wire.CmdWrite || cmd == wire.CmdWriteZeroes
}

// watch fails the connection when a request on it is past its deadline:
// the remote is not answering, and the requests left are retried
// elsewhere (the late one fails with EIO). It checks a few times per
// deadline, so that a deadline costs no timer per request.
func (cn *conn) watch() {
	defer cn.d.wg.Done()
	defer func() {
		if v := recover(); v != nil {
			if cn.d.opts.OnPanic != nil {
				cn.d.opts.OnPanic(v, debug.Stack())
			}
			cn.fail(fmt.Errorf("%w: %v", backing.ErrPanic, v))
		}
	}()
	t := time.NewTicker(cn.d.tick)
	defer t.Stop()
	for {
		select {
		case <-cn.gone:
			return
		case now := <-t.C:
			cn.mu.Lock()
			late := 0
			for _, c := range cn.calls {
				if now.After(c.deadline) {
					late++
				}
			}
			cn.mu.Unlock()
			if late > 0 {
				cn.fail(fmt.Errorf("%d requests without a reply within %v: %w", late, cn.d.opts.Timeout, ErrTimeout))
			}
		}
	}
}
