package main

import (
	"bufio"
	"bytes"
	"crypto/tls"
	"crypto/x509"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/nbdmapper/nbdmapper/internal/testing/nbdtest"
	"github.com/nbdmapper/nbdmapper/internal/testing/sparse"
)

// A differential test of every way the server answers a read (issue 47):
// each row of readPaths is one path through the server, and every row
// gets reads of every size class at every alignment class, from a raw
// client (nbdtest, simple or structured replies as the row says, over TLS
// on the tls rows) and from libnbd (nbdsh), each compared byte for byte with what pread of the
// backing files returns through a model of the export's table (layout).
// Then a seeded sequence of writes, trims and write-zeroes of the same
// classes goes to the export (from either client) and to an in-memory copy; the export, and the
// backing files through the layout, must then hold what the copy holds.
//
// A fast path added later joins the test as one more row (and, if it needs
// a table of its own, one more case in makeExport).

// readPath is one way through the server.
type readPath struct {
	name       string
	server     string // "" (default flags), "nosplice" (--splice=false) or "tls" (--tls require)
	export     string // the kind of table, as makeExport knows it; each row gets its own
	structured bool   // the raw client and libnbd negotiate structured replies
	libnbdOps  bool   // libnbd sends the writes, trims and zeroes (else the raw client)
	splice     splice // whether reads are spliced
	holes      bool   // some reads must come back as hole chunks
	dropsTrim  bool   // trims change nothing (else the whole 4 KiB blocks they cover read as zeros)
}

// splice is what a row's reads must show of splicing
// (nbdmapper_read_spliced_bytes_total).
type splice int

const (
	spliceMay  splice = iota // some lines splice, others cannot
	spliceSome               // reads of 128 KiB to 1 MiB inside one line of a file are spliced
	spliceNone               // nothing is spliced
)

var readPaths = []readPath{
	{name: "buffered/simple", server: "nosplice", export: "lin", splice: spliceNone},
	{name: "buffered/structured", server: "nosplice", export: "lin", structured: true, splice: spliceNone},
	{name: "spliced/simple", export: "lin", splice: spliceSome},
	{name: "spliced/structured", export: "lin", structured: true, splice: spliceSome},
	{name: "sparse/structured", export: "sparse", structured: true, splice: spliceSome, holes: true},
	{name: "sparse/simple", export: "sparse", splice: spliceSome, libnbdOps: true},
	{name: "tls/structured", server: "tls", export: "lin", structured: true, libnbdOps: true, splice: spliceNone},
	{name: "tls/simple", server: "tls", export: "lin", splice: spliceNone},
	{name: "striped", export: "str", structured: true, splice: spliceNone}, // 64 KiB chunks: under spliceMin
	{name: "stacked", export: "stk", splice: spliceSome},
	{name: "snapshot", export: "snap", structured: true, splice: spliceNone, dropsTrim: true}, // no discard_zeroes_cow
	{name: "remote/nbdkit", export: "rk", structured: true},
	{name: "remote/qemu-nbd", export: "rq", libnbdOps: true},
}

const (
	kib = 1 << 10
	mib = 1 << 20
	// exportSize is every export's size: room for a 33 MiB read at a few
	// MiB in.
	exportSize = 36 * mib
)

// Size classes: 32 MiB is MaxPayload, 33 MiB is streamed in pieces; 128
// KiB to 1 MiB are spliced on plain connections, 1 MiB + 512 is not.
var (
	smallSizes = []int64{512, 4 * kib, 64*kib - 512, 128 * kib, mib, mib + 512}
	bigReads   = []struct{ off, n int64 }{{512, 32 * mib}, {4*kib - 512, 33 * mib}}
)

// offsets are the alignment classes of an export with these boundaries
// (segment, chunk, stripe, hole edges): 0, 512, 4096 ± 512 and each
// boundary and ± 512.
func offsets(bounds []int64) []int64 {
	offs := []int64{0, 512, 4*kib - 512, 4*kib + 512}
	for _, b := range bounds {
		offs = append(offs, b-512, b, b+512)
	}
	return offs
}

