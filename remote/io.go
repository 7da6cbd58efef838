package remote

import (
	"errors"
	"fmt"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sync/errgroup"

	"github.com/nbdmapper/nbdmapper/backing"
	"github.com/nbdmapper/nbdmapper/wire"
)

// Requests are cut to what the remote takes before they are sent. A range
// is split at the remote's minimum block size into an unaligned head, an
// aligned middle and an unaligned tail, and the middle into pieces of at
// most maxIO (READ, WRITE) or maxLen (the commands without payload):
//
//	minimum block 4K, maxIO 8K, a write of 3K+19K:
//	          0       4K      8K      12K     16K     20K     24K
//	block     |.......|.......|.......|.......|.......|.......|
//	write        [====================================]          3K+19K
//	head         [====]                                         3K+1K  read block 0, patch, write back
//	middle            [===============][======]                 4K+8K, 12K+8K (or less at the end)
//	tail                                     [========]  ...    20K+2K read block 5, patch, write back
//
// The pieces go out together (pipelined on the connections) and the
// request is answered when all are. A head or tail is read, modified and
// written back whole under rmw held exclusively, so no other write can
// land between the read and the write-back; every other write, zeroing
// and FUA write holds rmw shared. A remote with a minimum block of 1
// (most) has no heads or tails and takes no lock. Trims, being advisory,
// are cut inward to whole blocks instead; block status and cache are
// widened outward.

// parallel bounds the pieces of one request in flight at once.
const parallel = 16

// piece is one aligned request of a split range: [Off, Off+Len) of the
// device, and for READ and WRITE the part of the caller's buffer it
// covers.
type piece struct {
	off, n   int64
	buf      []byte
	deadline time.Time // the whole request's (run); zero: the call's own
}

// split cuts [off, off+n) into head, middle and tail at d.minBlock.
func (d *Device) split(off, n int64) (head, mid, tail backing.Range) {
	b := d.minBlock
	end := off + n
	if b == 1 {
		return backing.Range{}, backing.Range{Off: off, Len: n}, backing.Range{}
	}
	lo, hi := roundUp(off, b), end/b*b
	if lo >= hi {
		// No whole block inside: at most two partial ones.
		if off/b == (end-1)/b || lo == end || hi == off {
			return backing.Range{Off: off, Len: n}, backing.Range{}, backing.Range{}
		}
		return backing.Range{Off: off, Len: lo - off}, backing.Range{}, backing.Range{Off: lo, Len: end - lo}
	}
	return backing.Range{Off: off, Len: lo - off}, backing.Range{Off: lo, Len: hi - lo}, backing.Range{Off: hi, Len: end - hi}
}

func roundUp(v, b int64) int64 { return (v + b - 1) / b * b }

// span is an aligned range to be cut into pieces of at most limit bytes,
// each with its part of buf (which starts at base, or is nil). The pieces
// are made as they are issued, so that what a request holds does not grow
// with how small the remote's maximum block size is.
type span struct {
	r     backing.Range
	base  int64
	buf   []byte
	limit int64
}

func pieces(r backing.Range, base int64, buf []byte, limit int64) span {
	return span{r: r, base: base, buf: buf, limit: limit}
}

// at is the piece of s that starts at off, due by deadline.
func (s span) at(off int64, deadline time.Time) piece {
	n := min(s.limit, s.r.End()-off)
	p := piece{off: off, n: n, deadline: deadline}
	if s.buf != nil {
		p.buf = s.buf[off-s.base : off-s.base+n]
	}
	return p
}

// run issues one call per piece of s, at most parallel at once, and
// returns the first error. Every piece is due by one deadline, the
// request's (Options.Timeout from now), and none is issued after one has
// failed: a request cut into many pieces fails within its deadline, not
// one deadline per round of parallel pieces. One piece is run on the
// caller's goroutine; goroutines for more are started here and contain
// their panics.
func (d *Device) run(s span, fn func(piece) error) error {
	if s.r.Len <= 0 {
		return nil
	}
	deadline := time.Now().Add(d.opts.Timeout)
	if s.r.Len <= s.limit {
		return fn(s.at(s.r.Off, deadline))
	}
	var g errgroup.Group
	g.SetLimit(parallel)
	var failed atomic.Bool
	for off := s.r.Off; off < s.r.End() && !failed.Load(); off += s.limit {
		p := s.at(off, deadline)
		g.Go(func() error {
			err := backing.Guard(d.name, d.opts.OnPanic, func() error { return fn(p) })
			if err != nil {
				failed.Store(true)
			}
			return err
		})
	}
	return g.Wait()
}

