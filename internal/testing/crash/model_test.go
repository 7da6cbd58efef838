package crash_test

import (
	"testing"

	"github.com/nbdmapper/nbdmapper/internal/testing/crash"
)

// TestModelCheck walks one sector through the worked example of Model's
// doc comment, plus a FUA write on another sector.
func TestModelCheck(t *testing.T) {
	m := crash.NewModel()
	m.AddView("v", 2*crash.SectorSize)
	w1 := m.Begin("v", 0, crash.SectorSize)
	m.Acked(w1, false, 10)
	w2 := m.Begin("v", 0, crash.SectorSize)
	m.Acked(w2, false, 20)
	covers := m.FlushSent()
	m.Flushed("v", covers, 40)
	w3 := m.Begin("v", 0, crash.SectorSize)
	m.Acked(w3, false, 50)
	f := m.Begin("v", crash.SectorSize, crash.SectorSize)
	m.Acked(f, true, 60)
	m.AddView("other", crash.SectorSize)
	o := m.Begin("other", 0, crash.SectorSize)
	m.Acked(o, false, 70)

	initial := make([]byte, crash.SectorSize)
	crash.Pattern(0, 1, initial)
	image := func(sector0, sector1 []byte) []byte { return append(append([]byte(nil), sector0...), sector1...) }
	tests := []struct {
		name     string
		pos      int
		data     []byte
		lost     int
		kind     string
		required int
	}{
		{"before the flush reply: w1 may be there", 39, image(w1.Data, initial), 0, "", 0},
		{"after it: w1 is stale", 41, image(w1.Data, initial), 1, "stale", 1},
		{"after it: w2", 41, image(w2.Data, initial), 0, "", 1},
		{"after it: w3, newer", 41, image(w3.Data, initial), 0, "", 1},
		{"after the FUA reply: the initial sector is stale", 60, image(w2.Data, initial), 1, "stale", 2},
		{"garbage", 41, image(make([]byte, crash.SectorSize), f.Data), 1, "garbage", 1},
		{"another sector's write", 41, image(f.Data, f.Data), 1, "garbage", 1},
		{"another view's write", 41, image(o.Data, initial), 1, "foreign", 1},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			r := m.Check("v", tc.pos, tc.data)
			kinds := map[string]int{"stale": r.Stale, "garbage": r.Garbage, "foreign": r.Foreign}
			if r.Sectors != 2 || r.Lost != tc.lost || r.Required != tc.required || (tc.kind != "" && kinds[tc.kind] != tc.lost) {
				t.Errorf("%+v, want %d lost (%s), %d required", r, tc.lost, tc.kind, tc.required)
			}
			if (r.First != "") != (tc.lost > 0) {
				t.Errorf("First = %q", r.First)
			}
		})
	}
}