// readPlan is every (offset, length) read of a path: each small size at
// each alignment class, and the big reads once each.
func readPlan(bounds []int64) [][2]int64 {
	var plan [][2]int64
	for _, off := range offsets(bounds) {
		for _, n := range smallSizes {
			if off+n <= exportSize {
				plan = append(plan, [2]int64{off, n})
			}
		}
	}
	for _, r := range bigReads {
		plan = append(plan, [2]int64{r.off, r.n})
	}
	return plan
}

// layout models a table: which backing bytes an export's bytes are.
type layout interface {
	size() int64
	// readAt fills p with the export's bytes at off, read from the
	// backing files.
	readAt(t *testing.T, p []byte, off int64)
}

// fileAt is a linear line: n bytes of path from off.
type fileAt struct {
	path   string
	off, n int64
}

func (f fileAt) size() int64 { return f.n }

func (f fileAt) readAt(t *testing.T, p []byte, off int64) {
	t.Helper()
	fd, err := os.Open(f.path)
	if err != nil {
		t.Fatal(err)
	}
	defer fd.Close()
	if _, err := fd.ReadAt(p, f.off+off); err != nil {
		t.Fatalf("pread %s: %v", f.path, err)
	}
}

// concat is a table of several lines, in order.
type concat []layout

func (c concat) size() (n int64) {
	for _, l := range c {
		n += l.size()
	}
	return n
}

func (c concat) readAt(t *testing.T, p []byte, off int64) {
	for _, l := range c {
		if len(p) == 0 {
			return
		}
		if off >= l.size() {
			off -= l.size()
			continue
		}
		k := min(int64(len(p)), l.size()-off)
		l.readAt(t, p[:k], off)
		p, off = p[k:], 0
	}
}

// striped is dm-stripe: chunk i of the export is chunk i/len(legs) of leg
// i%len(legs).
type striped struct {
	chunk int64
	legs  []layout
}

func (s striped) size() int64 { return s.legs[0].size() * int64(len(s.legs)) }

func (s striped) readAt(t *testing.T, p []byte, off int64) {
	for len(p) > 0 {
		i, in := off/s.chunk, off%s.chunk
		k := min(int64(len(p)), s.chunk-in)
		s.legs[i%int64(len(s.legs))].readAt(t, p[:k], i/int64(len(s.legs))*s.chunk+in)
		p, off = p[k:], off+k
	}
}

// snap is a persistent dm-snapshot: a chunk with an exception in the COW
// reads from its COW chunk, any other from the origin. The exceptions
// are read from the COW file's metadata areas (the format REFERENCE.md
// describes) each time, so the model follows what the server stored.
type snap struct {
	origin layout
	cow    string
	chunk  int64 // bytes
}

func (s snap) size() int64 { return s.origin.size() }

func (s snap) exceptions(t *testing.T) map[int64]int64 {
	t.Helper()
	b, err := os.ReadFile(s.cow)
	if err != nil {
		t.Fatal(err)
	}
	le := binary.LittleEndian
	if le.Uint32(b) != 0x70416e53 || le.Uint32(b[4:]) != 1 || int64(le.Uint32(b[12:]))*512 != s.chunk {
		t.Fatalf("%s: no valid snapshot header: % x", s.cow, b[:16])
	}
	perArea := s.chunk / 16
	ex := map[int64]int64{}
	for area := int64(0); ; area++ {
		meta := b[(1+area*(perArea+1))*s.chunk:][:s.chunk]
		for e := range perArea {
			old, cow := int64(le.Uint64(meta[16*e:])), int64(le.Uint64(meta[16*e+8:]))
			if cow == 0 {
				return ex
			}
			ex[old] = cow
		}
	}
}

func (s snap) readAt(t *testing.T, p []byte, off int64) {
	ex := s.exceptions(t)
	cow := fileAt{path: s.cow, n: 1 << 62}
	for len(p) > 0 {
		i, in := off/s.chunk, off%s.chunk
		k := min(int64(len(p)), s.chunk-in)
		if c, ok := ex[i]; ok {
			cow.readAt(t, p[:k], c*s.chunk+in)
		} else {
			s.origin.readAt(t, p[:k], off)
		}
		p, off = p[k:], off+k
	}
}

// image is the whole export as the backing files hold it.
func image(t *testing.T, l layout) []byte {
	t.Helper()
	b := make([]byte, l.size())
	l.readAt(t, b, 0)
	return b
}

