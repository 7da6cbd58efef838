package metrics

import (
	"maps"
	"sync"
	"sync/atomic"

	"github.com/prometheus/client_golang/prometheus"
)

// histograms is a histogram vector of one or two labels, the first an
// export or a device, fed by an Observe hook on the I/O path.
//
// The hook finds its child in a map that is only ever replaced, never
// written (copy on write), so that it takes no lock and hashes no label
// values. The map and the vector are written when a label combination is
// first seen, and at each scrape, which deletes the children of exports and
// devices that are gone (live no longer names them): a server whose exports
// and devices come and go would otherwise keep a histogram for every one it
// ever had.
type histograms struct {
	vec *prometheus.HistogramVec
	// live returns the first label's values in use now; nil: all are.
	live func() map[string]bool

	mu  sync.Mutex // writers of obs, and the vector's children with it
	obs atomic.Pointer[map[key]prometheus.Observer]
}

// key is a child's label values; the second is "" for a one-label vector.
type key [2]string

func newHistograms(opts prometheus.HistogramOpts, labels []string, live func() map[string]bool) *histograms {
	h := &histograms{vec: prometheus.NewHistogramVec(opts, labels), live: live}
	h.obs.Store(&map[key]prometheus.Observer{})
	return h
}

// observer returns the child for k, making it if it is new.
func (h *histograms) observer(k key) prometheus.Observer {
	if o, ok := (*h.obs.Load())[k]; ok {
		return o
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	old := *h.obs.Load()
	if o, ok := old[k]; ok {
		return o
	}
	o := h.vec.WithLabelValues(h.values(k)...)
	m := maps.Clone(old)
	m[k] = o
	h.obs.Store(&m)
	return o
}

func (h *histograms) values(k key) []string {
	if k[1] == "" {
		return k[:1]
	}
	return k[:]
}

// prune deletes the children whose first label live does not name. A child
// first observed between live's answer and the lock is deleted too, and
// made again by its next observation; nothing else is lost.
func (h *histograms) prune() {
	if h.live == nil {
		return
	}
	// Asked before the lock: live takes the engines' locks, under which
	// their hooks may be making a child here.
	live := h.live()
	h.mu.Lock()
	defer h.mu.Unlock()
	old := *h.obs.Load()
	var m map[key]prometheus.Observer
	for k := range old {
		if live[k[0]] {
			continue
		}
		if m == nil {
			m = maps.Clone(old)
		}
		delete(m, k)
		h.vec.DeleteLabelValues(h.values(k)...)
	}
	if m != nil {
		h.obs.Store(&m)
	}
}

func (h *histograms) Describe(ch chan<- *prometheus.Desc) { h.vec.Describe(ch) }

func (h *histograms) Collect(ch chan<- prometheus.Metric) {
	h.prune()
	h.vec.Collect(ch)
}
