package metadata

import (
	"os"
	"path/filepath"
	"testing"
)

// BenchmarkInsert maps consecutive blocks of one thin device, committing
// every 1024 inserts, as a pool provisioning a sequential write would.
func BenchmarkInsert(b *testing.B) {
	const size = 256 << 20
	path := filepath.Join(b.TempDir(), "meta")
	f, err := os.Create(path)
	if err != nil {
		b.Fatal(err)
	}
	defer f.Close()
	if err := f.Truncate(size); err != nil {
		b.Fatal(err)
	}
	w, err := Format(f, size, 128, 1<<24)
	if err != nil {
		b.Fatal(err)
	}
	if err := w.CreateThin(1); err != nil {
		b.Fatal(err)
	}
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		db, err := w.AllocData()
		if err != nil {
			b.Fatal(err)
		}
		if err := w.Insert(1, uint64(i), db); err != nil {
			b.Fatal(err)
		}
		if i%1024 == 1023 {
			if err := w.Commit(); err != nil {
				b.Fatal(err)
			}
		}
	}
}

// BenchmarkLookup looks up mapped blocks of a 100,000-block device in a
// pool thin_restore wrote (a depth-4 path of reads and checksums each).
func BenchmarkLookup(b *testing.B) {
	m := genModel(1, 100_000)
	p := openFile(b, restore(b, m, 64<<20))
	ms := m.Devices[0].Mappings
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		x := ms[i*7919%len(ms)]
		if got, ok, err := p.Lookup(1, x.VBlock); err != nil || !ok || got != x {
			b.Fatalf("Lookup(1, %d) = %+v %v %v, want %+v", x.VBlock, got, ok, err, x)
		}
	}
}