// exportDef is an export's tables (it and any export it stacks on), the
// model of its table and its boundaries.
type exportDef struct {
	tables map[string]string
	layout layout
	bounds []int64
	prime  func(t *testing.T, c *nbdtest.Client) // writes made once, before any row reads
}

// randomFile makes path size bytes of seeded random data, so that a byte
// read from the wrong place is caught.
func randomFile(t *testing.T, path string, size int64) string {
	t.Helper()
	seed := [32]byte{}
	copy(seed[:], filepath.Base(filepath.Dir(path))+"/"+filepath.Base(path))
	b := make([]byte, size)
	rand.NewChaCha8(seed).Read(b)
	if err := os.WriteFile(path, b, 0o644); err != nil {
		t.Fatal(err)
	}
	return path
}

// makeExport creates the backing files of export name in dir (and starts
// the remote servers it needs) and returns its definition. Tables use
// sectors, the layouts bytes.
func makeExport(t *testing.T, dir, kind, name string) exportDef {
	t.Helper()
	p := func(f string) string { return filepath.Join(dir, name+"-"+f) }
	f := func(format string, args ...any) string {
		return strings.ReplaceAll(fmt.Sprintf(format, args...), "@", name+"-")
	}
	switch kind {
	case "lin": // two files, each from an offset; the line boundary at 8 MiB
		a := randomFile(t, p("a.img"), 8*mib+4*kib)
		b := randomFile(t, p("b.img"), 29*mib)
		return exportDef{
			tables: map[string]string{name: f("0 16384 linear @a.img 8\n16384 57344 linear @b.img 2048\n")},
			layout: concat{fileAt{a, 4 * kib, 8 * mib}, fileAt{b, mib, 28 * mib}},
			bounds: []int64{8 * mib},
		}
	case "sparse": // every MiB: data [0, 192K), hole, data [516K, 640K), hole
		s := sparse.Create(t, p("s.img"), exportSize)
		fd, err := os.OpenFile(s, os.O_WRONLY, 0)
		if err != nil {
			t.Fatal(err)
		}
		rng := rand.NewChaCha8([32]byte{'s'})
		for m := int64(0); m < exportSize; m += mib {
			for _, r := range [][2]int64{{0, 192 * kib}, {516 * kib, 640 * kib}} {
				b := make([]byte, r[1]-r[0])
				rng.Read(b)
				if _, err := fd.WriteAt(b, m+r[0]); err != nil {
					t.Fatal(err)
				}
			}
		}
		fd.Close()
		return exportDef{
			tables: map[string]string{name: f("0 73728 linear @s.img 0\n")},
			layout: fileAt{s, 0, exportSize},
			bounds: []int64{192 * kib, 516 * kib, 640 * kib, mib, 3*mib + 192*kib},
		}
	case "str": // two legs, 64 KiB chunks, the first leg from 4 KiB in
		c := randomFile(t, p("c.img"), 18*mib+4*kib)
		d := randomFile(t, p("d.img"), 18*mib)
		return exportDef{
			tables: map[string]string{name: f("0 73728 striped 2 128 @c.img 8 @d.img 0\n")},
			layout: striped{64 * kib, []layout{fileAt{c, 4 * kib, 18 * mib}, fileAt{d, 0, 18 * mib}}},
			bounds: []int64{64 * kib, 128 * kib, 192 * kib, 9 * mib},
		}
	case "stk": // 8 MiB of /dev/mapper/base from 512 KiB in, then a file
		o := randomFile(t, p("o.img"), 10*mib)
		e := randomFile(t, p("e.img"), 28*mib)
		base := fileAt{o, 0, 10 * mib}
		return exportDef{
			tables: map[string]string{
				name + "base": f("0 20480 linear @o.img 0\n"),
				name:          f("0 16384 linear /dev/mapper/%sbase 1024\n16384 57344 linear @e.img 0\n", name),
			},
			layout: concat{concat{base}.sub(512*kib, 8*mib), fileAt{e, 0, 28 * mib}},
			bounds: []int64{8 * mib},
		}
	case "snap": // 256 KiB chunks, some copied out by prime
		g := randomFile(t, p("g.img"), exportSize)
		cow := sparse.Create(t, p("cow.img"), 40*mib)
		return exportDef{
			tables: map[string]string{name: f("0 73728 snapshot @g.img @cow.img P 512\n")},
			layout: snap{fileAt{g, 0, exportSize}, cow, 256 * kib},
			bounds: []int64{256 * kib, 768 * kib, mib, 2 * mib},
			prime: func(t *testing.T, c *nbdtest.Client) {
				for _, w := range [][2]int64{{256*kib + 512, 1024}, {768*kib - 512, 1024}, {mib, 64 * kib}} {
					b := bytes.Repeat([]byte{byte(w[0] >> 9)}, int(w[1]))
					if err := c.Pwrite(b, w[0], false); err != nil {
						t.Fatalf("prime the snapshot: %v", err)
					}
				}
			},
		}
	case "rk": // a file, then 32 MiB of an nbdkit file export
		h := randomFile(t, p("h.img"), 4*mib)
		r := randomFile(t, p("r.img"), 32*mib)
		peer := nbdtest.StartNbdkit(t, dir, name, nbdtest.PeerOptions{}, "file", r)
		return exportDef{
			tables: map[string]string{name: f("0 8192 linear @h.img 0\n8192 65536 linear %s 0\n", peer.URI(""))},
			layout: concat{fileAt{h, 0, 4 * mib}, fileAt{r, 0, 32 * mib}},
			bounds: []int64{4 * mib},
		}
	case "rq": // 32 MiB of a qemu-nbd export from 2 MiB in, then a file
		q := randomFile(t, p("q.img"), 34*mib)
		i := randomFile(t, p("i.img"), 4*mib)
		peer := nbdtest.StartQemuNbd(t, dir, name, q, nbdtest.PeerOptions{})
		return exportDef{
			tables: map[string]string{name: f("0 65536 linear %s 4096\n65536 8192 linear @i.img 0\n", peer.URI("e"))},
			layout: concat{fileAt{q, 2 * mib, 32 * mib}, fileAt{i, 0, 4 * mib}},
			bounds: []int64{32 * mib},
		}
	}
	t.Fatalf("no export %q", name)
	return exportDef{}
}

