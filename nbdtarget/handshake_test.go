package nbdtarget

import (
	"bytes"
	"encoding/binary"
	"testing"

	"github.com/nbdmapper/nbdmapper/backing"
	"github.com/nbdmapper/nbdmapper/internal/testing/nbdtest"
)

const (
	repACK     = 1
	repSERVER  = 2
	repINFO    = 3
	repMETA    = 4
	repUNSUP   = 1<<31 + 1
	repINVALID = 1<<31 + 3
	repUNKNOWN = 1<<31 + 6
	repTOOBIG  = 1<<31 + 9
)

// twoExports: "main" (1 MiB, read-write, with a description) and "ro"
// (512 KiB, read-only), both on in-memory devices.
func twoExports(t testing.TB) *Server {
	main := newExport(t, "main", seg{len: 1 << 20, dev: backing.NewMem("a", 1<<20)})
	main.Description = "main disk"
	ro := newExport(t, "ro", seg{len: 512 << 10, dev: backing.NewMem("b", 512<<10)})
	ro.ReadOnly = true
	return &Server{Exports: []*Export{main, ro}}
}

func TestHandshake(t *testing.T) {
	const rwFlags = 1 | 1<<2 | 1<<3 | 1<<5 | 1<<6 | 1<<8 | 1<<10 | 1<<11
	const roFlags = 1 | 1<<1 | 1<<2 | 1<<3 | 1<<8 | 1<<10
	tests := []struct {
		name string
		run  func(t *testing.T, c *rawClient)
	}{
		{"unknown client flags close the connection", func(t *testing.T, c *rawClient) {
			c.greet(1 << 5)
			if !c.closed() {
				t.Fatal("connection still open")
			}
		}},
		{"bad option magic closes the connection", func(t *testing.T, c *rawClient) {
			c.greet(3)
			c.write(bytes.Repeat([]byte{0xee}, 16))
			if !c.closed() {
				t.Fatal("connection still open")
			}
		}},
		{"unknown options get ERR_UNSUP and stay in sync", func(t *testing.T, c *rawClient) {
			c.greet(3)
			for _, id := range []uint32{0, 4, 5, 11, 12, 99, 1 << 31} {
				c.option(id, []byte("some data"))
				if r := c.reply(); r.typ != repUNSUP || r.opt != id {
					t.Fatalf("option %d: reply %#x for option %d", id, r.typ, r.opt)
				}
			}
			c.option(3, nil)
			if rs := c.replies(); len(rs) != 3 {
				t.Fatalf("LIST after unknown options: %d replies", len(rs))
			}
		}},
		{"oversized option is skipped with ERR_TOO_BIG", func(t *testing.T, c *rawClient) {
			c.greet(3)
			c.option(6, make([]byte, 1<<20))
			if r := c.reply(); r.typ != repTOOBIG {
				t.Fatalf("reply %#x, want ERR_TOO_BIG", r.typ)
			}
			c.option(8, nil)
			if r := c.reply(); r.typ != repACK {
				t.Fatalf("STRUCTURED_REPLY after skip: %#x", r.typ)
			}
		}},
		{"LIST names every export", func(t *testing.T, c *rawClient) {
			c.greet(3)
			c.option(3, nil)
			rs := c.replies()
			want := []string{"main", "ro"}
			if len(rs) != 3 || rs[2].typ != repACK {
				t.Fatalf("replies %+v", rs)
			}
			for i, w := range want {
				n := binary.BigEndian.Uint32(rs[i].data)
				if rs[i].typ != repSERVER || string(rs[i].data[4:4+n]) != w {
					t.Errorf("reply %d = %#x %q, want SERVER %q", i, rs[i].typ, rs[i].data, w)
				}
			}
			if got := string(rs[0].data[8:]); got != "main disk" {
				t.Errorf("description %q", got)
			}
			// No description unless the operator set one: nothing of the
			// host (such as the table's path) reaches the client.
			if got := string(rs[1].data[4+2:]); got != "" {
				t.Errorf("ro: description %q, want none", got)
			}
		}},
		{"INFO sends only what was asked for", func(t *testing.T, c *rawClient) {
			c.greet(3)
			for _, name := range []string{"main", "ro"} {
				c.option(6, infoData(name))
				rs := c.replies()
				if len(rs) != 2 || rs[0].typ != repINFO || binary.BigEndian.Uint16(rs[0].data) != 0 || rs[1].typ != repACK {
					t.Fatalf("%s: replies %+v, want INFO_EXPORT and ACK", name, rs)
				}
			}
			c.option(6, infoData("ro", 2, 3))
			rs := c.replies()
			if len(rs) != 3 || binary.BigEndian.Uint16(rs[1].data) != 3 {
				t.Fatalf("ro with DESCRIPTION and BLOCK_SIZE asked: %+v, want EXPORT, BLOCK_SIZE, ACK", rs)
			}
		}},
		{"LIST with data is invalid", func(t *testing.T, c *rawClient) {
			c.greet(3)
			c.option(3, []byte("x"))
			if r := c.reply(); r.typ != repINVALID {
				t.Fatalf("reply %#x", r.typ)
			}
		}},
		{"INFO on the default export", func(t *testing.T, c *rawClient) {
			c.greet(3)
			c.option(6, infoData("", 1, 2, 3))
			rs := c.replies()
			got := map[uint16][]byte{}
			for _, r := range rs[:len(rs)-1] {
				if r.typ != repINFO {
					t.Fatalf("reply %#x", r.typ)
				}
				got[binary.BigEndian.Uint16(r.data)] = r.data[2:]
			}
			if rs[len(rs)-1].typ != repACK {
				t.Fatalf("last reply %#x", rs[len(rs)-1].typ)
			}
			exp := got[0]
			if size, flags := binary.BigEndian.Uint64(exp), binary.BigEndian.Uint16(exp[8:]); size != 1<<20 || flags != rwFlags {
				t.Errorf("INFO_EXPORT size %d flags %#x, want %d %#x", size, flags, 1<<20, rwFlags)
			}
			if string(got[1]) != "main" || string(got[2]) != "main disk" {
				t.Errorf("name %q description %q", got[1], got[2])
			}
			bs := got[3]
			if len(bs) != 12 || binary.BigEndian.Uint32(bs) != 1 || binary.BigEndian.Uint32(bs[4:]) != 4096 || binary.BigEndian.Uint32(bs[8:]) != 32<<20 {
				t.Errorf("block size %x", bs)
			}
			// Still negotiating: GO works afterwards.
			if f := c.connect2("ro"); f != roFlags {
				t.Errorf("ro flags %#x, want %#x", f, roFlags)
			}
		}},
		{"INFO on an unknown export", func(t *testing.T, c *rawClient) {
			c.greet(3)
			c.option(6, infoData("nope"))
			if r := c.reply(); r.typ != repUNKNOWN {
				t.Fatalf("reply %#x", r.typ)
			}
		}},
		{"malformed GO is invalid", func(t *testing.T, c *rawClient) {
			c.greet(3)
			for _, d := range [][]byte{nil, {0, 0, 0, 9, 'a'}, append(infoData("main", 1), 0), infoData("main", 1)[:10]} {
				c.option(7, d)
				if r := c.reply(); r.typ != repINVALID {
					t.Fatalf("GO %x: reply %#x", d, r.typ)
				}
			}
		}},
		{"STRUCTURED_REPLY with data is invalid", func(t *testing.T, c *rawClient) {
			c.greet(3)
			c.option(8, []byte{1})
			if r := c.reply(); r.typ != repINVALID {
				t.Fatalf("reply %#x", r.typ)
			}
		}},
		{"meta contexts need structured replies", func(t *testing.T, c *rawClient) {
			c.greet(3)
			c.option(9, metaData(""))
			if r := c.reply(); r.typ != repINVALID {
				t.Fatalf("LIST_META_CONTEXT: %#x", r.typ)
			}
			c.option(10, metaData("", "base:allocation"))
			if r := c.reply(); r.typ != repINVALID {
				t.Fatalf("SET_META_CONTEXT: %#x", r.typ)
			}
		}},
		{"meta context queries", func(t *testing.T, c *rawClient) {
			c.greet(3)
			c.option(8, nil)
			c.reply()
			for _, tc := range []struct {
				opt     uint32
				data    []byte
				want    uint32 // final reply
				ctx     bool   // a META_CONTEXT reply before it
				ctxID   uint32
				comment string
			}{
				{9, metaData("main"), repACK, true, 0, "list all"},
				{9, metaData("main", "base:"), repACK, true, 0, "list namespace"},
				{9, metaData("main", "x-other:thing"), repACK, false, 0, "list other namespace"},
				{9, metaData("nope"), repUNKNOWN, false, 0, "unknown export"},
				{9, metaData("main", "base:allocation")[:12], repINVALID, false, 0, "truncated"},
				{10, metaData("main", "base:"), repACK, false, 0, "set by namespace selects nothing"},
				{10, metaData("main", "base:allocation", "base:allocation"), repACK, true, 1, "set twice"},
			} {
				c.option(tc.opt, tc.data)
				rs := c.replies()
				last := rs[len(rs)-1]
				if last.typ != tc.want {
					t.Errorf("%s: final reply %#x, want %#x", tc.comment, last.typ, tc.want)
				}
				if got := len(rs) == 2; got != tc.ctx {
					t.Errorf("%s: %d replies", tc.comment, len(rs))
				}
				if tc.ctx && len(rs) == 2 {
					if id := binary.BigEndian.Uint32(rs[0].data); id != tc.ctxID || string(rs[0].data[4:]) != "base:allocation" {
						t.Errorf("%s: context %d %q", tc.comment, id, rs[0].data[4:])
					}
				}
			}
		}},
		{"GO with structured replies advertises DF", func(t *testing.T, c *rawClient) {
			if f := c.connect("main", true, true); f != rwFlags|1<<7 {
				t.Fatalf("flags %#x, want %#x", f, rwFlags|1<<7)
			}
		}},
		{"EXPORT_NAME without NO_ZEROES sends 124 zeros", func(t *testing.T, c *rawClient) {
			c.greet(1)
			c.option(1, []byte("ro"))
			b := c.read(8 + 2 + 124)
			if binary.BigEndian.Uint64(b) != 512<<10 || binary.BigEndian.Uint16(b[8:]) != roFlags || !bytes.Equal(b[10:], make([]byte, 124)) {
				t.Fatalf("export info %x", b)
			}
			c.request(0, 0, 7, 0, 512, nil)
			if h, e, d := c.simple(512); h != 7 || e != 0 || len(d) != 512 {
				t.Fatalf("read after EXPORT_NAME: handle %d errno %d", h, e)
			}
		}},
		{"EXPORT_NAME with NO_ZEROES and the default name", func(t *testing.T, c *rawClient) {
			c.greet(3)
			c.option(1, nil)
			b := c.read(10)
			if binary.BigEndian.Uint64(b) != 1<<20 || binary.BigEndian.Uint16(b[8:]) != rwFlags {
				t.Fatalf("export info %x", b)
			}
			c.request(3, 0, 1, 0, 0, nil) // FLUSH
			if h, e, _ := c.simple(0); h != 1 || e != 0 {
				t.Fatalf("flush: handle %d errno %d", h, e)
			}
		}},
		{"EXPORT_NAME of an unknown export closes", func(t *testing.T, c *rawClient) {
			c.greet(3)
			c.option(1, []byte("nope"))
			if !c.closed() {
				t.Fatal("connection still open")
			}
		}},
		{"ABORT is acknowledged and closes", func(t *testing.T, c *rawClient) {
			c.greet(3)
			c.option(2, nil)
			if r := c.reply(); r.typ != repACK {
				t.Fatalf("reply %#x", r.typ)
			}
			if !c.closed() {
				t.Fatal("connection still open")
			}
		}},
	}
	srv := twoExports(t)
	sock := nbdtest.ServeUnix(t, srv, ErrServerClosed)
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			c := dialRaw(t, sock)
			c.t = t
			tc.run(t, c)
		})
	}
	// Broken handshakes did not disturb the server.
	c := dialRaw(t, sock)
	c.connect("main", false, false)
}

// connect2 sends GO for name on an already greeted connection.
func (c *rawClient) connect2(name string) uint16 {
	c.t.Helper()
	c.option(7, infoData(name))
	var flags uint16
	for _, r := range c.replies() {
		if r.typ == repINFO && binary.BigEndian.Uint16(r.data) == 0 {
			flags = binary.BigEndian.Uint16(r.data[10:])
		} else if r.typ != repINFO && r.typ != repACK {
			c.t.Fatalf("GO: reply %#x", r.typ)
		}
	}
	return flags
}
