package nbdtarget

import (
	"bytes"
	"encoding/binary"
	"math/bits"
	"slices"
	"testing"

	"github.com/nbdmapper/nbdmapper/wire"
)

// hsWalker follows a client's handshake bytes as proto.md defines them.
// Without check it only finds where transmission starts (which depends on
// the client's bytes alone); with check it also reads the server's bytes
// and fails the test on any reply the protocol does not allow.
type hsWalker struct {
	t       testing.TB
	exports []*Export
	in      []byte
	ip      int
	out     []byte
	op      int
	check   bool

	noZeroes   bool
	structured bool
	meta       metaState
	metaID     uint32
	metaExport *Export

	opt uint32 // the option being answered
}

// walk runs the handshake and returns the export transmission starts on,
// or nil when the session ends in the handshake (then the server must have
// sent nothing more).
func (w *hsWalker) walk() *Export {
	g := w.read(18, "the greeting")
	if w.check && (binary.BigEndian.Uint64(g) != wireNBDMagic || binary.BigEndian.Uint64(g[8:]) != wireOptMagic ||
		binary.BigEndian.Uint16(g[16:])&1 == 0) {
		w.t.Fatalf("greeting %x", g)
	}
	cf, ok := w.client(4)
	if !ok {
		return w.end()
	}
	cflags := binary.BigEndian.Uint32(cf)
	if cflags&^3 != 0 {
		return w.end() // proto.md: unknown client flags, close
	}
	w.noZeroes = cflags&2 != 0
	for {
		h, ok := w.client(16)
		if !ok || binary.BigEndian.Uint64(h) != wireOptMagic {
			return w.end()
		}
		w.opt = binary.BigEndian.Uint32(h[8:])
		n := binary.BigEndian.Uint32(h[12:])
		if n > 64<<10 && w.opt == wire.OptExportName {
			return w.end()
		}
		data, ok := w.client(int(min(n, 1<<30)))
		if !ok || uint64(n) > 1<<30 {
			return w.end()
		}
		if n > 64<<10 {
			// A server may refuse an option this long or close.
			if w.check && w.op == len(w.out) {
				return w.end()
			}
			w.errorReply()
			continue
		}
		if x, done := w.option(data); done {
			return x
		}
	}
}

// client takes n bytes of the client's stream, or reports it ends first.
func (w *hsWalker) client(n int) ([]byte, bool) {
	if len(w.in)-w.ip < n {
		return nil, false
	}
	w.ip += n
	return w.in[w.ip-n : w.ip], true
}

// read takes n bytes of the server's output; without check it returns zeros.
func (w *hsWalker) read(n int, what string) []byte {
	w.t.Helper()
	if !w.check {
		return make([]byte, n)
	}
	if len(w.out)-w.op < n {
		w.t.Fatalf("option %d: server output ends inside %s (%d of %d bytes)", w.opt, what, len(w.out)-w.op, n)
	}
	w.op += n
	return w.out[w.op-n : w.op]
}

// end checks that the server sent nothing more.
func (w *hsWalker) end() *Export {
	w.t.Helper()
	if w.check && w.op != len(w.out) {
		w.t.Fatalf("option %d: %d more bytes after the handshake ended: %x", w.opt, len(w.out)-w.op, w.out[w.op:min(w.op+64, len(w.out))])
	}
	return nil
}

type hsReply struct {
	typ  uint32
	data []byte
}

// reply reads one option reply; without check it returns want.
func (w *hsWalker) reply(want uint32) hsReply {
	w.t.Helper()
	if !w.check {
		return hsReply{typ: want}
	}
	h := w.read(20, "an option reply header")
	if m := binary.BigEndian.Uint64(h); m != wireRepMagic {
		w.t.Fatalf("option %d: reply magic %#x", w.opt, m)
	}
	if o := binary.BigEndian.Uint32(h[8:]); o != w.opt {
		w.t.Fatalf("option %d: reply for option %d", w.opt, o)
	}
	return hsReply{typ: binary.BigEndian.Uint32(h[12:]), data: w.read(int(binary.BigEndian.Uint32(h[16:])), "an option reply")}
}

func (w *hsWalker) errorReply() {
	w.t.Helper()
	if r := w.reply(wireRepErrBit); r.typ&wireRepErrBit == 0 {
		w.t.Fatalf("option %d: reply %#x, want an error", w.opt, r.typ)
	}
}

