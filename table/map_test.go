package table

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"strconv"
	"strings"
	"testing"

	"github.com/nbdmapper/nbdmapper/backing"
	"github.com/nbdmapper/nbdmapper/internal/testing/golden"
)

// loc is where one virtual sector lives, computed without the mapping code.
type loc struct {
	kind   Kind
	dev    backing.Device
	sector int64
}

// model lays out every virtual sector of tb from the lines' canonical
// arguments alone. Striped lines are laid out constructively, the way one
// draws dm-stripe on paper: row after row, each row one chunk on each
// stripe in turn. It does not use the division formulas Map uses.
func model(t *testing.T, tb *Table, o memOpener) []loc {
	t.Helper()
	var m []loc
	num := func(s string) int64 {
		v, err := strconv.ParseInt(s, 10, 64)
		if err != nil {
			t.Fatal(err)
		}
		return v
	}
	for _, l := range tb.Lines {
		args := l.Target.Args()
		length := int64(l.Length)
		switch l.Target.Type() {
		case "linear":
			dev, off := o[args[0]], num(args[1])
			for i := range length {
				m = append(m, loc{KindMapped, dev, off + i})
			}
		case "zero", "error":
			k := KindZero
			if l.Target.Type() == "error" {
				k = KindError
			}
			for range length {
				m = append(m, loc{kind: k})
			}
		case "striped":
			n, chunk := num(args[0]), num(args[1])
			rows := length / n / chunk
			for r := range rows {
				for s := range n {
					dev, off := o[args[2+2*s]], num(args[3+2*s])
					for i := range chunk {
						m = append(m, loc{KindMapped, dev, off + r*chunk + i})
					}
				}
			}
		default:
			t.Fatalf("no model for %s", l.Target.Type())
		}
	}
	if int64(len(m))*SectorSize != tb.Size() {
		t.Fatalf("model has %d sectors, table %d bytes", len(m), tb.Size())
	}
	return m
}

// checkModel maps [off, off+n) and checks every byte of every extent
// against the model, and that no extent straddles a line boundary.
func checkModel(t *testing.T, tb *Table, m []loc, off, n int64) {
	t.Helper()
	checkCover(t, tb, off, n)
	lineOf := func(v int64) int {
		for i, l := range tb.Lines {
			if v < (l.Start + l.Length).Bytes() {
				return i
			}
		}
		return -1
	}
	for _, e := range tb.Extents(off, n) {
		if lineOf(e.VOff) != lineOf(e.VOff+e.Len-1) {
			t.Fatalf("Map(%d, %d): extent %+v straddles a line boundary", off, n, e)
		}
		// Check the first and last byte of each sector piece of the extent.
		for v := e.VOff; v < e.VOff+e.Len; {
			want := m[v/SectorSize]
			k := min(SectorSize-v%SectorSize, e.VOff+e.Len-v)
			if e.Kind != want.kind {
				t.Fatalf("Map(%d, %d): byte %d is %v, want %v", off, n, v, e.Kind, want.kind)
			}
			if want.kind == KindMapped {
				wantOff := want.sector*SectorSize + v%SectorSize
				if got := e.Off + (v - e.VOff); e.Dev != want.dev || got != wantOff {
					t.Fatalf("Map(%d, %d): byte %d on %s@%d, want %s@%d", off, n, v, devName(e.Dev), got, devName(want.dev), wantOff)
				}
			}
			v += k
		}
	}
}

// TestStripedEverySector checks striped geometries sector by sector against
// the constructive model: every sector alone, the whole line at once, and
// random ranges that start and end inside sectors.
func TestStripedEverySector(t *testing.T) {
	tests := []struct {
		name  string
		table string
	}{
		{"one stripe", "0 24 striped 1 8 a 5"},
		{"two stripes chunk 1", "0 16 striped 2 1 a 0 b 3"},
		{"two stripes chunk 8", "0 64 striped 2 8 a 0 b 100"},
		{"three stripes odd chunk", "0 90 striped 3 5 a 7 b 0 8:16 11"},
		{"four stripes chunk 2", "0 48 striped 4 2 a 0 b 0 8:16 0 a 1000"},
		{"five stripes chunk 3 one row", "0 15 striped 5 3 a 0 b 0 a 100 b 100 8:16 0"},
		{"same device every stripe", "0 36 striped 3 4 a 0 a 12 a 24"},
		{"after other lines", "0 5 zero\n5 7 linear a 9\n12 96 striped 4 6 b 1 a 500 8:16 2 b 400"},
	}
	o := testDevices()
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			tb := mustParse(t, tc.table+"\n", o)
			m := model(t, tb, o)
			size := tb.Size()
			for s := int64(0); s < size; s += SectorSize {
				checkModel(t, tb, m, s, SectorSize)
			}
			checkModel(t, tb, m, 0, size)
			rng := rand.New(rand.NewPCG(1, uint64(len(tc.name))))
			for range 200 {
				off := rng.Int64N(size)
				n := 1 + rng.Int64N(size-off)
				checkModel(t, tb, m, off, n)
			}
		})
	}
}

