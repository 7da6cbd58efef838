package discard

import (
	"sync/atomic"

	"github.com/nbdmapper/nbdmapper/backing"
)

// Stats is a snapshot of the engine's counters, read by package metrics.
type Stats struct {
	Devices []DeviceStats // in order of first use
}

// DeviceStats counts one backing device's discard and zero traffic.
type DeviceStats struct {
	Name string
	// RangesIn and BytesIn are the discard ranges received (after mapping
	// through the table, before merging).
	RangesIn, BytesIn uint64
	// Calls is the discard calls made on the device; BytesOut the bytes the
	// successful ones discarded. Calls much lower than RangesIn is the point.
	Calls, BytesOut uint64
	// MergedAway is the received ranges that merged into a neighbour.
	MergedAway uint64
	// Unsupported is the discard calls skipped or refused because the
	// device cannot discard (not errors: a discard is advisory).
	Unsupported uint64
	// Errors is the failed discard and zero calls.
	Errors uint64
	// ZeroRangesIn is the write-zeroes ranges received; ZeroCalls the
	// native zeroing calls made (written zeros are not counted).
	ZeroRangesIn, ZeroCalls uint64
}

type counters struct {
	rangesIn, bytesIn, calls, bytesOut, mergedAway atomic.Uint64
	unsupported, errors, zeroRangesIn, zeroCalls   atomic.Uint64
}

// received1 is received for a single range.
func (c *counters) received1(r backing.Range) {
	c.rangesIn.Add(1)
	c.bytesIn.Add(uint64(r.Len))
}

func (c *counters) received(rs []backing.Range) {
	c.rangesIn.Add(uint64(len(rs)))
	c.bytesIn.Add(uint64(Bytes(rs)))
}

// Stats returns the counters of every device the engine has seen.
func (e *Engine) Stats() Stats {
	e.mu.Lock()
	order := append([]*device(nil), e.order...)
	e.mu.Unlock()
	s := Stats{Devices: make([]DeviceStats, len(order))}
	for i, st := range order {
		c := &st.stats
		s.Devices[i] = DeviceStats{
			Name:         st.dev.Name(),
			RangesIn:     c.rangesIn.Load(),
			BytesIn:      c.bytesIn.Load(),
			Calls:        c.calls.Load(),
			BytesOut:     c.bytesOut.Load(),
			MergedAway:   c.mergedAway.Load(),
			Unsupported:  c.unsupported.Load(),
			Errors:       c.errors.Load(),
			ZeroRangesIn: c.zeroRangesIn.Load(),
			ZeroCalls:    c.zeroCalls.Load(),
		}
	}
	return s
}