// sub is n bytes of c from off.
func (c concat) sub(off, n int64) layout { return window{c, off, n} }

// window is n bytes of a layout from off: a linear line onto a device
// that is itself an export.
type window struct {
	l      layout
	off, n int64
}

func (w window) size() int64                              { return w.n }
func (w window) readAt(t *testing.T, p []byte, off int64) { w.l.readAt(t, p, w.off+off) }

// rig is the servers the rows run on, each in its own directory. Every
// row has an export of its own, with its own backing files, so that what
// one row's writes leave (holes, copied-out chunks) is not what the next
// row reads.
type rig struct {
	servers map[string]*server
	exports []exportDef // by row
	names   []string    // by row: the export's name
	pki     *pki
}

func startRig(t *testing.T, paths []readPath) *rig {
	t.Helper()
	r := &rig{servers: map[string]*server{}, exports: make([]exportDef, len(paths)), names: make([]string, len(paths))}
	for _, srv := range []string{"", "nosplice", "tls"} {
		dir := nbdtest.ShortDir(t)
		args := []string{"--control", "off"}
		switch srv {
		case "nosplice":
			args = append(args, "--splice=false")
		case "tls":
			r.pki = newPKI(t, "alice")
			args = append(append(args, "--tls", "require"), r.pki.tlsArgs()...)
		}
		var rows []int
		for i, p := range paths {
			if p.server != srv {
				continue
			}
			rows = append(rows, i)
			r.names[i] = fmt.Sprintf("%s%d", p.export, i)
			r.exports[i] = makeExport(t, dir, p.export, r.names[i])
			for n, text := range r.exports[i].tables {
				writeFile(t, filepath.Join(dir, n+".table"), text)
				args = append(args, n+"="+n+".table")
			}
		}
		if rows == nil {
			continue
		}
		s := serve(t, dir, args...)
		r.servers[srv] = s
		for _, i := range rows {
			if r.exports[i].prime == nil {
				continue
			}
			c, err := nbdtest.Dial(s.Socket, r.names[i])
			if err != nil {
				t.Fatal(err)
			}
			r.exports[i].prime(t, c)
			c.Close()
		}
	}
	return r
}

