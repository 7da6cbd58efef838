package nbdtarget

import (
	"fmt"
	"os"
	"strings"
	"testing"

	"github.com/nbdmapper/nbdmapper/backing"
	"github.com/nbdmapper/nbdmapper/discard"
	"github.com/nbdmapper/nbdmapper/flush"
	"github.com/nbdmapper/nbdmapper/mapped"
	"github.com/nbdmapper/nbdmapper/table"
)

// The fuzzers' device: a fresh export per input, over in-memory devices, a
// real file, a striped pair, a write-caching Faulty device and a snapshot,
// with zero, error and failing ranges, so that every reply has one right
// answer the model can compute. Byte offsets:
//
//	0     16K   20K   24K      32K      40K       56K     72K   80K        96K
//	| a   | zero| err | fail*  | nozero | striped | file  | c   | snapshot |
//
// fail*'s first 1 KiB fails reads and writes; nozero cannot zero natively;
// striped is 2 Mems with 1-sector chunks; c is a Faulty over a Mem (writes
// cached until a sync); snapshot is a persistent snapshot of a 96 KiB
// origin, of which it maps the last 16 KiB (a snapshot line's sectors are
// the origin's). Every mapped byte starts as fuzzPattern(offset). Every device
// has a hole map in front (the file gets its own from the pool), so that
// reads of what trims and zeroing punched are answered with hole chunks;
// fail*'s is behind its failing reads, which it then reads densely.
const fuzzTable = `0 32 linear a 0
32 8 zero
40 8 error
48 16 linear f 0
64 16 linear z 0
80 32 striped 2 1 s0 0 s1 0
112 32 linear %s 0
144 16 linear c 0
160 32 snapshot so sc P 8
`

// Byte classes of the model: what a request touching the byte may see.
const (
	clsMapped   uint8 = iota
	clsZero           // reads zeros, writes dropped
	clsError          // every I/O fails
	clsFail           // reads and writes fail, trims and zeroing work
	clsNoZero         // WRITE_ZEROES with FAST_ZERO fails with ENOTSUP
	clsReadOnly       // the read-only export
)

const (
	fuzzSize = 96 * kb
	roSize   = 4 * kb
)

func fuzzPattern(off int64) byte { return byte(off*7 + off>>9 + 3) }

// fuzzClasses is the class of every byte of the export.
var fuzzClasses = func() []uint8 {
	cls := make([]uint8, fuzzSize)
	set := func(from, to int64, c uint8) {
		for i := from; i < to; i++ {
			cls[i] = c
		}
	}
	set(16*kb, 20*kb, clsZero)
	set(20*kb, 24*kb, clsError)
	set(24*kb, 25*kb, clsFail)
	set(32*kb, 40*kb, clsNoZero)
	return cls
}()

// fuzzRig is one input's server, exports and devices.
type fuzzRig struct {
	srv    *Server
	x, ro  *Export
	panics chan string
	close  func()
}

