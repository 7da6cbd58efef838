package mapped_test

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/nbdmapper/nbdmapper/backing"
	"github.com/nbdmapper/nbdmapper/flush"
)

// BenchmarkWrite4KLayers writes 4 KiB to a file through each layer a
// server's write passes, one more per case: os.File's pwrite, the
// backing.File (its bound on calls per device and process), the hole map,
// the flush engine's tracking, and the mapped device over a one-line
// table. The differences are what each layer adds to a write.
func BenchmarkWrite4KLayers(b *testing.B) {
	path := filepath.Join(b.TempDir(), "f")
	if err := os.WriteFile(path, make([]byte, 64<<20), 0o644); err != nil {
		b.Fatal(err)
	}
	raw, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		b.Fatal(err)
	}
	defer raw.Close()
	file, err := backing.OpenFile(path, false)
	if err != nil {
		b.Fatal(err)
	}
	defer file.Close()
	holeMap := backing.NewHoleMap(file)
	tracked := flush.New().Track(holeMap)
	x := parseSet(b, memOpener{"f": tracked}, "x=0 131072 linear f 0\n")[0]

	p := make([]byte, 4096)
	for _, bc := range []struct {
		name  string
		write func(off int64) error
	}{
		{"os.File", func(off int64) error { _, err := raw.WriteAt(p, off); return err }},
		{"backing.File", func(off int64) error { _, err := file.WriteAt(p, off); return err }},
		{"HoleMap", func(off int64) error { _, err := holeMap.WriteAt(p, off); return err }},
		{"tracked", func(off int64) error { _, err := tracked.WriteAt(p, off); return err }},
		{"mapped", func(off int64) error { return x.Write(p, off, false) }},
	} {
		b.Run(bc.name, func(b *testing.B) {
			b.ReportAllocs()
			for i := range b.N {
				if err := bc.write(int64(i%(16<<10)) * 4096); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