// tlsConfig is the raw client's TLS configuration for row p: alice's
// certificate, and the test CA; nil on a plain server.
func (r *rig) tlsConfig(t *testing.T, p readPath) *tls.Config {
	t.Helper()
	if p.server != "tls" {
		return nil
	}
	dir := r.pki.clients["alice"]
	cert, err := tls.LoadX509KeyPair(filepath.Join(dir, "client-cert.pem"), filepath.Join(dir, "client-key.pem"))
	if err != nil {
		t.Fatal(err)
	}
	roots := x509.NewCertPool()
	roots.AddCert(r.pki.ca.Cert)
	return &tls.Config{Certificates: []tls.Certificate{cert}, RootCAs: roots, ServerName: "localhost"}
}

func (r *rig) uri(i int) string {
	s := r.servers[readPaths[i].server]
	if readPaths[i].server == "tls" {
		return "nbds+unix:///" + r.names[i] + "?socket=" + s.Socket + "&tls-certificates=" + r.pki.clients["alice"]
	}
	return s.URI(r.names[i])
}

// TestReadPaths runs every row of readPaths: the differential reads, then
// writes, trims and zeroes against a model.
func TestReadPaths(t *testing.T) {
	nbdtest.Tool(t, "nbdkit")
	nbdtest.Tool(t, "qemu-nbd")
	r := startRig(t, readPaths)
	for i, p := range readPaths {
		t.Run(p.name, func(t *testing.T) {
			def, name := r.exports[i], r.names[i]
			s := r.servers[p.server]
			if got := def.layout.size(); got != exportSize {
				t.Fatalf("layout of %s is %d bytes, want %d", name, got, exportSize)
			}
			var opts []nbdtest.DialOption
			if p.structured {
				opts = append(opts, nbdtest.Structured)
			}
			c, err := nbdtest.DialTLS("unix", s.Socket, name, r.tlsConfig(t, p), opts...)
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			lib := startLibnbd(t, r.uri(i), p.structured)
			defer lib.close(t)

			// Reads: both clients against pread of the backing files.
			want := image(t, def.layout)
			plan := readPlan(def.bounds)
			holes, bad := 0, 0
			for _, rd := range plan {
				got := make([]byte, rd[1])
				h, err := readRaw(c, got, rd[0])
				if err != nil {
					t.Fatalf("raw read %d+%d: %v", rd[0], rd[1], err)
				}
				holes += h
				if i := firstDiff(got, want[rd[0]:][:rd[1]]); i >= 0 {
					if bad++; bad <= 5 {
						t.Errorf("raw read %d+%d: byte %d differs from the backing files", rd[0], rd[1], rd[0]+int64(i))
					}
				}
			}
			if bad > 0 {
				t.Errorf("raw reads: %d of %d differ from the backing files", bad, len(plan))
			}
			ref := filepath.Join(t.TempDir(), "ref.img")
			if err := os.WriteFile(ref, want, 0o644); err != nil {
				t.Fatal(err)
			}
			small := plan[:len(plan)-len(bigReads)]
			lib.do(t, libnbdCmd{Ref: ref, Reads: append(small[:len(small):len(small)], plan[len(plan)-1])}) // the streamed one of the big reads

			// What the rows claim about the path they take.
			if p.holes && holes == 0 {
				t.Errorf("no read came back with a hole chunk")
			}
			if !p.holes && holes > 0 {
				t.Errorf("%d hole chunks from an export without holes", holes)
			}
			spliced := func() float64 {
				return scrapeValue(t, s.metrics, `nbdmapper_read_spliced_bytes_total{export="`+name+`"}`)
			}
			switch p.splice {
			case spliceSome:
				nbdtest.Until(t, "a spliced read to be counted", func() bool { return spliced() > 0 })
			case spliceNone:
				if n := spliced(); n != 0 {
					t.Errorf("%v bytes spliced on a path that must not splice", n)
				}
			}

			// Writes, trims and zeroes against a model.
			m := &model{data: want, loose: make([]bool, exportSize/512), dropsTrim: p.dropsTrim}
			ops, payload := opPlan(uint64(i), def.bounds)
			if p.libnbdOps {
				pf := filepath.Join(t.TempDir(), "payload")
				if err := os.WriteFile(pf, payload, 0o644); err != nil {
					t.Fatal(err)
				}
				lib.do(t, libnbdCmd{Ops: ops, Payload: pf})
				for _, op := range ops {
					m.apply(op, payload)
				}
			} else {
				for _, op := range ops {
					if err := op.raw(c, payload); err != nil {
						t.Fatalf("%s: %v", op, err)
					}
					m.apply(op, payload)
				}
			}
			got := make([]byte, exportSize)
			for off := int64(0); off < exportSize; off += 4 * mib {
				if _, err := readRaw(c, got[off:off+4*mib], off); err != nil {
					t.Fatalf("read back %d: %v", off, err)
				}
			}
			m.check(t, "the export after the writes", got)
			after := image(t, def.layout)
			m.check(t, "the backing files after the writes", after)
			if err := os.WriteFile(ref, after, 0o644); err != nil {
				t.Fatal(err)
			}
			lib.do(t, libnbdCmd{Ref: ref, Reads: small})
		})
	}
}

