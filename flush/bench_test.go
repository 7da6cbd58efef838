package flush

import (
	"math/rand/v2"
	"path/filepath"
	"sync"
	"testing"

	"github.com/nbdmapper/nbdmapper/backing"
	"github.com/nbdmapper/nbdmapper/internal/testing/sparse"
)

// BenchmarkWriteFUA runs concurrent 4k FUA writes (RWF_DSYNC) on a real
// file, alone and beside a client that writes and flushes in a loop: what
// holding a durable write's answer for the calls it overlapped (settle)
// costs. Run it from a directory on a real disk (TMPDIR): tmpfs syncs
// nothing.
func BenchmarkWriteFUA(b *testing.B) {
	for _, flusher := range []bool{false, true} {
		name := "alone"
		if flusher {
			name = "with-flushes"
		}
		b.Run(name, func(b *testing.B) {
			f, err := backing.OpenFile(sparse.Create(b, filepath.Join(b.TempDir(), "a.img"), 64<<20), false)
			if err != nil {
				b.Fatal(err)
			}
			defer f.Close()
			e := New()
			d := e.Track(f)
			stop := make(chan struct{})
			var wg sync.WaitGroup
			if flusher {
				wg.Go(func() {
					p := make([]byte, 4096)
					for {
						select {
						case <-stop:
							return
						default:
						}
						if _, err := d.WriteAt(p, rand.Int64N(64<<8)*4096); err != nil {
							b.Error(err)
							return
						}
						if err := e.Flush([]backing.Device{d}); err != nil {
							b.Error(err)
							return
						}
					}
				})
			}
			b.SetParallelism(4)
			b.RunParallel(func(pb *testing.PB) {
				p := make([]byte, 4096)
				for pb.Next() {
					if err := e.WriteFUA(d, p, rand.Int64N(64<<8)*4096); err != nil {
						b.Error(err)
						return
					}
				}
			})
			close(stop)
			wg.Wait()
		})
	}
}