// TestMapBoundaries checks Map around every line boundary of tables of one
// to nine lines of every target type: ranges ending exactly on a boundary,
// starting on one, crossing one by a byte, and empty ranges.
func TestMapBoundaries(t *testing.T) {
	kinds := []string{
		"linear a %d", "zero", "linear b %d", "error", "striped 2 1 a %d b %d",
		"linear 8:16 %d", "striped 3 2 a %d b %d 8:16 %d", "zero", "linear a %d",
	}
	lengths := []int64{3, 5, 8, 1, 12, 7, 18, 2, 9}
	o := testDevices()
	for nl := 1; nl <= len(kinds); nl++ {
		t.Run(fmt.Sprintf("%d lines", nl), func(t *testing.T) {
			var b strings.Builder
			var start int64
			for i := range nl {
				spec := kinds[i]
				for range strings.Count(spec, "%d") {
					spec = strings.Replace(spec, "%d", strconv.Itoa(100*i+7), 1)
				}
				fmt.Fprintf(&b, "%d %d %s\n", start, lengths[i], spec)
				start += lengths[i]
			}
			tb := mustParse(t, b.String(), o)
			m := model(t, tb, o)
			size := tb.Size()
			checkModel(t, tb, m, 0, size)
			for _, l := range tb.Lines {
				bs, be := l.Start.Bytes(), (l.Start + l.Length).Bytes()
				checkModel(t, tb, m, bs, be-bs) // exactly the line
				checkModel(t, tb, m, 0, be)     // up to its end
				checkModel(t, tb, m, bs, size-bs)
				checkModel(t, tb, m, bs, 1)
				checkModel(t, tb, m, be-1, 1)
				if bs > 0 {
					checkModel(t, tb, m, bs-1, 2) // crossing into this line
					checkModel(t, tb, m, bs-SectorSize, 2*SectorSize)
				}
				for _, at := range []int64{bs, be} {
					if got := tb.Extents(at, 0); len(got) != 0 {
						t.Errorf("Map(%d, 0) = %+v, want nothing", at, got)
					}
				}
				if got := tb.Extents(bs, be-bs); len(got) == 0 || got[0].VOff != bs {
					t.Errorf("Map of line [%d, %d) starts at %+v", bs, be, got)
				}
			}
		})
	}
}

// TestMapLinearLineCount: a range over k whole linear lines yields exactly
// k extents, one per line, found by the binary search on a large table.
func TestMapLinearLineCount(t *testing.T) {
	var b strings.Builder
	const lines = 4096
	for i := range lines {
		// Reverse order on the device, so no two lines are adjacent on it.
		fmt.Fprintf(&b, "%d 1 linear 8:16 %d\n", i, lines-1-i)
	}
	o := testDevices()
	tb := mustParse(t, b.String(), o)
	m := model(t, tb, o)
	for _, r := range [][2]int64{{0, 1}, {0, lines}, {1, 1}, {lines - 1, 1}, {100, 37}, {2047, 2}, {2048, 2048}} {
		got := tb.Extents(r[0]*SectorSize, r[1]*SectorSize)
		if int64(len(got)) != r[1] {
			t.Errorf("sectors [%d,+%d): %d extents, want %d", r[0], r[1], len(got), r[1])
		}
		checkModel(t, tb, m, r[0]*SectorSize, r[1]*SectorSize)
	}
}

