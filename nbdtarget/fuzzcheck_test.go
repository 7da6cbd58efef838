package nbdtarget

import (
	"encoding/binary"
	"fmt"
	"slices"
	"sync/atomic"
	"testing"

	"github.com/nbdmapper/nbdmapper/mapped"
	"github.com/nbdmapper/nbdmapper/wire"
)

// The fuzzers' oracle: it reads the client's byte stream as proto.md
// defines it, predicts what a server must or may answer to each option and
// request, and checks the server's byte stream against that and against a
// model of the export's contents. The decoding here is written from the
// protocol, not from the server's code.

// Wire values, from proto.md (the server's names are not used on purpose).
const (
	wireNBDMagic    = 0x4e42444d41474943
	wireOptMagic    = 0x49484156454F5054
	wireRepMagic    = 0x3e889045565a9
	wireReqMagic    = 0x25609513
	wireSimpleMagic = 0x67446698
	wireChunkMagic  = 0x668e33ef
	wireRepErrBit   = 1 << 31
	wireStringMax   = 4096
	wireDone        = 1
)

// wireReq is one transmission request as the client sent it.
type wireReq struct {
	typ, flags uint16
	off        uint64
	n          uint32
	payload    []byte
}

// splitRequests parses a transmission stream and returns the requests a
// server has to answer: up to a bad magic, DISC, or a request or payload
// cut short by the end of the stream. It rewrites each request's cookie to
// its index + 1, in place, so that replies map to requests whatever cookies
// the input reused.
func splitRequests(in []byte) []wireReq {
	var reqs []wireReq
	for pos := 0; len(in)-pos >= 28; {
		h := in[pos:]
		if binary.BigEndian.Uint32(h) != wireReqMagic {
			break
		}
		r := wireReq{
			flags: binary.BigEndian.Uint16(h[4:]),
			typ:   binary.BigEndian.Uint16(h[6:]),
			off:   binary.BigEndian.Uint64(h[16:]),
			n:     binary.BigEndian.Uint32(h[24:]),
		}
		if r.typ == wire.CmdDisc {
			break
		}
		end := pos + 28
		if r.typ == wire.CmdWrite {
			if uint64(len(in)-end) < uint64(r.n) {
				break
			}
			r.payload = in[end : end+int(r.n)]
			end += int(r.n)
		}
		binary.BigEndian.PutUint64(h[8:], uint64(len(reqs)+1))
		reqs = append(reqs, r)
		pos = end
	}
	return reqs
}

// metaState is whether base:allocation is selected for the transmission.
type metaState uint8

const (
	metaNo metaState = iota
	metaYes
	metaMaybe // SET_META_CONTEXT then EXPORT_NAME: proto.md leaves it open
)

// session is what the handshake negotiated.
type session struct {
	x          *Export
	structured bool
	meta       metaState
	metaID     uint32
}

// expect is what a server may answer to one request.
type expect struct {
	invalid  bool     // refused at the protocol edge: the export is untouched
	mustFail bool     // success is wrong
	allowed  []uint32 // errnos allowed, 0 for success
}

func (e expect) allows(errno uint32) bool { return slices.Contains(e.allowed, errno) }