// readRaw reads len(p) bytes at off with one request, taking the reply's
// chunks (hole chunks as zeros) and checking that they cover the range
// exactly once. It returns how many hole chunks came.
func readRaw(c *nbdtest.Client, p []byte, off int64) (holes int, err error) {
	const handle = 47
	if err := c.Send(nbdtest.CmdRead, 0, handle, uint64(off), uint32(len(p))); err != nil {
		return 0, err
	}
	var covered int64
	for {
		r, err := c.Recv()
		if err != nil {
			return holes, err
		}
		if r.Handle != handle {
			return holes, fmt.Errorf("reply for handle %d", r.Handle)
		}
		if r.Errno != 0 {
			return holes, nbdtest.ErrnoError(r.Errno)
		}
		switch {
		case r.Simple:
			_, err := io.ReadFull(c, p)
			return 0, err
		case r.Type == 1 || r.Type == 2:
			n := r.DataLen
			if r.Type == 2 {
				n = int64(binary.BigEndian.Uint32(r.Payload[8:]))
				holes++
			}
			in := int64(r.Offset) - off
			if in < 0 || in+n > int64(len(p)) {
				return holes, fmt.Errorf("chunk %d+%d outside the read", r.Offset, n)
			}
			if r.Type == 1 {
				if _, err := io.ReadFull(c, p[in:in+n]); err != nil {
					return holes, err
				}
			} else {
				clear(p[in : in+n])
			}
			covered += n
		case r.Type != 0:
			return holes, fmt.Errorf("unexpected chunk type %d", r.Type)
		}
		if r.Done() {
			if covered != int64(len(p)) {
				return holes, fmt.Errorf("chunks cover %d of %d bytes", covered, len(p))
			}
			return holes, nil
		}
	}
}

func firstDiff(a, b []byte) int {
	if bytes.Equal(a, b) {
		return -1
	}
	for i := range a {
		if a[i] != b[i] {
			return i
		}
	}
	return len(a)
}

// op is one write ('w'), trim ('t') or write-zeroes ('z'); a write's data
// is payload[at:at+n]. It marshals as libnbdSession's script takes it.
type op struct {
	kind   byte
	off, n int64
	flags  uint16 // NBD command flags: FUA, NO_HOLE (libnbd uses the same bits)
	at     int64
}

func (o op) String() string { return fmt.Sprintf("%c %d+%d flags %#x", o.kind, o.off, o.n, o.flags) }

func (o op) MarshalJSON() ([]byte, error) {
	return json.Marshal([]any{string(o.kind), o.off, o.n, o.flags, o.at})
}

