package discard

import (
	"slices"
	"testing"

	"github.com/nbdmapper/nbdmapper/backing"
	"github.com/nbdmapper/nbdmapper/internal/testing/golden"
)

// limited is an in-memory device with chosen discard limits.
type limited struct {
	*backing.Mem
	lim backing.Limits
}

func (d limited) Limits() backing.Limits { return d.lim }

func dev(name string, granularity, maxBytes int64) backing.Device {
	return limited{backing.NewMem(name, 1<<30), backing.Limits{Granularity: granularity, MaxBytes: maxBytes}}
}

func r(off, n int64) backing.Range { return backing.Range{Off: off, Len: n} }

func TestPlanGolden(t *testing.T) {
	const K = 1024
	a := dev("a", 4*K, 0)
	b := dev("b", 512, 0)
	small := dev("small", 4*K, 8*K)
	x := func(d backing.Device, off, n int64) Extent { return Extent{Dev: d, Off: off, Len: n} }
	tests := []struct {
		name    string
		op      Op
		exts    []Extent
		claimed map[backing.Device][]backing.Range
	}{
		{name: "unsorted-disjoint", exts: []Extent{x(a, 32*K, 8*K), x(a, 0, 8*K), x(a, 16*K, 4*K)}},
		{name: "overlapping-and-adjacent", exts: []Extent{x(a, 0, 12*K), x(a, 8*K, 8*K), x(a, 16*K, 4*K), x(a, 40*K, 8*K), x(a, 36*K, 4*K)}},
		{name: "contained", exts: []Extent{x(a, 0, 64*K), x(a, 8*K, 4*K), x(a, 60*K, 4*K)}},
		{name: "granularity-cuts-inward", exts: []Extent{x(a, 1*K, 10*K), x(a, 20*K, 3*K), x(a, 33*K, 14*K)}},
		{name: "half-granules-merge-first", exts: []Extent{x(a, 8*K, 2*K), x(a, 10*K, 2*K), x(a, 14*K, 2*K), x(a, 12*K, 2*K)}},
		{name: "split-at-max-bytes", exts: []Extent{x(small, 4*K, 28*K), x(small, 40*K, 8*K)}},
		{name: "claimed-write-cut-out", exts: []Extent{x(a, 0, 32*K)}, claimed: map[backing.Device][]backing.Range{a: {r(10*K, 4*K), r(24*K, 12*K)}}},
		{name: "two-devices", exts: []Extent{x(a, 16*K, 8*K), x(b, 3*K, 1*K), x(a, 0, 8*K), x(b, 2*K, 1*K), x(a, 8*K, 8*K)}},
		{name: "zero-exact", op: OpZero, exts: []Extent{x(a, 1*K, 10*K), x(a, 11*K, 1*K), x(a, 20*K, 3*K)}},
		// The example in doc.go and docs/discard.md.
		{name: "worked-example", exts: []Extent{x(a, 16*K, 8*K), x(a, 1*K, 9*K), x(a, 10*K, 5*K)},
			claimed: map[backing.Device][]backing.Range{a: {r(20*K, 2*K)}}},
		{name: "empty-ranges-dropped", exts: []Extent{x(a, 0, 0), x(a, 4*K, 4*K)}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			devs := group(tc.exts)
			for _, p := range devs {
				p.claimed = tc.claimed[p.dev]
			}
			p := plan(tc.op, devs, nil)
			checkPlan(t, p)
			golden.Check(t, "testdata/plan-"+tc.name+".golden", p.String())
		})
	}
}

// checkPlan asserts the invariants every plan keeps, whatever the golden
// files say: calls ascending and disjoint, inside the merged ranges, aligned
// and bounded for discards, exactly the merged ranges for zeroing, and never
// touching a claimed byte.
func checkPlan(t *testing.T, p Plan) {
	t.Helper()
	for _, d := range p.Devices {
		for i, c := range d.Calls {
			if i > 0 && c.Off < d.Calls[i-1].End() {
				t.Errorf("%s: calls not ascending and disjoint: %v then %v", d.Dev.Name(), d.Calls[i-1], c)
			}
			if !covered(d.Merged, c) {
				t.Errorf("%s: call %v outside the merged ranges %v", d.Dev.Name(), c, d.Merged)
			}
			for _, cl := range d.Claimed {
				if c.Off < cl.End() && cl.Off < c.End() {
					t.Errorf("%s: call %v touches claimed %v", d.Dev.Name(), c, cl)
				}
			}
			if p.Op == OpDiscard {
				g := d.Limits.Granularity
				if c.Off%g != 0 || c.Len%g != 0 {
					t.Errorf("%s: call %v not aligned to %d", d.Dev.Name(), c, g)
				}
				if m := d.Limits.MaxBytes; m > 0 && c.Len > m {
					t.Errorf("%s: call %v longer than max %d", d.Dev.Name(), c, m)
				}
			}
		}
		if p.Op == OpZero && !slices.Equal(d.Calls, d.Merged) {
			t.Errorf("%s: zero calls %v != merged %v", d.Dev.Name(), d.Calls, d.Merged)
		}
	}
}

func covered(rs []backing.Range, c backing.Range) bool {
	for _, r := range rs {
		if r.Off <= c.Off && c.End() <= r.End() {
			return true
		}
	}
	return false
}

