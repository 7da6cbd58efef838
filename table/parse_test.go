package table

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/nbdmapper/nbdmapper/backing"
	"github.com/nbdmapper/nbdmapper/internal/testing/golden"
)

func TestParseErrors(t *testing.T) {
	errRead := errors.New("disk on fire")
	tests := []struct {
		name  string
		text  string
		r     io.Reader // instead of text
		line  int
		err   error
		cause error // also in the chain, if set
	}{
		{name: "empty", text: "", line: 0, err: ErrEmpty},
		{name: "only comments", text: "# nothing\n\n   # here\n", line: 0, err: ErrEmpty},
		{name: "first line not at 0", text: "1 8 zero\n", line: 1, err: ErrGap},
		{name: "gap", text: "0 8 zero\n9 8 zero\n", line: 2, err: ErrGap},
		{name: "overlap", text: "0 8 zero\n4 8 zero\n", line: 2, err: ErrGap},
		{name: "line numbers count comments and blanks", text: "# c\n\n0 8 zero\n  # x\n8 0 zero\n", line: 5, err: ErrZeroLength},
		{name: "zero length", text: "0 0 zero\n", line: 1, err: ErrZeroLength},
		{name: "unknown target", text: "0 8 mirror 1 2\n", line: 1, err: ErrUnknownTarget},
		{name: "target names are case sensitive", text: "0 8 Linear a 0\n", line: 1, err: ErrUnknownTarget},
		{name: "hash inside target name", text: "0 8 zero#x\n", line: 1, err: ErrUnknownTarget},
		{name: "no target", text: "0 8\n", line: 1, err: ErrArgCount},
		{name: "no target after comment", text: "0 8 # zero\n", line: 1, err: ErrArgCount},
		{name: "linear one argument", text: "0 8 linear a\n", line: 1, err: ErrArgCount},
		{name: "linear three arguments", text: "0 8 linear a 0 1\n", line: 1, err: ErrArgCount},
		{name: "zero with argument", text: "0 8 zero x\n", line: 1, err: ErrArgCount},
		{name: "error with argument", text: "0 8 error x\n", line: 1, err: ErrArgCount},
		{name: "striped no chunk", text: "0 8 striped 2\n", line: 1, err: ErrArgCount},
		{name: "striped missing pair", text: "0 8 striped 2 4 a 0\n", line: 1, err: ErrArgCount},
		{name: "striped extra argument", text: "0 8 striped 2 4 a 0 b 0 c\n", line: 1, err: ErrArgCount},
		{name: "negative start", text: "-1 8 zero\n", line: 1, err: ErrNumber},
		{name: "negative length", text: "0 -8 zero\n", line: 1, err: ErrNumber},
		{name: "plus sign", text: "0 +8 zero\n", line: 1, err: ErrNumber},
		{name: "hex length", text: "0 0x10 zero\n", line: 1, err: ErrNumber},
		{name: "float length", text: "0 8.0 zero\n", line: 1, err: ErrNumber},
		{name: "exponent length", text: "0 1e3 zero\n", line: 1, err: ErrNumber},
		{name: "length overflows uint64", text: "0 99999999999999999999 zero\n", line: 1, err: ErrNumber},
		{name: "length overflows int64 bytes", text: "0 18014398509481984 zero\n", line: 1, err: ErrNumber},
		{name: "table end overflows", text: "0 18014398509481983 zero\n18014398509481983 1 zero\n", line: 2, err: ErrNumber},
		{name: "linear offset not a number", text: "0 8 linear a x\n", line: 1, err: ErrNumber},
		{name: "linear negative offset", text: "0 8 linear a -1\n", line: 1, err: ErrNumber},
		{name: "linear offset overflows", text: "0 8 linear a 18446744073709551616\n", line: 1, err: ErrNumber},
		{name: "striped count not a number", text: "0 8 striped x 4 a 0\n", line: 1, err: ErrNumber},
		{name: "striped count overflows uint32", text: "0 8 striped 4294967296 4 a 0\n", line: 1, err: ErrNumber},
		{name: "striped chunk negative", text: "0 8 striped 2 -4 a 0 b 0\n", line: 1, err: ErrNumber},
		{name: "striped offset not a number", text: "0 8 striped 2 4 a 0 b 0x0\n", line: 1, err: ErrNumber},
		{name: "striped zero stripes", text: "0 8 striped 0 4\n", line: 1, err: ErrStriped},
		{name: "striped zero chunk", text: "0 8 striped 2 0 a 0 b 0\n", line: 1, err: ErrStriped},
		{name: "striped length not divisible by stripes", text: "0 9 striped 2 1 a 0 b 0\n", line: 1, err: ErrStriped},
		{name: "striped width not divisible by chunk", text: "0 12 striped 2 4 a 0 b 0\n", line: 1, err: ErrStriped},
		{name: "striped on a later line", text: "0 8 zero\n8 24 striped 3 3 a 0 b 0 a 100\n", line: 2, err: ErrStriped},
		{name: "linear beyond device", text: "0 8 linear a 2044\n", line: 1, err: ErrBeyondDevice},
		{name: "linear offset past device", text: "0 8 linear a 4096\n", line: 1, err: ErrBeyondDevice},
		{name: "linear offset near max", text: "0 8 linear a 18014398509481983\n", line: 1, err: ErrBeyondDevice},
		{name: "linear longer than device", text: "0 2049 linear a 0\n", line: 1, err: ErrBeyondDevice},
		{name: "partial last sector does not count", text: "0 9 linear odd 0\n", line: 1, err: ErrBeyondDevice},
		{name: "striped beyond device", text: "0 16 striped 2 4 a 0 b 2041\n", line: 1, err: ErrBeyondDevice},
		{name: "missing device", text: "0 8 zero\n8 8 linear nosuch 0\n", line: 2, err: ErrDevice, cause: fs.ErrNotExist},
		{name: "missing striped device", text: "0 8 striped 2 4 a 0 nosuch 0\n", line: 1, err: ErrDevice, cause: fs.ErrNotExist},
		{name: "line too long", text: "0 8 linear " + strings.Repeat("x", maxLineBytes+1) + " 0\n", line: 1, err: ErrLineTooLong},
		{name: "read error", r: io.MultiReader(strings.NewReader("0 8 zero\n"), iotestErr{errRead}), line: 2, err: errRead},
	}
	var msgs strings.Builder
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			r := tc.r
			if r == nil {
				r = strings.NewReader(tc.text)
			}
			tb, err := Parse("t.table", r, testDevices())
			if err == nil {
				t.Fatalf("parsed, want %v:\n%s", tc.err, tb)
			}
			e := asError(t, err)
			if e.File != "t.table" || e.Line != tc.line {
				t.Errorf("error at %s:%d, want t.table:%d: %v", e.File, e.Line, tc.line, err)
			}
			if !errors.Is(err, tc.err) {
				t.Errorf("error %v is not %v", err, tc.err)
			}
			if tc.cause != nil && !errors.Is(err, tc.cause) {
				t.Errorf("error %v does not wrap the opener's %v", err, tc.cause)
			}
			msg := err.Error()
			if len(msg) > 200 {
				msg = msg[:200] + "..."
			}
			fmt.Fprintf(&msgs, "%s\n\t%s\n", tc.name, msg)
		})
	}
	// The messages themselves, for review: they are what users read.
	golden.Check(t, "testdata/errors.golden", msgs.String())
}