// TestMapGolden prints mapping plans for some tables and ranges.
func TestMapGolden(t *testing.T) {
	tests := []struct {
		name   string
		table  string
		ranges [][2]int64 // byte offset, length
	}{
		{
			name:  "linear",
			table: "0 8 linear a 0\n8 8 linear b 16\n16 16 linear a 8\n",
			ranges: [][2]int64{
				{0, 4096}, {0, 4096 + 512}, {4096 - 1, 2}, {4096, 4096}, {0, 16384}, {16383, 1}, {1000, 9000},
			},
		},
		{
			name:   "striped",
			table:  "0 8 striped 2 2 a 0 b 100\n",
			ranges: [][2]int64{{512, 5 * 512}, {512, 6 * 512}, {0, 4096}, {1000, 100}, {1000, 1000}, {3 * 512, 512}},
		},
		{
			name:   "striped one stripe merges",
			table:  "0 32 striped 1 4 a 8\n",
			ranges: [][2]int64{{0, 32 * 512}, {700, 4000}},
		},
		{
			name:   "mixed",
			table:  "0 4 linear a 0\n4 4 zero\n8 4 error\n12 12 striped 3 1 a 10 b 10 8:16 10\n24 4 linear 8:16 0\n",
			ranges: [][2]int64{{0, 28 * 512}, {3 * 512, 2 * 512}, {7 * 512, 2 * 512}, {11 * 512, 3 * 512}, {23 * 512, 512 + 1}},
		},
	}
	o := testDevices()
	var b strings.Builder
	for _, tc := range tests {
		tb := mustParse(t, tc.table, o)
		m := model(t, tb, o)
		fmt.Fprintf(&b, "## %s\n%s", tc.name, tb)
		for _, r := range tc.ranges {
			checkModel(t, tb, m, r[0], r[1])
			fmt.Fprintf(&b, "map [%d, %d):\n", r[0], r[0]+r[1])
			for _, e := range tb.Extents(r[0], r[1]) {
				fmt.Fprintf(&b, "\t[%d, %d) %s", e.VOff, e.VOff+e.Len, e.Kind)
				if e.Kind == KindMapped {
					fmt.Fprintf(&b, " %s [%d, %d)", devName(e.Dev), e.Off, e.Off+e.Len)
				}
				b.WriteString("\n")
			}
		}
		b.WriteString("\n")
	}
	golden.Check(t, "testdata/map/plans.golden", b.String())
}

// TestTargetText checks Args and Status of each target type as dmsetup
// prints them.
func TestTargetText(t *testing.T) {
	tests := []struct {
		line, args, status string
	}{
		{"0 8 linear a 0016", "a 16", ""},
		{"0 8 linear 8:16 0", "8:16 0", ""},
		{"0 8 zero", "", ""},
		{"0 8 error", "", ""},
		{"0 16 striped 2 04 a 0 8:16 000", "2 4 a 0 8:16 0", "2 a 8:16 1 AA"},
		{"0 12 striped 3 1 a 1 a 2 b 3", "3 1 a 1 a 2 b 3", "3 a a b 1 AAA"},
	}
	o := testDevices()
	for _, tc := range tests {
		t.Run(tc.line, func(t *testing.T) {
			tg := mustParse(t, tc.line, o).Lines[0].Target
			if got := strings.Join(tg.Args(), " "); got != tc.args {
				t.Errorf("Args = %q, want %q", got, tc.args)
			}
			if got := tg.Status(); got != tc.status {
				t.Errorf("Status = %q, want %q", got, tc.status)
			}
		})
	}
}

// TestNew checks the validation New does for lines built in code.
func TestNew(t *testing.T) {
	z, _ := newZero(nil, 0, 8, nil)
	tests := []struct {
		name  string
		lines []Line
		line  int
		err   error
	}{
		{"empty", nil, 0, ErrEmpty},
		{"gap", []Line{{0, 8, z}, {9, 8, z}}, 2, ErrGap},
		{"zero length", []Line{{0, 8, z}, {8, 0, z}}, 2, ErrZeroLength},
		{"ok", []Line{{0, 8, z}, {8, 8, z}}, 0, nil},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			tb, err := New("n", tc.lines)
			if tc.err == nil {
				if err != nil || tb.Size() != 16*SectorSize {
					t.Fatalf("New: %v, %v", tb, err)
				}
				return
			}
			if e := asError(t, err); e.Line != tc.line || !errors.Is(err, tc.err) {
				t.Fatalf("New: %v, want line %d %v", err, tc.line, tc.err)
			}
		})
	}
}

func TestTargets(t *testing.T) {
	if got := strings.Join(Targets(), " "); got != "error linear snapshot snapshot-merge snapshot-origin striped zero" {
		t.Fatalf("Targets() = %q", got)
	}
}
