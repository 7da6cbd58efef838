package table

import (
	"bufio"
	"bytes"
	"math/rand/v2"
	"strconv"
	"sync"
	"testing"

	"github.com/nbdmapper/nbdmapper/backing"
)

// The big table: MaxTargets linear lines of 8 sectors (4 KiB), scattered
// over one sparse in-memory disk in a fixed pseudo-random order.
var big struct {
	once sync.Once
	text []byte
	open memOpener
}

func bigTable() ([]byte, memOpener) {
	big.once.Do(func() {
		const n = MaxTargets
		var b []byte
		for i := range n {
			// i*P mod n with P odd is a permutation of 0..n-1 for n a power of 2.
			slot := (i * 0x9E3779B1) & (n - 1)
			b = strconv.AppendInt(b, int64(i)*8, 10)
			b = append(b, " 8 linear disk "...)
			b = strconv.AppendInt(b, int64(slot)*8, 10)
			b = append(b, '\n')
		}
		big.text = b
		big.open = memOpener{"disk": backing.NewMem("disk", n*8*SectorSize)}
	})
	return big.text, big.open
}

// BenchmarkScanLines1M is the baseline for BenchmarkParse1M: only reading
// the same text line by line, as Parse's scanner does.
func BenchmarkScanLines1M(b *testing.B) {
	text, _ := bigTable()
	b.SetBytes(int64(len(text)))
	b.ReportAllocs()
	for b.Loop() {
		sc := bufio.NewScanner(bytes.NewReader(text))
		n := 0
		for sc.Scan() {
			n++
		}
		if n != MaxTargets {
			b.Fatal(n)
		}
	}
}

func BenchmarkParse1M(b *testing.B) {
	text, o := bigTable()
	b.SetBytes(int64(len(text)))
	b.ReportAllocs()
	for b.Loop() {
		tb, err := Parse("big.table", bytes.NewReader(text), o)
		if err != nil || len(tb.Lines) != MaxTargets {
			b.Fatal(err)
		}
	}
}

// BenchmarkMap maps random ranges through the 1,048,576-line table, and
// through a one-line table of the same size as the baseline.
func BenchmarkMap(b *testing.B) {
	text, o := bigTable()
	tb, err := Parse("big.table", bytes.NewReader(text), o)
	if err != nil {
		b.Fatal(err)
	}
	one := mustParse(b, "0 "+strconv.Itoa(MaxTargets*8)+" linear disk 0\n", o)
	for _, c := range []struct {
		name string
		tb   *Table
		n    int64
	}{
		{"1M-lines/4k", tb, 4096},
		{"1M-lines/64k", tb, 65536},
		{"1-line/4k", one, 4096},
	} {
		b.Run(c.name, func(b *testing.B) {
			rng := rand.New(rand.NewPCG(1, 2))
			blocks := c.tb.Size() / c.n
			extents := 0
			emit := func(Extent) bool { extents++; return true }
			b.ReportAllocs()
			for b.Loop() {
				c.tb.Map(rng.Int64N(blocks)*c.n, c.n, emit)
			}
			b.ReportMetric(float64(extents)/float64(b.N), "extents/op")
		})
	}
}