func (w *hsWalker) ack() {
	w.t.Helper()
	if r := w.reply(wire.RepAck); r.typ != wire.RepAck || len(r.data) != 0 {
		w.t.Fatalf("option %d: reply %#x with %d bytes, want ACK", w.opt, r.typ, len(r.data))
	}
}

func (w *hsWalker) lookup(name string) *Export {
	if name == "" {
		return w.exports[0]
	}
	for _, x := range w.exports {
		if x.Name == name {
			return x
		}
	}
	return nil
}

// checkFlags checks transmission flags advertised for x.
func (w *hsWalker) checkFlags(x *Export, size uint64, flags uint16) {
	w.t.Helper()
	if !w.check {
		return
	}
	if size != uint64(x.Size()) || flags&wire.TfHasFlags == 0 || (flags&wire.TfReadOnly != 0) != x.ReadOnly ||
		(!w.structured && flags&wire.TfSendDF != 0) {
		w.t.Fatalf("option %d: export %q advertised as size %d flags %#x", w.opt, x.Name, size, flags)
	}
}

// option answers one option; done means the handshake is over, with x the
// export transmission starts on (nil: the connection closes).
func (w *hsWalker) option(data []byte) (x *Export, done bool) {
	d := wireData{b: data}
	switch w.opt {
	case wire.OptExportName:
		x := w.lookup(string(data))
		if x == nil {
			return w.end(), true
		}
		b := w.read(10, "EXPORT_NAME's reply")
		w.checkFlags(x, binary.BigEndian.Uint64(b), binary.BigEndian.Uint16(b[8:]))
		if !w.noZeroes {
			if pad := w.read(124, "EXPORT_NAME's padding"); w.check && !bytes.Equal(pad, make([]byte, 124)) {
				w.t.Fatalf("EXPORT_NAME padding %x", pad)
			}
		}
		if w.meta == metaYes {
			w.meta = metaMaybe
		}
		return x, true

	case wire.OptAbort:
		if w.check && w.op < len(w.out) {
			w.ack()
		}
		return w.end(), true

	case wire.OptList:
		if len(data) != 0 {
			w.errorReply()
			return nil, false
		}
		var names []string
		for {
			r := w.reply(wire.RepAck)
			if r.typ == wire.RepAck {
				break
			}
			if r.typ != wire.RepServer || len(r.data) < 4 || uint64(binary.BigEndian.Uint32(r.data)) > uint64(len(r.data)-4) {
				w.t.Fatalf("LIST: reply %#x %x", r.typ, r.data)
			}
			names = append(names, string(r.data[4:4+binary.BigEndian.Uint32(r.data)]))
		}
		if w.check {
			slices.Sort(names)
			var want []string
			for _, x := range w.exports {
				want = append(want, x.Name)
			}
			slices.Sort(want)
			if !slices.Equal(names, want) {
				w.t.Fatalf("LIST named %q, want %q", names, want)
			}
		}
		return nil, false

	case wire.OptInfo, wire.OptGo:
		name := d.str(d.u32())
		for n := d.u16(); n > 0 && !d.bad; n-- {
			d.u16()
		}
		x := w.lookup(name)
		if !d.done() || x == nil {
			w.errorReply()
			return nil, false
		}
		sawExport := false
		for {
			r := w.reply(wire.RepAck)
			if r.typ == wire.RepAck {
				break
			}
			if r.typ != wire.RepInfo || len(r.data) < 2 {
				w.t.Fatalf("INFO/GO %q: reply %#x %x", name, r.typ, r.data)
			}
			w.info(x, r.data, &sawExport)
		}
		if w.check && !sawExport {
			w.t.Fatalf("INFO/GO %q: no INFO_EXPORT before ACK", name)
		}
		if w.opt == wire.OptInfo {
			return nil, false
		}
		if w.metaExport != x {
			w.meta = metaNo
		}
		return x, true

	case wire.OptStructuredReply:
		if len(data) != 0 {
			w.errorReply()
			return nil, false
		}
		r := w.reply(wire.RepAck)
		switch {
		case r.typ == wire.RepAck && len(r.data) == 0:
			w.structured = true
		case r.typ&wireRepErrBit != 0 && w.structured: // a second one may be refused
		default:
			w.t.Fatalf("STRUCTURED_REPLY: reply %#x", r.typ)
		}
		return nil, false

	case wire.OptListMetaContext, wire.OptSetMetaContext:
		set := w.opt == wire.OptSetMetaContext
		if set {
			w.meta, w.metaExport = metaNo, nil
		}
		name := d.str(d.u32())
		n := d.u32()
		match := n == 0 && !set
		for ; n > 0 && !d.bad; n-- {
			switch q := d.str(d.u32()); {
			case q == wire.MetaBaseAllocation:
				match = true
			case q == "base:" && !set:
				match = true
			}
		}
		x := w.lookup(name)
		if !w.structured || !d.done() || x == nil {
			w.errorReply()
			return nil, false
		}
		if !w.check {
			if set && match {
				w.meta, w.metaExport = metaYes, x
			}
			return nil, false
		}
		contexts := 0
		for {
			r := w.reply(wire.RepMetaContext)
			if r.typ == wire.RepAck {
				break
			}
			if r.typ != wire.RepMetaContext || len(r.data) < 4 || string(r.data[4:]) != wire.MetaBaseAllocation {
				w.t.Fatalf("META_CONTEXT: reply %#x %q", r.typ, r.data)
			}
			contexts++
			if set {
				w.meta, w.metaID, w.metaExport = metaYes, binary.BigEndian.Uint32(r.data), x
			}
		}
		if w.check && (contexts > 1 || (contexts == 1) != match) {
			w.t.Fatalf("META_CONTEXT: %d contexts for a query that matches: %v", contexts, match)
		}
		return nil, false
	}
	w.errorReply()
	return nil, false
}

