// Package metrics exposes what nbdmapper does to Prometheus: requests per
// export and op at the protocol edge, what the flush engine made of the
// flushes (syncs issued, skipped because the device was clean, coalesced
// into a running sync), what the discard engine made of the trims (ranges
// received, calls issued after merging), and the shape of each table.
//
//	client -> nbdtarget -> table -> flush / discard -> backing
//	              \           \          \
//	               `-----------`----------`--> Stats() -> metrics -> /metrics
//
// It sits beside the data flow, not in it: nothing in the flow imports
// metrics, and metrics is the only package that imports Prometheus. The
// other packages keep plain counters behind a Stats() method; a scrape reads
// them and turns them into const metrics, so a scrape costs nothing on the
// I/O path and a counter can never drift from what the engine itself
// reports. Durations need distributions, which plain counters cannot carry,
// so the engines also offer Observe hooks; New points them at histograms.
//
// Label values are bounded by configuration, never by traffic: export names,
// op names, backing device names from the tables, target types and NBD errno
// names. Offsets and lengths never become labels. Every series that the
// configuration implies exists from the first scrape with value 0, so that
// rate() and absent() behave from the start.
//
// docs/metrics.md lists every metric and the question it answers.
package metrics