type iotestErr struct{ err error }

func (r iotestErr) Read([]byte) (int, error) { return 0, r.err }

func TestParseNilOpener(t *testing.T) {
	_, err := Parse("t.table", strings.NewReader("0 8 linear a 0\n"), nil)
	if e := asError(t, err); e.Line != 1 || !errors.Is(err, ErrDevice) {
		t.Fatalf("got %v, want t.table:1 and ErrDevice", err)
	}
	tb, err := Parse("t.table", strings.NewReader("0 8 zero\n8 8 error\n"), nil)
	if err != nil || tb.Size() != 16*SectorSize {
		t.Fatalf("device-less table: %v, %v", tb, err)
	}
}

// TestParseGolden parses every testdata/parse/*.table and compares the
// normalised table, its size, devices and statuses with the .golden file.
func TestParseGolden(t *testing.T) {
	files, err := filepath.Glob("testdata/parse/*.table")
	if err != nil || len(files) == 0 {
		t.Fatalf("no inputs: %v", err)
	}
	for _, file := range files {
		name := strings.TrimSuffix(filepath.Base(file), ".table")
		t.Run(name, func(t *testing.T) {
			text, err := os.ReadFile(file)
			if err != nil {
				t.Fatal(err)
			}
			tb, err := Parse(file, bytes.NewReader(text), testDevices())
			if err != nil {
				t.Fatal(err)
			}
			var b strings.Builder
			b.WriteString(tb.String())
			fmt.Fprintf(&b, "# size %d bytes\n# devices", tb.Size())
			for _, d := range tb.Devices() {
				b.WriteString(" " + d.Name())
			}
			b.WriteString("\n")
			for i, l := range tb.Lines {
				if s := l.Target.Status(); s != "" {
					fmt.Fprintf(&b, "# status line %d: %s\n", i+1, s)
				}
			}
			golden.Check(t, "testdata/parse/"+name+".golden", b.String())
		})
	}
}