// info checks one REP_INFO.
func (w *hsWalker) info(x *Export, b []byte, sawExport *bool) {
	if !w.check {
		return
	}
	p := b[2:]
	switch typ := binary.BigEndian.Uint16(b); typ {
	case wire.InfoExport:
		if len(p) != 10 || *sawExport {
			w.t.Fatalf("INFO_EXPORT %x (again: %v)", p, *sawExport)
		}
		*sawExport = true
		w.checkFlags(x, binary.BigEndian.Uint64(p), binary.BigEndian.Uint16(p[8:]))
	case wire.InfoName:
		if string(p) != x.Name {
			w.t.Fatalf("INFO_NAME %q for export %q", p, x.Name)
		}
	case wire.InfoDescription:
	case wire.InfoBlockSize:
		if len(p) != 12 {
			w.t.Fatalf("INFO_BLOCK_SIZE of %d bytes", len(p))
		}
		lo, pref, hi := binary.BigEndian.Uint32(p), binary.BigEndian.Uint32(p[4:]), binary.BigEndian.Uint32(p[8:])
		pow2 := func(v uint32) bool { return bits.OnesCount32(v) == 1 }
		if !pow2(lo) || lo > 64<<10 || !pow2(pref) || pref < max(512, lo) || (hi != 1<<32-1 && (hi < pref || hi%lo != 0)) {
			w.t.Fatalf("INFO_BLOCK_SIZE %d %d %d", lo, pref, hi)
		}
	default:
		w.t.Fatalf("INFO type %d nobody asked for", typ)
	}
}

// wireData decodes option data as proto.md lays it out; a read past the
// end, or a string over proto.md's 4096-byte limit, sets bad.
type wireData struct {
	b   []byte
	bad bool
}

func (d *wireData) take(n uint64) []byte {
	if d.bad || n > uint64(len(d.b)) {
		d.bad, d.b = true, nil
		return nil
	}
	v := d.b[:n]
	d.b = d.b[n:]
	return v
}

func (d *wireData) u16() uint16 {
	if v := d.take(2); v != nil {
		return binary.BigEndian.Uint16(v)
	}
	return 0
}

func (d *wireData) u32() uint32 {
	if v := d.take(4); v != nil {
		return binary.BigEndian.Uint32(v)
	}
	return 0
}

func (d *wireData) str(n uint32) string {
	if n > wireStringMax {
		d.bad = true
	}
	return string(d.take(uint64(n)))
}

func (d *wireData) done() bool { return !d.bad && len(d.b) == 0 }