// opPlan is a seeded sequence of operations of the size and alignment
// classes, beginning with a streamed (33 MiB) write at an unaligned
// offset, and their write payload.
func opPlan(seed uint64, bounds []int64) ([]op, []byte) {
	rng := rand.New(rand.NewPCG(47, seed))
	offs := offsets(bounds)
	ops := []op{{kind: 'w', off: 4*kib - 512, n: 33 * mib}}
	for len(ops) < 24 {
		o := op{off: offs[rng.IntN(len(offs))], n: smallSizes[rng.IntN(len(smallSizes))]}
		if o.off+o.n > exportSize {
			continue
		}
		switch k := rng.IntN(10); {
		case k < 5:
			o.kind = 'w'
		case k < 7:
			o.kind = 't'
		default:
			o.kind = 'z'
			if rng.IntN(2) == 0 {
				o.flags |= nbdtest.FlagNoHole
			}
		}
		if rng.IntN(8) == 0 {
			o.flags |= nbdtest.FlagFUA
		}
		ops = append(ops, o)
	}
	// A last trim, which no write covers again, starting inside a block.
	ops = append(ops, op{kind: 't', off: 4*kib - 512, n: 128 * kib})
	var payload []byte
	for i := range ops {
		if ops[i].kind == 'w' {
			ops[i].at = int64(len(payload))
			b := make([]byte, ops[i].n)
			for j := 0; j < len(b); j += 8 {
				binary.LittleEndian.PutUint64(b[j:], rng.Uint64())
			}
			payload = append(payload, b...)
		}
	}
	return ops, payload
}

// raw sends the operation with the raw client and waits for its reply.
func (o op) raw(c *nbdtest.Client, payload []byte) error {
	typ := map[byte]uint16{'w': nbdtest.CmdWrite, 't': nbdtest.CmdTrim, 'z': nbdtest.CmdWriteZeroes}[o.kind]
	if err := c.Send(typ, o.flags, 48, uint64(o.off), uint32(o.n)); err != nil {
		return err
	}
	if o.kind == 'w' {
		if _, err := c.Write(payload[o.at : o.at+o.n]); err != nil {
			return err
		}
	}
	r, err := c.Recv()
	switch {
	case err != nil:
		return err
	case r.Handle != 48 || !r.Done():
		return fmt.Errorf("reply %+v", r)
	case r.Errno != 0:
		return nbdtest.ErrnoError(r.Errno)
	}
	return nil
}

// model is what the export must hold: data, except for sectors a trim
// left (loose). A trim promises nothing about what they read, and the
// server cuts trims inward to the file system's 4 KiB blocks, so a loose
// sector may read as its old data or as zeros, and a whole loose block,
// punched, must read as zeros; unless the export drops trims (dropsTrim),
// when they change nothing.
type model struct {
	data      []byte
	loose     []bool // per 512-byte sector
	dropsTrim bool
}

func (m *model) apply(o op, payload []byte) {
	if o.kind == 't' && m.dropsTrim {
		return
	}
	d := m.data[o.off : o.off+o.n]
	switch o.kind {
	case 'w':
		copy(d, payload[o.at:o.at+o.n])
	case 'z':
		clear(d)
	}
	for s := o.off / 512; s < (o.off+o.n)/512; s++ {
		m.loose[s] = o.kind == 't'
	}
}

func (m *model) check(t *testing.T, what string, got []byte) {
	t.Helper()
	bad := 0
	zero := make([]byte, 512)
	for s := range m.loose {
		g, w := got[s*512:][:512], m.data[s*512:][:512]
		if !m.loose[s] && bytes.Equal(g, w) {
			continue
		}
		block := s / 8 * 8
		punched := block+8 <= len(m.loose) && !slices.Contains(m.loose[block:block+8], false)
		ok := bytes.Equal(g, w)
		switch {
		case punched:
			ok = bytes.Equal(g, zero)
		case m.loose[s]:
			ok = true
			for i := range g {
				ok = ok && (g[i] == w[i] || g[i] == 0)
			}
		}
		if ok {
			continue
		}
		if bad++; bad <= 5 {
			t.Errorf("%s: sector at %d differs from the model (trimmed: %v, in a trimmed 4 KiB block: %v)", what, s*512, m.loose[s], punched)
		}
	}
	if bad > 5 {
		t.Errorf("%s: %d sectors differ from the model", what, bad)
	}
}

// libnbdSession is one nbdsh process connected to an export, doing what
// each JSON line on its standard input asks: reads compared with a
// reference file (os.pread), or operations; it answers each line with the
// list of failures.
type libnbdSession struct {
	cmd  *exec.Cmd
	in   io.WriteCloser
	out  *bufio.Scanner
	errs strings.Builder
}

type libnbdCmd struct {
	Ref     string     `json:"ref,omitempty"`
	Reads   [][2]int64 `json:"reads,omitempty"`
	Ops     []op       `json:"ops,omitempty"`
	Payload string     `json:"payload,omitempty"`
}