// rw sends one READ or WRITE of an aligned piece.
func (d *Device) rw(cmd, flags uint16, p piece) error {
	c := newCall(cmd, flags, p.off, p.n)
	c.deadline = p.deadline
	if cmd == wire.CmdRead {
		c.buf = p.buf
	} else {
		c.payload = p.buf
	}
	err := d.do(c)
	putCall(c)
	return err
}

// ranged sends one command without payload over an aligned piece.
func (d *Device) ranged(cmd, flags uint16, p piece) error {
	c := newCall(cmd, flags, p.off, p.n)
	c.deadline = p.deadline
	err := d.do(c)
	putCall(c)
	return err
}

func (d *Device) check(off, n int64) error {
	if off < 0 || n < 0 || off > d.size || n > d.size-off {
		return fmt.Errorf("%s: range %d+%d outside the remote's %d bytes: %w", d.name, off, n, d.size, syscall.EINVAL)
	}
	return nil
}

// getBlock returns a buffer of the remote's minimum block, for a head or
// tail, from the device's own pool: a remote with 512-byte blocks holds
// 512 bytes per part, as RequestMemory says, not wire.MaxMinBlock.
func (d *Device) getBlock() (*[]byte, []byte) {
	bp, _ := d.blocks.Get().(*[]byte)
	if bp == nil {
		b := make([]byte, d.minBlock)
		bp = &b
	}
	return bp, *bp
}

// requestMemory is the most one request holds here beyond its own buffer
// (Limits.RequestMemory): the blocks of an unaligned head and tail, read
// at once.
func (d *Device) requestMemory() int64 {
	if d.minBlock <= 1 {
		return 0
	}
	return 2 * d.minBlock
}

func (d *Device) ReadAt(p []byte, off int64) (n int, err error) {
	defer backing.Recover(&err, d.name, d.opts.OnPanic)
	if err := d.check(off, int64(len(p))); err != nil {
		return 0, err
	}
	head, mid, tail := d.split(off, int64(len(p)))
	if head.Len == 0 && tail.Len == 0 && mid.Len <= d.maxIO {
		if mid.Len == 0 {
			return 0, nil
		}
		if err := d.rw(wire.CmdRead, 0, piece{off: off, n: mid.Len, buf: p}); err != nil {
			return 0, err
		}
		return len(p), nil
	}
	var g errgroup.Group
	for _, e := range []backing.Range{head, tail} {
		if e.Len > 0 {
			g.Go(func() error {
				return backing.Guard(d.name, d.opts.OnPanic, func() error { return d.readPart(p[e.Off-off:e.End()-off], e.Off) })
			})
		}
	}
	err = d.run(pieces(mid, off, p, d.maxIO), func(pc piece) error { return d.rw(wire.CmdRead, 0, pc) })
	if err := g.Wait(); err != nil {
		return 0, err
	}
	if err != nil {
		return 0, err
	}
	return len(p), nil
}

// readPart reads dst, which lies inside one block at off, through a read
// of the whole block.
func (d *Device) readPart(dst []byte, off int64) error {
	blk := off / d.minBlock * d.minBlock
	bp, b := d.getBlock()
	defer d.blocks.Put(bp)
	if err := d.rw(wire.CmdRead, 0, piece{off: blk, n: d.minBlock, buf: b}); err != nil {
		return err
	}
	copy(dst, b[off-blk:])
	return nil
}

// writePart writes src (nil: zeros), which lies inside one block at off,
// by reading the block, patching it and writing it back. rmw is held
// exclusively by the caller.
func (d *Device) writePart(src []byte, off, n int64, flags uint16) error {
	blk := off / d.minBlock * d.minBlock
	bp, b := d.getBlock()
	defer d.blocks.Put(bp)
	if err := d.rw(wire.CmdRead, 0, piece{off: blk, n: d.minBlock, buf: b}); err != nil {
		return err
	}
	if src == nil {
		clear(b[off-blk : off-blk+n])
	} else {
		copy(b[off-blk:], src)
	}
	return d.rw(wire.CmdWrite, flags, piece{off: blk, n: d.minBlock, buf: b})
}