// expectFor applies proto.md's rules to r on the session's export.
func expectFor(r wireReq, s *session, m *devModel) expect {
	var bad []uint32
	size := uint64(s.x.Size())
	mutates := r.typ == wire.CmdWrite || r.typ == wire.CmdTrim || r.typ == wire.CmdWriteZeroes
	if r.typ >= wire.NumCmds {
		return expect{invalid: true, mustFail: true, allowed: []uint32{wire.EINVAL}}
	}
	allowedFlags := wire.CfFUA
	switch r.typ {
	case wire.CmdRead:
		if s.structured {
			allowedFlags |= wire.CfDF
		}
	case wire.CmdWriteZeroes:
		allowedFlags |= wire.CfNoHole | wire.CfFastZero
	case wire.CmdBlockStatus:
		allowedFlags |= wire.CfReqOne
	}
	if r.flags&^allowedFlags != 0 {
		bad = append(bad, wire.EINVAL)
	}
	if mutates && s.x.ReadOnly {
		bad = append(bad, wire.EPERM)
	}
	if r.typ == wire.CmdFlush && (r.off != 0 || r.n != 0) {
		bad = append(bad, wire.EINVAL)
	}
	metaOK := true
	if r.typ == wire.CmdBlockStatus {
		if r.n == 0 || s.meta == metaNo {
			bad = append(bad, wire.EINVAL)
		}
		metaOK = s.meta == metaYes
	}
	if r.off > size || uint64(r.n) > size-r.off {
		if r.typ == wire.CmdWrite || r.typ == wire.CmdWriteZeroes {
			bad = append(bad, wire.ENOSPC)
		} else {
			bad = append(bad, wire.EINVAL)
		}
	}
	if (r.typ == wire.CmdRead || r.typ == wire.CmdWrite) && r.n > MaxPayload {
		bad = append(bad, wire.EINVAL, wire.EOVERFLOW)
	}
	if len(bad) > 0 {
		return expect{invalid: true, mustFail: true, allowed: bad}
	}
	e := expect{allowed: []uint32{0}}
	if !metaOK {
		e.allowed = append(e.allowed, wire.EINVAL)
	}
	off, n := int64(r.off), int64(r.n)
	if n == 0 && r.typ != wire.CmdFlush && r.typ != wire.CmdBlockStatus {
		// proto.md: a zero-length request is not an error, but a server
		// may still refuse it.
		e.allowed = append(e.allowed, wire.EINVAL)
		return e
	}
	fail := func(errno uint32) {
		if !e.mustFail {
			e.mustFail, e.allowed = true, nil
		}
		e.allowed = append(e.allowed, errno)
	}
	switch r.typ {
	case wire.CmdRead, wire.CmdWrite, wire.CmdCache:
		if m.touches(off, n, clsError) || m.touches(off, n, clsFail) {
			fail(wire.EIO)
		}
	case wire.CmdTrim:
		if m.touches(off, n, clsError) {
			fail(wire.EIO)
		}
	case wire.CmdWriteZeroes:
		fast := r.flags&wire.CfFastZero != 0
		if fast && !e.mustFail {
			e.allowed = append(e.allowed, wire.ENOTSUP)
		}
		if m.touches(off, n, clsError) {
			fail(wire.EIO)
		}
		if fast && m.touches(off, n, clsNoZero) {
			fail(wire.ENOTSUP)
		}
	}
	return e
}

// fuzzHoleChunks counts the OFFSET_HOLE chunks the checker has seen, so
// that a test can tell the fuzzers' inputs reach them.
var fuzzHoleChunks atomic.Int64

// result is a request's answer, as the reply stream carried it.
type result struct {
	done   bool
	errno  uint32
	order  int    // position among completed requests
	data   []byte // READ: bytes received (holes as zeros)
	got    []bool // READ: which bytes a chunk covered
	exts   [][2]uint32
	bsSeen int // BLOCK_STATUS chunks
	data1  int // OFFSET_DATA chunks
	holes  int // OFFSET_HOLE chunks
}

// replyChecker checks one connection's transmission replies.
type replyChecker struct {
	t      testing.TB
	s      *session
	m      *devModel
	serial bool
	reqs   []wireReq
	exp    []expect
	res    []result
	nDone  int
}

// checkTransmission checks out, the server's transmission-phase bytes,
// against reqs and the model, and updates the model. In serial mode each
// request completes before the next is read, so replies come in order and
// the model is exact; otherwise every request may run concurrently with
// every other, and a read may see any value some request could have left.
//
// It returns the check for the export's contents after the session.
func checkTransmission(t testing.TB, s *session, m *devModel, serial bool, reqs []wireReq, out []byte) func(at int64, v byte) bool {
	t.Helper()
	c := &replyChecker{t: t, s: s, m: m, serial: serial, reqs: reqs,
		exp: make([]expect, len(reqs)), res: make([]result, len(reqs))}
	for i, r := range reqs {
		c.exp[i] = expectFor(r, s, m)
	}
	for len(out) > 0 {
		out = c.reply(out)
	}
	for i, r := range c.res {
		if !r.done {
			t.Fatalf("request %d (%s): no reply", i, c.describe(i))
		}
	}
	if serial {
		return m.ok
	}
	ok := c.candidates()
	for i := range c.reqs {
		c.checkData(i, ok)
	}
	return ok
}

