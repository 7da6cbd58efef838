package backing

import (
	"bytes"
	"errors"
	"slices"
	"sync"
	"testing"
)

func TestRecorderLogsCallsInOrder(t *testing.T) {
	for name, d := range devices(t) {
		t.Run(name, func(t *testing.T) {
			r := NewRecorder(d)
			if r.ID() != d.ID() || r.Size() != d.Size() {
				t.Fatalf("Recorder must pass ID and Size through")
			}
			data := bytes.Repeat([]byte{7}, 8192)
			if _, err := r.WriteAt(data, 8192); err != nil {
				t.Fatal(err)
			}
			if err := r.Discard(8192, 4096); err != nil {
				t.Fatal(err)
			}
			if err := r.Zero(12288, 4096, false); err != nil {
				t.Fatal(err)
			}
			if err := r.Sync(); err != nil {
				t.Fatal(err)
			}
			// A negative length: the inner device's error is logged with the call.
			errOut := r.Discard(0, -4096)
			if errOut == nil {
				t.Fatal("discard of a negative length succeeded")
			}

			want := []string{"write 8192+8192", "discard 8192+4096", "zero 12288+4096", "sync"}
			var got []string
			for _, c := range r.Calls() {
				got = append(got, c.String())
			}
			if !slices.Equal(got[:4], want) {
				t.Errorf("calls = %q, want %q", got[:4], want)
			}
			if last := r.Calls()[4]; last.Op != OpDiscard || !errors.Is(last.Err, errOut) {
				t.Errorf("failed call logged as %v, want discard with %v", last, errOut)
			}
			if n := r.Count(OpDiscard); n != 2 {
				t.Errorf("Count(discard) = %d, want 2", n)
			}
			if n := len(r.Calls(OpSync, OpZero)); n != 2 {
				t.Errorf("Calls(sync, zero) has %d calls, want 2", n)
			}
			// The calls really reached the inner device.
			buf := make([]byte, 8192)
			if _, err := d.ReadAt(buf, 8192); err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(buf, make([]byte, 8192)) {
				t.Errorf("discard+zero through the recorder did not reach the device")
			}
			r.Reset()
			if len(r.Calls()) != 0 {
				t.Errorf("Reset left %d calls", len(r.Calls()))
			}
		})
	}
}

func TestRecorderConcurrent(t *testing.T) {
	r := NewRecorder(NewMem("mem", 1<<20))
	var wg sync.WaitGroup
	for i := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for j := range 16 {
				off := int64(i*16+j) * 4096
				if err := r.Discard(off, 4096); err != nil {
					t.Error(err)
				}
			}
		}()
	}
	wg.Wait()
	if n := r.Count(OpDiscard); n != 128 {
		t.Fatalf("logged %d discards, want 128", n)
	}
}