// TestRoundTrip checks Parse(t.String()) equals t for every golden input.
func TestRoundTrip(t *testing.T) {
	files, _ := filepath.Glob("testdata/parse/*.table")
	if len(files) == 0 {
		t.Fatal("no inputs")
	}
	o := testDevices()
	for _, file := range files {
		t.Run(filepath.Base(file), func(t *testing.T) {
			text, err := os.ReadFile(file)
			if err != nil {
				t.Fatal(err)
			}
			a := mustParse(t, string(text), o)
			b := mustParse(t, a.String(), o)
			if d := sameTable(a, b); d != "" {
				t.Fatalf("round trip differs: %s\n%s", d, a)
			}
			if a.String() != b.String() {
				t.Fatalf("String not stable:\n%s\n%s", a, b)
			}
		})
	}
}

// TestParseDevicesOpenedOnce checks that Parse asks the Opener once per
// name, however many lines use it.
func TestParseDevicesOpenedOnce(t *testing.T) {
	o := &countingOpener{inner: testDevices(), n: map[string]int{}}
	var b strings.Builder
	for i := range 100 {
		fmt.Fprintf(&b, "%d 8 linear a %d\n", i*8, i*8)
	}
	fmt.Fprintf(&b, "800 16 striped 2 8 a 1000 b 0\n")
	tb := mustParse(t, b.String(), o)
	if o.n["a"] != 1 || o.n["b"] != 1 {
		t.Errorf("opens: %v, want a and b once each", o.n)
	}
	if got := len(tb.Devices()); got != 2 {
		t.Errorf("Devices: %d, want 2", got)
	}
}

type countingOpener struct {
	inner Opener
	n     map[string]int
}

func (o *countingOpener) Open(name string) (backing.Device, error) {
	o.n[name]++
	return o.inner.Open(name)
}

// lineGen is a reader producing n generated lines without holding them all.
type lineGen struct {
	i, n int
	line []byte
	buf  []byte
	gen  func(b []byte, i int) []byte
}

func (g *lineGen) Read(p []byte) (int, error) {
	for len(g.buf) == 0 {
		if g.i == g.n {
			return 0, io.EOF
		}
		g.line = g.gen(g.line[:0], g.i)
		g.buf = g.line
		g.i++
	}
	n := copy(p, g.buf)
	g.buf = g.buf[n:]
	return n, nil
}

// TestParseTooMany feeds MaxTargets+1 one-sector lines: all of the first
// MaxTargets are accepted and the error names the line after them.
func TestParseTooMany(t *testing.T) {
	if testing.Short() {
		t.Skip("parses a million lines; skipped with -short")
	}
	g := &lineGen{n: MaxTargets + 1, gen: func(b []byte, i int) []byte {
		b = strconv.AppendInt(b, int64(i), 10)
		return append(b, " 1 zero\n"...)
	}}
	_, err := Parse("big.table", g, nil)
	e := asError(t, err)
	if e.Line != MaxTargets+1 || !errors.Is(err, ErrTooMany) {
		t.Fatalf("got %v, want big.table:%d and ErrTooMany", err, MaxTargets+1)
	}
}