func (c *replyChecker) describe(i int) string {
	r := c.reqs[i]
	op := "unknown"
	if int(r.typ) < wire.NumCmds {
		op = Ops[r.typ]
	}
	return fmt.Sprintf("%s flags %#x off %#x len %#x", op, r.flags, r.off, r.n)
}

func (c *replyChecker) need(out []byte, n int, what string) {
	if len(out) < n {
		c.t.Fatalf("server output ends inside %s (%d of %d bytes)", what, len(out), n)
	}
}

// req finds the request a reply's cookie names.
func (c *replyChecker) req(cookie uint64) int {
	i := int(cookie - 1)
	if cookie == 0 || cookie > uint64(len(c.reqs)) {
		c.t.Fatalf("reply for cookie %#x, which no request carried", cookie)
	}
	if c.res[i].done {
		c.t.Fatalf("second reply for request %d (%s)", i, c.describe(i))
	}
	return i
}

// reply consumes one simple reply or structured chunk.
func (c *replyChecker) reply(out []byte) []byte {
	c.need(out, 4, "a reply magic")
	switch binary.BigEndian.Uint32(out) {
	case wireSimpleMagic:
		c.need(out, 16, "a simple reply")
		errno, i := binary.BigEndian.Uint32(out[4:]), c.req(binary.BigEndian.Uint64(out[8:]))
		out = out[16:]
		r := c.reqs[i]
		if c.s.structured && (r.typ == wire.CmdRead || r.typ == wire.CmdBlockStatus) {
			c.t.Fatalf("request %d (%s): simple reply after structured replies were negotiated", i, c.describe(i))
		}
		if r.typ == wire.CmdBlockStatus && errno == 0 {
			c.t.Fatalf("request %d (%s): simple success reply to BLOCK_STATUS", i, c.describe(i))
		}
		res := &c.res[i]
		if r.typ == wire.CmdRead && errno == 0 {
			c.need(out, int(r.n), "a read's data")
			res.data = out[:r.n]
			res.got = make([]bool, r.n)
			for k := range res.got {
				res.got[k] = true
			}
			out = out[r.n:]
		}
		res.errno = errno
		c.finish(i)
		return out
	case wireChunkMagic:
		if !c.s.structured {
			c.t.Fatalf("structured reply chunk without structured replies negotiated")
		}
		c.need(out, 20, "a chunk header")
		flags, typ := binary.BigEndian.Uint16(out[4:]), binary.BigEndian.Uint16(out[6:])
		i := c.req(binary.BigEndian.Uint64(out[8:]))
		n := binary.BigEndian.Uint32(out[16:])
		c.need(out[20:], int(n), "a chunk payload")
		c.chunk(i, flags, typ, out[20:20+n])
		return out[20+n:]
	}
	c.t.Fatalf("reply magic %#x at %d bytes from the end of the output", binary.BigEndian.Uint32(out), len(out))
	return nil
}