const libnbdScript = `
import json, os, sys
h.set_uri_allow_local_file(True)
h.set_request_structured_replies(STRUCTURED)
h.connect_uri(URI)
assert h.get_structured_replies_negotiated() == STRUCTURED
for line in sys.stdin:
    cmd = json.loads(line)
    bad = []
    if cmd.get("ops"):
        pfd = os.open(cmd["payload"], os.O_RDONLY)
        for kind, off, n, flags, at in cmd["ops"]:
            try:
                if kind == "w":
                    h.pwrite(os.pread(pfd, n, at), off, flags)
                elif kind == "t":
                    h.trim(n, off, flags)
                else:
                    h.zero(n, off, flags)
            except nbd.Error as e:
                bad.append("%s %d+%d: %s" % (kind, off, n, e))
        os.close(pfd)
    else:
        fd = os.open(cmd["ref"], os.O_RDONLY)
        for off, n in cmd["reads"]:
            try:
                got = h.pread(n, off)
            except nbd.Error as e:
                bad.append("libnbd pread(%d, %d): %s" % (n, off, e))
                continue
            want = os.pread(fd, n, off)
            if got != want:
                i = next(k for k in range(n) if got[k] != want[k])
                bad.append("libnbd pread(%d, %d): byte %d differs from the backing files" % (n, off, off + i))
        os.close(fd)
    print(json.dumps(bad), flush=True)
`

func startLibnbd(t *testing.T, uri string, structured bool) *libnbdSession {
	t.Helper()
	py := map[bool]string{true: "True", false: "False"}[structured]
	l := &libnbdSession{cmd: nbdtest.Nbdsh(t, "-c", fmt.Sprintf("URI = %q\nSTRUCTURED = %s\n", uri, py), "-c", libnbdScript)}
	var err error
	if l.in, err = l.cmd.StdinPipe(); err != nil {
		t.Fatal(err)
	}
	stdout, err := l.cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	l.out = bufio.NewScanner(stdout)
	l.out.Buffer(nil, 1<<20)
	l.cmd.Stderr = &l.errs
	if err := l.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	return l
}

// do sends one command and reports each failure it answers with.
func (l *libnbdSession) do(t *testing.T, c libnbdCmd) {
	t.Helper()
	b, _ := json.Marshal(c)
	if _, err := l.in.Write(append(b, '\n')); err != nil {
		t.Fatalf("nbdsh: %v\n%s", err, l.errs.String())
	}
	if !l.out.Scan() {
		l.cmd.Wait()
		t.Fatalf("nbdsh ended: %v\n%s", l.out.Err(), l.errs.String())
	}
	var bad []string
	if err := json.Unmarshal(l.out.Bytes(), &bad); err != nil {
		t.Fatalf("nbdsh answered %q: %v", l.out.Text(), err)
	}
	for i, b := range bad {
		if i == 5 {
			t.Errorf("nbdsh: %d failures in all", len(bad))
			break
		}
		t.Error(b)
	}
}

func (l *libnbdSession) close(t *testing.T) {
	l.in.Close()
	if err := l.cmd.Wait(); err != nil {
		t.Errorf("nbdsh: %v\n%s", err, l.errs.String())
	}
}

// TestUnalignedMegabyteRead is issue 47's first reproduction, with default
// flags and stock libnbd: a 1 MiB read 512 bytes into a one-line linear
// table spans 257 pages, one more than the splice pipe holds, and failed
// with EIO.
func TestUnalignedMegabyteRead(t *testing.T) {
	dir := nbdtest.ShortDir(t)
	randomFile(t, filepath.Join(dir, "x.img"), 4*mib)
	writeFile(t, filepath.Join(dir, "x.table"), "0 8192 linear x.img 0\n")
	s := serve(t, dir, "--control", "off", "x=x.table")
	script := `
import os
fd = os.open("x.img", os.O_RDONLY)
assert h.pread(1048576, 512) == os.pread(fd, 1048576, 512), "the read returned other bytes than the file holds"
`
	cmd := nbdtest.Nbdsh(t, "-u", s.URI("x"), "-c", script)
	cmd.Dir = dir
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("nbdsh h.pread(1048576, 512): %v\n%s\nserver log:\n%s", err, out, s.Stderr())
	}
}