// FuzzParse: Parse never panics, every error is a *Error, and whatever
// parses round-trips and maps the start of every line onto contiguous
// extents inside their devices.
func FuzzParse(f *testing.F) {
	files, _ := filepath.Glob("testdata/parse/*.table")
	for _, file := range files {
		if b, err := os.ReadFile(file); err == nil {
			f.Add(string(b))
		}
	}
	for _, s := range []string{
		"0 8 linear a 0\n8 16 striped 2 4 a 8 b 0 # x\n",
		"0 12 striped 3 1 a 0 b 0 8:16 0\n12 1 error\n",
		"0 0x8 zero", "0 8 striped 0 0", "\x00 8 zero", "0 8 linear a 2040\n",
	} {
		f.Add(s)
	}
	o := testDevices()
	f.Fuzz(func(t *testing.T, text string) {
		a, err := Parse("f.table", strings.NewReader(text), o)
		if err != nil {
			var e *Error
			if !errors.As(err, &e) {
				t.Fatalf("error %v is not a *Error", err)
			}
			return
		}
		a.Close() // a snapshot line holds its COW device until closed
		b, err := Parse("f.table", strings.NewReader(a.String()), o)
		if err != nil {
			t.Fatalf("normalised table does not parse: %v\n%s", err, a)
		}
		defer b.Close()
		if d := sameTable(a, b); d != "" {
			t.Fatalf("round trip differs: %s", d)
		}
		for _, l := range a.Lines {
			off := l.Start.Bytes()
			n := min(l.Length, 64).Bytes()
			checkCover(t, a, off, n)
		}
	})
}

// checkCover maps [off, off+n) and checks the extents are ascending,
// contiguous, exactly cover the range and stay inside their devices.
func checkCover(t *testing.T, tb *Table, off, n int64) {
	t.Helper()
	next := off
	for _, e := range tb.Extents(off, n) {
		if e.VOff != next || e.Len <= 0 {
			t.Fatalf("Map(%d, %d): extent %+v, want one at %d", off, n, e, next)
		}
		if e.Kind == KindMapped && (e.Dev == nil || e.Off < 0 || e.Off+e.Len > e.Dev.Size()) {
			t.Fatalf("Map(%d, %d): extent %+v outside its device", off, n, e)
		}
		next += e.Len
	}
	if next != off+n {
		t.Fatalf("Map(%d, %d): extents end at %d", off, n, next)
	}
	checkDeviceCover(t, tb, off, n)
}

// checkDeviceCover checks that Cover reaches exactly the device bytes Map
// does, each as many times (stripes of one table may name the same device
// area, which dm allows too), and the same amount of zero and error target.
func checkDeviceCover(t *testing.T, tb *Table, off, n int64) {
	t.Helper()
	// A device's coverage: how many extents reach each byte, as runs of
	// equal counts {lo, hi, count}, ascending and without zero runs.
	type run struct{ lo, hi, count int64 }
	collect := func(walk func(int64, int64, func(Extent) bool) bool) (map[backing.Device][]run, map[Kind]int64) {
		edges := map[backing.Device]map[int64]int64{}
		kinds := map[Kind]int64{}
		walk(off, n, func(e Extent) bool {
			kinds[e.Kind] += e.Len
			if e.Kind == KindMapped {
				if edges[e.Dev] == nil {
					edges[e.Dev] = map[int64]int64{}
				}
				edges[e.Dev][e.Off]++
				edges[e.Dev][e.Off+e.Len]--
			}
			return true
		})
		devs := map[backing.Device][]run{}
		for d, m := range edges {
			var runs []run
			var count int64
			at := slices.Sorted(maps.Keys(m))
			for i, x := range at[:len(at)-1] {
				count += m[x]
				switch {
				case count == 0:
				case len(runs) > 0 && runs[len(runs)-1].hi == x && runs[len(runs)-1].count == count:
					runs[len(runs)-1].hi = at[i+1]
				default:
					runs = append(runs, run{x, at[i+1], count})
				}
			}
			devs[d] = runs
		}
		return devs, kinds
	}
	mapDevs, mapKinds := collect(tb.Map)
	covDevs, covKinds := collect(tb.Cover)
	if !maps.Equal(mapKinds, covKinds) {
		t.Fatalf("[%d, %d): Cover covers %v, Map %v", off, n, covKinds, mapKinds)
	}
	if !maps.EqualFunc(mapDevs, covDevs, slices.Equal) {
		t.Fatalf("[%d, %d): Cover reaches %v, Map %v", off, n, covDevs, mapDevs)
	}
}