// newFuzzRig builds the exports with every mapped byte set to its pattern.
// serial runs one request at a time per connection (MaxInFlight 1), so that
// the model can be exact; batch lets the discard engine gather trims.
//
// The file segment is file, rewritten for every input.
func newFuzzRig(t testing.TB, file string, serial, batch bool) *fuzzRig {
	t.Helper()
	seg := func(from, n int64) []byte {
		b := make([]byte, n)
		for i := range b {
			b[i] = fuzzPattern(from + int64(i))
		}
		return b
	}
	if err := os.WriteFile(file, seg(56*kb, 16*kb), 0o600); err != nil {
		t.Fatal(err)
	}
	mem := func(name string, size, vfrom int64) *backing.Mem {
		m := backing.NewMem(name, size)
		m.WriteAt(seg(vfrom, size), 0)
		return m
	}
	holes := backing.NewHoleMap
	// The striped pair holds virtual [40K, 56K) in 512-byte chunks,
	// alternating between s0 and s1.
	s0, s1 := backing.NewMem("s0", 8*kb), backing.NewMem("s1", 8*kb)
	for c := int64(0); c < 32; c++ {
		d := s0
		if c%2 == 1 {
			d = s1
		}
		d.WriteAt(seg(40*kb+c*512, 512), c/2*512)
	}
	fc := backing.NewFaulty(mem("c", 8*kb, 72*kb))
	flusher, discarder := flush.New(), discard.New()
	if !batch {
		discarder.PerRequest = true
	}
	pool := &backing.Pool{Wrap: flusher.Track}
	pool.Add("a", holes(mem("a", 16*kb, 0)))
	pool.Add("f", &failDev{Device: holes(mem("f", 8*kb, 24*kb)), from: 0, to: kb})
	pool.Add("z", holes(noZeroDev{mem("z", 8*kb, 32*kb)}))
	pool.Add("s0", holes(s0))
	pool.Add("s1", holes(s1))
	pool.Add("c", holes(fc))
	pool.Add("so", holes(mem("so", 96*kb, 0)))
	pool.Add("sc", holes(backing.NewMem("sc", 64*kb)))
	tb, err := table.Parse("fuzz.table", strings.NewReader(fmt.Sprintf(fuzzTable, file)), pool)
	if err != nil {
		pool.Close()
		t.Fatal(err)
	}
	x := &Export{Name: "x", Dev: mapped.New("x", tb, flusher, discarder)}
	rot, err := table.New("ro.table", []table.Line{{Length: roSize / 512, Target: linearT{dev: mem("r", roSize, 0)}}})
	if err != nil {
		t.Fatal(err)
	}
	ro := &Export{Name: "ro", ReadOnly: true, Dev: mapped.New("ro", rot, flusher, discarder)}
	r := &fuzzRig{x: x, ro: ro, panics: make(chan string, 64)}
	r.srv = &Server{Exports: []*Export{x, ro}, OnPanic: func(v any, stack []byte) {
		select {
		case r.panics <- fmt.Sprintf("%v\n%s", v, stack):
		default:
		}
	}}
	if serial {
		r.srv.MaxInFlight = 1
	}
	r.srv.init()
	r.close = func() {
		tb.Close()
		pool.Close()
	}
	return r
}

// checkPanics fails the test for every panic the server recovered from.
func (r *fuzzRig) checkPanics(t testing.TB) {
	t.Helper()
	for {
		select {
		case p := <-r.panics:
			t.Errorf("server recovered from a panic: %s", p)
		default:
			return
		}
	}
}

// Model state of one byte.
const (
	exact       uint8 = iota // holds val
	exactOrZero              // holds val or zero (a trim or failed zeroing)
	anyValue                 // a failed write: anything until rewritten
)

// devModel is what the export holds, byte by byte.
type devModel struct {
	cls   []uint8
	val   []byte
	state []uint8
}

func newModel(x *Export) *devModel {
	size := x.Size()
	m := &devModel{val: make([]byte, size), state: make([]uint8, size)}
	if x.ReadOnly {
		m.cls = make([]uint8, size)
		for i := range m.cls {
			m.cls[i] = clsReadOnly
		}
	} else {
		m.cls = fuzzClasses
	}
	for i := range m.val {
		if m.cls[i] != clsZero {
			m.val[i] = fuzzPattern(int64(i))
		}
	}
	return m
}

// touches reports whether [off, off+n) holds a byte of class c.
func (m *devModel) touches(off, n int64, c uint8) bool {
	for i := off; i < off+n; i++ {
		if m.cls[i] == c {
			return true
		}
	}
	return false
}

// ok reports whether v may be read at i.
func (m *devModel) ok(i int64, v byte) bool {
	switch {
	case m.cls[i] == clsZero:
		return v == 0
	case m.state[i] == anyValue:
		return true
	case m.state[i] == exactOrZero && v == 0:
		return true
	}
	return m.val[i] == v
}

// set records a completed write (data) or zeroing (data nil).
func (m *devModel) set(off int64, data []byte, n int64) {
	for i := off; i < off+n; i++ {
		if data != nil {
			m.val[i] = data[i-off]
		} else {
			m.val[i] = 0
		}
		m.state[i] = exact
	}
}

// weaken records an operation that may have left old or zero bytes (a trim,
// failed zeroing) or anything (a failed write) in the range.
func (m *devModel) weaken(off, n int64, to uint8) {
	for i := off; i < off+n; i++ {
		if m.state[i] < to {
			m.state[i] = to
		}
		if m.state[i] == exactOrZero && m.val[i] == 0 {
			m.state[i] = exact
		}
	}
}
