package discard_test

import (
	"path/filepath"
	"runtime"
	"sync"
	"testing"

	"github.com/nbdmapper/nbdmapper/backing"
	"github.com/nbdmapper/nbdmapper/discard"
	"github.com/nbdmapper/nbdmapper/internal/testing/sparse"
)

// Write-zeroes on a device without native zeroing writes zeros from one
// shared buffer: eight concurrent 4 MiB requests allocate far less than the
// 1 MiB buffer each one used to get.
func TestWrittenZerosShareOneBuffer(t *testing.T) {
	const size, reqs = 4 << 20, 8
	f, err := backing.OpenFile(sparse.Create(t, filepath.Join(t.TempDir(), "a.img"), reqs*size), false)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	rec := backing.NewRecorder(noZero{f})
	eng := engine(0, 0)
	zero := func(i int) error {
		return eng.Zero([]discard.Extent{{Dev: rec, Off: int64(i) * size, Len: size}}, false, false)
	}
	if err := zero(0); err != nil { // learn that the device cannot zero
		t.Fatal(err)
	}
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	var wg sync.WaitGroup
	errs := make([]error, reqs)
	for i := range reqs {
		wg.Add(1)
		go func() { defer wg.Done(); errs[i] = zero(i) }()
	}
	wg.Wait()
	runtime.ReadMemStats(&after)
	for i, err := range errs {
		if err != nil {
			t.Fatalf("request %d: %v", i, err)
		}
	}
	if n := rec.Count(backing.OpWrite); n != (reqs+1)*size/(1<<20) {
		t.Fatalf("%d writes reached the device, want %d of 1 MiB", n, (reqs+1)*size/(1<<20))
	}
	if got := after.TotalAlloc - before.TotalAlloc; got >= 1<<20 {
		t.Fatalf("%d concurrent write-zeroes allocated %d bytes, want less than one 1 MiB buffer", reqs, got)
	}
}