func TestMerge(t *testing.T) {
	tests := []struct {
		name   string
		in     []backing.Range
		merged []backing.Range
	}{
		{"nil", nil, nil},
		{"one", []backing.Range{r(5, 5)}, []backing.Range{r(5, 5)}},
		{"adjacent", []backing.Range{r(10, 5), r(0, 10)}, []backing.Range{r(0, 15)}},
		{"gap kept", []backing.Range{r(0, 10), r(11, 1)}, []backing.Range{r(0, 10), r(11, 1)}},
		{"overlap", []backing.Range{r(0, 10), r(5, 10), r(1, 2)}, []backing.Range{r(0, 15)}},
		{"empty dropped", []backing.Range{r(3, 0), r(8, 2)}, []backing.Range{r(8, 2)}},
		{"duplicates", []backing.Range{r(4, 4), r(4, 4)}, []backing.Range{r(4, 4)}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			in := slices.Clone(tc.in)
			got := Merge(in)
			if !slices.Equal(got, tc.merged) && !(len(got) == 0 && len(tc.merged) == 0) {
				t.Errorf("Merge(%v) = %v, want %v", tc.in, got, tc.merged)
			}
			if !slices.Equal(in, tc.in) {
				t.Errorf("Merge modified its input: %v", in)
			}
		})
	}
}

func TestSubtract(t *testing.T) {
	tests := []struct {
		name         string
		rs, cut, out []backing.Range
	}{
		{"no cut", []backing.Range{r(0, 10)}, nil, []backing.Range{r(0, 10)}},
		{"middle", []backing.Range{r(0, 10)}, []backing.Range{r(3, 2)}, []backing.Range{r(0, 3), r(5, 5)}},
		{"all", []backing.Range{r(0, 10)}, []backing.Range{r(0, 10)}, nil},
		{"spanning two", []backing.Range{r(0, 10), r(20, 10)}, []backing.Range{r(5, 20)}, []backing.Range{r(0, 5), r(25, 5)}},
		{"edges", []backing.Range{r(10, 10)}, []backing.Range{r(0, 12), r(18, 10)}, []backing.Range{r(12, 6)}},
		{"outside", []backing.Range{r(10, 10)}, []backing.Range{r(0, 10), r(20, 5)}, []backing.Range{r(10, 10)}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if got := Subtract(tc.rs, tc.cut); !slices.Equal(got, tc.out) {
				t.Errorf("Subtract(%v, %v) = %v, want %v", tc.rs, tc.cut, got, tc.out)
			}
		})
	}
}

func TestAlign(t *testing.T) {
	tests := []struct {
		name string
		rs   []backing.Range
		lim  backing.Limits
		out  []backing.Range
	}{
		{"aligned", []backing.Range{r(0, 8)}, backing.Limits{Granularity: 4}, []backing.Range{r(0, 8)}},
		{"cut inward", []backing.Range{r(1, 10)}, backing.Limits{Granularity: 4}, []backing.Range{r(4, 4)}},
		{"too small", []backing.Range{r(1, 6)}, backing.Limits{Granularity: 4}, nil},
		{"split", []backing.Range{r(0, 10)}, backing.Limits{Granularity: 1, MaxBytes: 4}, []backing.Range{r(0, 4), r(4, 4), r(8, 2)}},
		{"max below granularity", []backing.Range{r(0, 8)}, backing.Limits{Granularity: 4, MaxBytes: 3}, []backing.Range{r(0, 4), r(4, 4)}},
		{"max rounded down", []backing.Range{r(0, 16)}, backing.Limits{Granularity: 4, MaxBytes: 10}, []backing.Range{r(0, 8), r(8, 8)}},
		{"zero granularity", []backing.Range{r(3, 5)}, backing.Limits{}, []backing.Range{r(3, 5)}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if got := Align(tc.rs, tc.lim); !slices.Equal(got, tc.out) {
				t.Errorf("Align(%v, %+v) = %v, want %v", tc.rs, tc.lim, got, tc.out)
			}
		})
	}
}

// The engine plans a long trim on a device with a small MaxBytes as one
// range per merged range, and splits it into the device's calls only as it
// issues them: the plan's size does not grow with the trim's length.
func TestEngineSplitsAsItIssues(t *testing.T) {
	const size, maxBytes = 64 << 20, 64 << 10
	rec := backing.NewRecorder(limited{backing.NewMem("a", size), backing.Limits{Granularity: 4096, MaxBytes: maxBytes}})
	devs := group([]Extent{{Dev: rec, Off: 0, Len: size}})
	if p := plan(OpDiscard, devs, New()); len(p.Devices[0].Calls) != 1 {
		t.Fatalf("engine plan holds %d calls, want the 1 range", len(p.Devices[0].Calls))
	}
	eng := New()
	eng.PerRequest = true
	if err := eng.Discard([]Extent{{Dev: rec, Off: 0, Len: size}}); err != nil {
		t.Fatal(err)
	}
	calls := rec.Calls(backing.OpDiscard)
	if len(calls) != size/maxBytes {
		t.Fatalf("%d discard calls, want %d", len(calls), size/maxBytes)
	}
	for i, c := range calls {
		if c.Off != int64(i)*maxBytes || c.Len != maxBytes {
			t.Fatalf("call %d is %v, want %d+%d", i, c, int64(i)*maxBytes, maxBytes)
		}
	}
	if st := eng.Stats().Devices[0]; st.Calls != size/maxBytes || st.BytesOut != size {
		t.Fatalf("stats %+v", st)
	}
}