// chunk records one structured reply chunk for request i.
func (c *replyChecker) chunk(i int, flags, typ uint16, p []byte) {
	r, res := c.reqs[i], &c.res[i]
	fail := func(format string, args ...any) {
		c.t.Helper()
		c.t.Fatalf("request %d (%s): chunk type %#x: "+format, append([]any{i, c.describe(i), typ}, args...)...)
	}
	inRange := func(off uint64, n uint64) bool {
		return off >= r.off && n <= uint64(r.n) && off-r.off <= uint64(r.n)-n
	}
	cover := func(off uint64, data []byte, n uint64) {
		if res.data == nil {
			res.data, res.got = make([]byte, r.n), make([]bool, r.n)
		}
		for k := uint64(0); k < n; k++ {
			at := off - r.off + k
			if res.got[at] {
				fail("byte %#x sent twice", off+k)
			}
			res.got[at] = true
			if data != nil {
				res.data[at] = data[k]
			}
		}
	}
	switch typ {
	case wire.ChunkNone:
		if len(p) != 0 || flags&wireDone == 0 {
			fail("NONE chunk with %d bytes, flags %#x", len(p), flags)
		}
	case wire.ChunkOffsetData:
		if r.typ != wire.CmdRead || len(p) < 8 {
			fail("OFFSET_DATA of %d bytes", len(p))
		}
		off := binary.BigEndian.Uint64(p)
		if !inRange(off, uint64(len(p)-8)) || len(p) == 8 {
			fail("OFFSET_DATA at %#x+%d outside the request", off, len(p)-8)
		}
		res.data1++
		cover(off, p[8:], uint64(len(p)-8))
	case wire.ChunkOffsetHole:
		if r.typ != wire.CmdRead || len(p) != 12 {
			fail("OFFSET_HOLE of %d bytes", len(p))
		}
		off, n := binary.BigEndian.Uint64(p), uint64(binary.BigEndian.Uint32(p[8:]))
		if !inRange(off, n) || n == 0 {
			fail("OFFSET_HOLE at %#x+%d outside the request", off, n)
		}
		res.holes++
		fuzzHoleChunks.Add(1)
		cover(off, nil, n)
	case wire.ChunkBlockStatus:
		if r.typ != wire.CmdBlockStatus || len(p) < 12 || (len(p)-4)%8 != 0 {
			fail("BLOCK_STATUS chunk of %d bytes", len(p))
		}
		if id := binary.BigEndian.Uint32(p); id != c.s.metaID {
			fail("context id %d, negotiated %d", id, c.s.metaID)
		}
		res.bsSeen++
		for q := p[4:]; len(q) > 0; q = q[8:] {
			res.exts = append(res.exts, [2]uint32{binary.BigEndian.Uint32(q), binary.BigEndian.Uint32(q[4:])})
		}
	case wire.ChunkError, wire.ChunkErrorOffset:
		if len(p) < 6 {
			fail("error chunk of %d bytes", len(p))
		}
		errno, msg := binary.BigEndian.Uint32(p), int(binary.BigEndian.Uint16(p[4:]))
		want := 6 + msg
		if typ == wire.ChunkErrorOffset {
			want += 8
		}
		if len(p) != want || errno == 0 {
			fail("error chunk of %d bytes, message %d, errno %d", len(p), msg, errno)
		}
		if typ == wire.ChunkErrorOffset {
			off := binary.BigEndian.Uint64(p[6+msg:])
			if r.typ != wire.CmdRead || !inRange(off, 1) {
				fail("ERROR_OFFSET %#x outside the request", off)
			}
		}
		if res.errno == 0 {
			res.errno = errno
		}
	default:
		fail("unknown chunk type")
	}
	if flags&wireDone != 0 {
		c.finish(i)
	}
}

// finish checks request i's complete answer and, in serial mode, applies
// it to the model.
func (c *replyChecker) finish(i int) {
	r, res, e := c.reqs[i], &c.res[i], c.exp[i]
	res.done, res.order = true, c.nDone
	c.nDone++
	fail := func(format string, args ...any) {
		c.t.Helper()
		c.t.Fatalf("request %d (%s): "+format, append([]any{i, c.describe(i)}, args...)...)
	}
	if c.serial && res.order != i {
		fail("answered out of order with one request in flight (reply %d)", res.order)
	}
	if !e.allows(res.errno) {
		fail("errno %d, allowed %v", res.errno, e.allowed)
	}
	if res.errno == 0 {
		switch r.typ {
		case wire.CmdRead:
			if res.data == nil && r.n > 0 {
				fail("success without data")
			}
			for k, ok := range res.got {
				if !ok {
					fail("byte %#x of a successful read never sent", r.off+uint64(k))
				}
			}
			if r.flags&wire.CfDF != 0 && (res.data1 > 1 || res.holes > 0) {
				fail("DF read answered in %d data and %d hole chunks", res.data1, res.holes)
			}
		case wire.CmdBlockStatus:
			if res.bsSeen != 1 {
				fail("%d BLOCK_STATUS chunks for one context", res.bsSeen)
			}
			var sum uint64
			for k, x := range res.exts {
				if x[0] == 0 || (k > 0 && sum >= uint64(r.n)) {
					fail("extent %d of %v: empty or past the request", k, res.exts)
				}
				sum += uint64(x[0])
			}
			if r.flags&wire.CfReqOne != 0 && (len(res.exts) != 1 || sum > uint64(r.n)) {
				fail("REQ_ONE answered with %v", res.exts)
			}
			if r.off+sum > uint64(c.s.x.Size()) {
				fail("extents %v run past the export", res.exts)
			}
		}
	}
	if !c.serial {
		return
	}
	c.checkData(i, c.m.ok)
	c.apply(i)
}

