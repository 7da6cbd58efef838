package discard_test

import (
	"testing"

	"github.com/nbdmapper/nbdmapper/backing"
	"github.com/nbdmapper/nbdmapper/discard"
)

// BenchmarkLoneTrim is the engine's cost for a trim of one extent with
// nothing else in flight, fio's 1M trim row on a linear table: everything
// but the device call (here a 4 KiB in-memory one).
func BenchmarkLoneTrim(b *testing.B) {
	m := backing.NewMem("m", 64<<20)
	x := []discard.Extent{{Dev: m, Off: 0, Len: 4096}}
	eng := discard.New()
	b.ReportAllocs()
	for b.Loop() {
		if err := eng.Discard(x); err != nil {
			b.Fatal(err)
		}
	}
}