// lockRMW takes rmw for a change of data with the given head and tail:
// exclusively if it has one (it will read, patch and write back a block),
// shared otherwise; not at all when the remote's minimum block is 1. It
// returns the unlock.
func (d *Device) lockRMW(head, tail backing.Range) func() {
	switch {
	case d.minBlock == 1:
		return func() {}
	case head.Len > 0 || tail.Len > 0:
		d.rmw.Lock()
		return d.rmw.Unlock
	}
	d.rmw.RLock()
	return d.rmw.RUnlock
}

func (d *Device) WriteAt(p []byte, off int64) (n int, err error) {
	if err := d.write(p, off, 0); err != nil {
		return 0, err
	}
	return len(p), nil
}

// WriteAtDSync is a write with NBD's FUA flag: the remote answers once the
// data is durable (flush.DSyncWriter, for a FUA write that lands on this
// device alone). A remote without SEND_FUA gets ErrNotSupported, having
// been sent nothing: the flush engine then writes and flushes.
func (d *Device) WriteAtDSync(p []byte, off int64) (int, error) {
	if !d.flag(wire.TfSendFUA) {
		return 0, fmt.Errorf("%s: no SEND_FUA: %w", d.name, backing.ErrNotSupported)
	}
	if err := d.write(p, off, wire.CfFUA); err != nil {
		return 0, err
	}
	return len(p), nil
}

func (d *Device) write(p []byte, off int64, flags uint16) (err error) {
	defer backing.Recover(&err, d.name, d.opts.OnPanic)
	if err := d.writable(); err != nil {
		return err
	}
	if err := d.check(off, int64(len(p))); err != nil {
		return err
	}
	head, mid, tail := d.split(off, int64(len(p)))
	defer d.lockRMW(head, tail)()
	if head.Len == 0 && tail.Len == 0 && mid.Len <= d.maxIO {
		if mid.Len == 0 {
			return nil
		}
		return d.rw(wire.CmdWrite, flags, piece{off: off, n: mid.Len, buf: p})
	}
	err = d.run(pieces(mid, off, p, d.maxIO), func(pc piece) error { return d.rw(wire.CmdWrite, flags, pc) })
	for _, e := range []backing.Range{head, tail} {
		if err == nil && e.Len > 0 {
			err = d.writePart(p[e.Off-off:e.End()-off], e.Off, e.Len, flags)
		}
	}
	return err
}

// Sync sends one NBD_CMD_FLUSH: the remote makes every write it
// acknowledged before durable. After a connection dropped or was made
// anew with acknowledged writes unflushed, it fails, and every later call
// too (ErrUnflushedLost). A device that cannot be written has nothing to
// flush.
func (d *Device) Sync() (err error) {
	defer backing.Recover(&err, d.name, d.opts.OnPanic)
	if d.writable() != nil {
		return d.gapErr()
	}
	return d.ranged(wire.CmdFlush, 0, piece{})
}

// Discard sends TRIMs, cut inward to whole blocks and split at maxLen.
func (d *Device) Discard(off, n int64) (err error) {
	defer backing.Recover(&err, d.name, d.opts.OnPanic)
	if err := d.writable(); err != nil {
		return err
	}
	if err := d.check(off, n); err != nil {
		return err
	}
	if !d.flag(wire.TfSendTrim) {
		return fmt.Errorf("%s: no SEND_TRIM: %w", d.name, backing.ErrNotSupported)
	}
	lo, hi := roundUp(off, d.minBlock), (off+n)/d.minBlock*d.minBlock
	if lo >= hi {
		return nil
	}
	return d.run(pieces(backing.Range{Off: lo, Len: hi - lo}, lo, nil, d.maxLen),
		func(p piece) error { return d.ranged(wire.CmdTrim, 0, p) })
}

// Zero sends WRITE_ZEROES (with NO_HOLE unless mayPunch) for the whole
// blocks of the range and writes zeros into the blocks it covers in part.
// The remote does the zeroing, however it can: this is native zeroing
// from where the discard engine stands. A remote without WRITE_ZEROES
// gets ErrNotSupported, and the engine writes zeros.
func (d *Device) Zero(off, n int64, mayPunch bool) error {
	return d.zero(off, n, mayPunch, false)
}

