package metrics

import (
	"errors"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/nbdmapper/nbdmapper/backing"
	"github.com/nbdmapper/nbdmapper/flush"
	"github.com/nbdmapper/nbdmapper/internal/testing/fault"
)

// A device whose sync failed reads 1 in nbdmapper_device_failed, and stays
// there after a sync that succeeds; the other device reads 0 throughout.
func TestDeviceFailedGauge(t *testing.T) {
	e := flush.New()
	m := New(Config{Flush: e})
	faulty := fault.Files(t, 1<<20, "good.img", "bad.img")
	var devs [2]backing.Device
	var names [2]string
	for i, f := range faulty {
		devs[i] = e.Track(f)
		names[i] = f.Name()
	}
	gauges := func(good, bad float64) []wantValue {
		return []wantValue{
			{"nbdmapper_device_failed", map[string]string{"device": names[0]}, good},
			{"nbdmapper_device_failed", map[string]string{"device": names[1]}, bad},
		}
	}
	checkValues(t, gather(t, m), gauges(0, 0))

	for _, d := range devs {
		if _, err := d.WriteAt([]byte{1}, 0); err != nil {
			t.Fatal(err)
		}
	}
	faulty[1].FailSync(unix.EIO)
	if err := e.Flush(devs[:]); !errors.Is(err, flush.ErrSyncFailed) && !errors.Is(err, unix.EIO) {
		t.Fatalf("flush over a failing sync: %v, want EIO", err)
	}
	checkValues(t, gather(t, m), gauges(0, 1))

	faulty[1].FailSync(nil)
	if err := e.Flush(devs[1:]); !errors.Is(err, flush.ErrSyncFailed) {
		t.Fatalf("flush after the failure: %v, want ErrSyncFailed", err)
	}
	checkValues(t, gather(t, m), gauges(0, 1))
}