// checkData checks a read's bytes and a block status's zero extents with ok.
func (c *replyChecker) checkData(i int, ok func(at int64, v byte) bool) {
	r, res := c.reqs[i], &c.res[i]
	for k, have := range res.got {
		at := int64(r.off) + int64(k)
		if have && !ok(at, res.data[k]) {
			c.t.Fatalf("request %d (%s): byte %#x reads %#x, which the model does not allow (class %d, state %d, value %#x)",
				i, c.describe(i), at, res.data[k], c.m.cls[at], c.m.state[at], c.m.val[at])
		}
	}
	if r.typ != wire.CmdBlockStatus || res.errno != 0 {
		return
	}
	at := int64(r.off)
	for _, x := range res.exts {
		for k := int64(0); k < int64(x[0]) && at+k < c.s.x.Size(); k++ {
			cls := c.m.cls[at+k]
			if x[1]&mapped.StateZero != 0 && cls != clsError && !ok(at+k, 0) {
				c.t.Fatalf("request %d (%s): extent flags %#x say zero, byte %#x is %#x (state %d)",
					i, c.describe(i), x[1], at+k, c.m.val[at+k], c.m.state[at+k])
			}
		}
		at += int64(x[0])
	}
}

// apply updates the model with request i's effect.
func (c *replyChecker) apply(i int) {
	r, res, e := c.reqs[i], c.res[i], c.exp[i]
	if e.invalid {
		return
	}
	off, n := int64(r.off), int64(r.n)
	switch {
	case r.typ == wire.CmdWrite && res.errno == 0:
		c.m.set(off, r.payload, n)
	case r.typ == wire.CmdWrite:
		c.m.weaken(off, n, anyValue)
	case r.typ == wire.CmdWriteZeroes && res.errno == 0:
		c.m.set(off, nil, n)
	case r.typ == wire.CmdWriteZeroes, r.typ == wire.CmdTrim:
		c.m.weaken(off, n, exactOrZero)
	}
}

// candidates returns the concurrent-mode check: the value before the
// session, or one a request covering the byte may have left.
func (c *replyChecker) candidates() func(at int64, v byte) bool {
	size := c.s.x.Size()
	anyOK := make([]bool, size)
	zeroOK := make([]bool, size)
	var writes []int
	for i, r := range c.reqs {
		if c.exp[i].invalid {
			continue
		}
		off, n := int64(r.off), int64(r.n)
		switch {
		case r.typ == wire.CmdWrite && c.res[i].errno == 0:
			writes = append(writes, i)
		case r.typ == wire.CmdWrite:
			for k := off; k < off+n; k++ {
				anyOK[k] = true
			}
		case r.typ == wire.CmdWriteZeroes, r.typ == wire.CmdTrim:
			for k := off; k < off+n; k++ {
				zeroOK[k] = true
			}
		}
	}
	return func(at int64, v byte) bool {
		if c.m.cls[at] == clsZero {
			return v == 0
		}
		if c.m.ok(at, v) || anyOK[at] || (v == 0 && zeroOK[at] && c.m.cls[at] != clsError) {
			return true
		}
		for _, i := range writes {
			r := c.reqs[i]
			if k := at - int64(r.off); k >= 0 && k < int64(r.n) && r.payload[k] == v {
				return true
			}
		}
		return false
	}
}

// checkContents reads the export back through its table after the session
// and checks every readable byte with ok.
func checkContents(t testing.TB, x *Export, m *devModel, ok func(at int64, v byte) bool) {
	t.Helper()
	buf := make([]byte, x.Size())
	for lo := int64(0); lo < x.Size(); {
		if c := m.cls[lo]; c == clsError || c == clsFail {
			lo++
			continue
		}
		hi := lo
		for hi < x.Size() && m.cls[hi] != clsError && m.cls[hi] != clsFail {
			hi++
		}
		if _, err := x.Dev.Read(buf[lo:hi], lo); err != nil {
			t.Fatalf("reading back [%#x, %#x): %v", lo, hi, err)
		}
		for k := lo; k < hi; k++ {
			if !ok(k, buf[k]) {
				t.Fatalf("after the session byte %#x holds %#x, which the model does not allow (state %d, value %#x)",
					k, buf[k], m.state[k], m.val[k])
			}
		}
		lo = hi
	}
}