// ZeroFast is Zero with FAST_ZERO: a remote that could only zero slowly
// says so at once (ENOTSUP), and so does this, with ErrNotSupported,
// having changed nothing. Without SEND_FAST_ZERO nothing is known fast.
func (d *Device) ZeroFast(off, n int64, mayPunch bool) error {
	return d.zero(off, n, mayPunch, true)
}

func (d *Device) zero(off, n int64, mayPunch, fast bool) (err error) {
	defer backing.Recover(&err, d.name, d.opts.OnPanic)
	if err := d.writable(); err != nil {
		return err
	}
	if err := d.check(off, n); err != nil {
		return err
	}
	if !d.flag(wire.TfSendWriteZeroes) || (fast && !d.flag(wire.TfSendFastZero)) {
		return fmt.Errorf("%s: no native zeroing: %w", d.name, backing.ErrNotSupported)
	}
	var flags uint16
	if !mayPunch {
		flags |= wire.CfNoHole
	}
	if fast {
		flags |= wire.CfFastZero
	}
	head, mid, tail := d.split(off, n)
	defer d.lockRMW(head, tail)()
	if mid.Len > 0 {
		err = d.run(pieces(mid, mid.Off, nil, d.maxLen), func(p piece) error { return d.ranged(wire.CmdWriteZeroes, flags, p) })
		if fast && errors.Is(err, syscall.EOPNOTSUPP) {
			return fmt.Errorf("%s: %w: %w", d.name, backing.ErrNotSupported, err)
		}
	}
	for _, e := range []backing.Range{head, tail} {
		if err == nil && e.Len > 0 {
			err = d.writePart(nil, e.Off, e.Len, 0)
		}
	}
	return err
}

// Cache sends NBD_CMD_CACHE (widened to whole blocks) where the remote
// takes it; elsewhere it does nothing, as a cache request is advisory and
// reading the range over the network to drop it would only cost.
func (d *Device) Cache(off, n int64) (err error) {
	defer backing.Recover(&err, d.name, d.opts.OnPanic)
	if err := d.check(off, n); err != nil {
		return err
	}
	if !d.flag(wire.TfSendCache) || n == 0 {
		return nil
	}
	lo, hi := off/d.minBlock*d.minBlock, roundUp(off+n, d.minBlock)
	return d.run(pieces(backing.Range{Off: lo, Len: hi - lo}, lo, nil, d.maxLen),
		func(p piece) error { return d.ranged(wire.CmdCache, 0, p) })
}

// maxStatusRounds bounds the BLOCK_STATUS requests one Holes call sends
// when the remote answers for less than it was asked (which NBD allows);
// the rest is reported as data, the safe answer.
const maxStatusRounds = 16

// Holes asks the remote (BLOCK_STATUS, base:allocation) which parts of
// [off, off+n) are holes that read as zeros. A remote without block
// status reports none.
func (d *Device) Holes(off, n int64) (holes []backing.Range, err error) {
	defer backing.Recover(&err, d.name, d.opts.OnPanic)
	if err := d.check(off, n); err != nil {
		return nil, err
	}
	if !d.x.Meta || n == 0 {
		return nil, nil
	}
	end := off + n
	pos, qEnd := off/d.minBlock*d.minBlock, roundUp(end, d.minBlock)
	for round := 0; round < maxStatusRounds && pos < qEnd; round++ {
		c := newCall(wire.CmdBlockStatus, 0, pos, min(qEnd-pos, d.maxLen))
		err := d.do(c)
		var got int64
		if err == nil && len(c.covered) == 1 {
			got = c.covered[0].Len
			for _, h := range c.holes {
				lo, hi := max(h.Off, off), min(h.End(), end)
				if lo >= hi {
					continue
				}
				if k := len(holes) - 1; k >= 0 && holes[k].End() == lo {
					holes[k].Len += hi - lo
				} else if len(holes) < maxHoles {
					holes = append(holes, backing.Range{Off: lo, Len: hi - lo})
				}
			}
		}
		putCall(c)
		if err != nil {
			return nil, err
		}
		if got == 0 {
			break
		}
		pos += got
	}
	return holes, nil
}
