package metrics

import (
	"maps"
	"runtime"
	"runtime/debug"
	"slices"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/nbdmapper/nbdmapper/backing"
	"github.com/nbdmapper/nbdmapper/discard"
	"github.com/nbdmapper/nbdmapper/flush"
	"github.com/nbdmapper/nbdmapper/mapped"
	"github.com/nbdmapper/nbdmapper/nbdtarget"
	"github.com/nbdmapper/nbdmapper/remote"
	"github.com/nbdmapper/nbdmapper/snapshot"
	"github.com/nbdmapper/nbdmapper/table"
	"github.com/nbdmapper/nbdmapper/wire"
)

// errnoNames are the NBD error values the server replies with (the Linux
// errno numbers), as errno label values. Every one exists for every export
// and op from the start; anything else would be counted as "other".
var errnoNames = map[uint32]string{
	wire.EPERM:     "EPERM",
	wire.EIO:       "EIO",
	wire.ENOMEM:    "ENOMEM",
	wire.EINVAL:    "EINVAL",
	wire.ENOSPC:    "ENOSPC",
	wire.EOVERFLOW: "EOVERFLOW",
	wire.ENOTSUP:   "ENOTSUP",
	wire.ESHUTDOWN: "ESHUTDOWN",
}

// errnoOrder is errnoNames' keys ascending, for a stable exposition.
var errnoOrder = slices.Sorted(maps.Keys(errnoNames))

// ErrnoName is the errno label value for an NBD error value.
func ErrnoName(errno uint32) string {
	if n, ok := errnoNames[errno]; ok {
		return n
	}
	return "other"
}

func desc(name, help string, labels ...string) *prometheus.Desc {
	return prometheus.NewDesc(name, help, labels, nil)
}

// Descriptions of the metrics read from Stats at scrape time.
var (
	// Front end: nbdtarget.Server.
	descRequests = desc("nbdmapper_requests_total",
		"NBD requests completed (replied to, or finished for NBD_CMD_DISC), by export and op.",
		"export", "op")
	descRequestBytes = desc("nbdmapper_request_bytes_total",
		"Bytes covered by completed NBD requests: data read or written, or the length trimmed, zeroed, cached or queried.",
		"export", "op")
	descRequestErrors = desc("nbdmapper_request_errors_total",
		"NBD requests that got an error reply, by export, op and NBD error name.",
		"export", "op", "errno")
	descInFlight = desc("nbdmapper_requests_in_flight",
		"NBD requests decoded and not yet replied to, by export.",
		"export")
	descConnections = desc("nbdmapper_connections_active",
		"Client connections in the transmission phase now, by export.",
		"export")
	descConnectionsTotal = desc("nbdmapper_connections_total",
		"Client connections that reached the transmission phase since start, by export.",
		"export")
	descConnectionsOpen = desc("nbdmapper_connections_open",
		"Client connections open now, handshakes included (bounded by --max-connections).")
	descConnectionsRefused = desc("nbdmapper_connections_refused_total",
		"Connections closed at once because --max-connections were open.")
	descHandshakeTimeouts = desc("nbdmapper_handshake_timeouts_total",
		"Connections closed for not finishing the NBD handshake within --handshake-timeout.")
	descReplyTimeouts = desc("nbdmapper_reply_timeouts_total",
		"Connections closed because the client took none of its replies within --reply-timeout.")
	descPayloadTimeouts = desc("nbdmapper_payload_timeouts_total",
		"Connections closed because the client did not send the rest of a write's payload within --reply-timeout.")
	descAcceptRetries = desc("nbdmapper_accept_retries_total",
		"Accept errors (out of file descriptors or memory, aborted connections) backed off and retried.")
	descPanics = desc("nbdmapper_panics_total",
		"Panics in request code recovered and answered with EIO (each is a bug; the log has its stack).")
	descMemoryInUse = desc("nbdmapper_request_memory_bytes",
		"Bytes of the --memory budget held by requests now.")
	descMemoryLimit = desc("nbdmapper_request_memory_limit_bytes",
		"The --memory budget: the most all requests together may hold.")
	descMemoryWaits = desc("nbdmapper_request_memory_waits_total",
		"Requests that waited for the --memory budget before being read further.")
	descReadChunks = desc("nbdmapper_read_chunks_total",
		"Content chunks of structured read replies sent, by export and type: data (OFFSET_DATA) or hole (OFFSET_HOLE, zeros not read or sent).",
		"export", "type")
	descReadHoleBytes = desc("nbdmapper_read_hole_bytes_total",
		"Bytes of reads answered as hole chunks, by export.",
		"export")
	descReadSplicedBytes = desc("nbdmapper_read_spliced_bytes_total",
		"Bytes of reads sent by splice(2), from the page cache to the socket without a copy in the server, by export.",
		"export")
	descSerialRequests = desc("nbdmapper_serial_requests_total",
		"Requests run in serial mode, for clients that wait for each reply and flush: read and run by one goroutine with none reading ahead, by export.",
		"export")

	// Flush engine.
	descFlushes = desc("nbdmapper_flushes_total",
		"Flushes the flush engine was asked to make durable (NBD_CMD_FLUSH and FUA writes, all exports).")
	descDeviceFlushes = desc("nbdmapper_device_flushes_total",
		"Flushes that covered this backing device (fanned out to it): each needed it durable.",
		"device")
	descDeviceSyncs = desc("nbdmapper_device_syncs_total",
		"Syncs (fdatasync) issued to this backing device.",
		"device")
	descDeviceSkipped = desc("nbdmapper_device_syncs_skipped_total",
		"Flushes of this device that needed no sync because nothing had written it since its last sync.",
		"device")
	descDeviceCoalesced = desc("nbdmapper_device_flushes_coalesced_total",
		"Flushes of this device served by a sync another flush started (group commit).",
		"device")
	descDeviceSyncErrors = desc("nbdmapper_device_sync_errors_total",
		"Syncs of this backing device that failed.",
		"device")
	descDeviceDirty = desc("nbdmapper_device_dirty",
		"1 if this backing device has writes that are not yet synced, else 0.",
		"device")
	descDeviceFailed = desc("nbdmapper_device_failed",
		"1 if a sync or durable write of this backing device failed, so that every later flush of it fails until restart, else 0.",
		"device")

	// Hole maps (backing.HoleMap, one per backing file).
	descHoleLookups = desc("nbdmapper_device_hole_map_lookups_total",
		"256 KiB chunks a read or block status looked up in the device's hole map, by result: hit (answered from the map) or miss (the file system was asked).",
		"device", "result")
	descHoleRefused = desc("nbdmapper_device_hole_map_refused_total",
		"Hole answers of the file system not kept because a write or discard of the chunk raced the question.",
		"device")
	descHoleSkipped = desc("nbdmapper_device_hole_map_skipped_total",
		"Discards, and zeroings that may punch, of ranges the hole map knew to be holes already: answered without the file system.",
		"device")
	descHoleKnown = desc("nbdmapper_device_hole_map_known_chunks",
		"256 KiB chunks whose holes the map knows now (at most nbdmapper_device_hole_map_slots).",
		"device")
	descHoleSlots = desc("nbdmapper_device_hole_map_slots",
		"Capacity of the device's hole map in chunks (24 bytes each).",
		"device")

	// Discard engine.
	descDiscardRangesIn = desc("nbdmapper_device_discard_ranges_received_total",
		"Discard ranges that reached this device after mapping, before merging.",
		"device")
	descDiscardBytesIn = desc("nbdmapper_device_discard_received_bytes_total",
		"Bytes of the discard ranges that reached this device, before merging and alignment.",
		"device")
	descDiscardCalls = desc("nbdmapper_device_discard_calls_total",
		"Discard calls issued to this backing device (BLKDISCARD or hole punch).",
		"device")
	descDiscardBytesOut = desc("nbdmapper_device_discard_bytes_total",
		"Bytes discarded on this backing device by the calls issued.",
		"device")
	descDiscardMerged = desc("nbdmapper_device_discard_ranges_merged_total",
		"Discard ranges that disappeared into a neighbour when merging (ranges received minus calls issued, before splitting).",
		"device")
	descDiscardUnsupported = desc("nbdmapper_device_discard_unsupported_total",
		"Discard calls dropped because the device cannot discard (discard is advisory).",
		"device")
	descDiscardErrors = desc("nbdmapper_device_discard_errors_total",
		"Discard or zeroing calls on this device that failed.",
		"device")
	descZeroRangesIn = desc("nbdmapper_device_zero_ranges_received_total",
		"Write-zeroes ranges that reached this device after mapping, before merging.",
		"device")
	descZeroCalls = desc("nbdmapper_device_zero_calls_total",
		"Zeroing calls issued to this backing device (BLKZEROOUT, fallocate, or written zeros).",
		"device")

	// Remote exports (package remote).
	descRemoteConnections = desc("nbdmapper_remote_connections",
		"Connections to the remote export up now.",
		"device")
	descRemoteConnectionsWanted = desc("nbdmapper_remote_connections_wanted",
		"Connections nbdmapper keeps to the remote export (--remote-connections with CAN_MULTI_CONN, else 1).",
		"device")
	descRemoteReconnects = desc("nbdmapper_remote_reconnects_total",
		"Connections to the remote export made again after one was lost.",
		"device")
	descRemoteDisconnects = desc("nbdmapper_remote_disconnects_total",
		"Connections to the remote export lost (errors, protocol violations, requests past --remote-timeout).",
		"device")
	descRemoteConnectErrors = desc("nbdmapper_remote_connect_errors_total",
		"Attempts to connect to the remote export that failed.",
		"device")
	descRemoteRetries = desc("nbdmapper_remote_retries_total",
		"Requests sent again to the remote export because their connection was lost.",
		"device")
	descRemoteTimeouts = desc("nbdmapper_remote_timeouts_total",
		"Requests to the remote export failed with EIO at --remote-timeout.",
		"device")
	descRemoteRequests = desc("nbdmapper_remote_requests_total",
		"Requests to the remote export, by NBD op, each counted once however often sent.",
		"device", "op")
	descRemoteErrorReplies = desc("nbdmapper_remote_error_replies_total",
		"Requests the remote export answered with an error.",
		"device")
	descRemoteInFlight = desc("nbdmapper_remote_requests_in_flight",
		"Requests sent to the remote export and not yet answered.",
		"device")
	descRemoteUnflushed = desc("nbdmapper_remote_unflushed_writes",
		"Writes the remote export acknowledged that no flush has covered yet.",
		"device")
	descRemoteLost = desc("nbdmapper_remote_writes_lost",
		"1 if a connection to the remote export dropped or was remade with unflushed writes, so that every flush of it fails until restart, else 0.",
		"device")
	// Snapshots (package snapshot, for the whole process).
	descSnapCommits = desc("nbdmapper_snapshot_commits_total",
		"Metadata commits of persistent snapshot stores: each one sync, one metadata write, one sync, for every exception ready at the time.")
	descSnapExceptions = desc("nbdmapper_snapshot_exceptions_total",
		"Exceptions (chunks copied to a COW device) those commits carried; over commits, the batching.")
	descSnapMaxBatch = desc("nbdmapper_snapshot_commit_batch_max",
		"The most exceptions one commit has carried since start.")
	descSnapMergesRunning = desc("nbdmapper_snapshot_merges_running",
		"snapshot-merge devices merging now.")
	descSnapMergesDone = desc("nbdmapper_snapshot_merges_completed_total",
		"snapshot-merge merges that finished: the origin holds the snapshot.")
	descSnapMergeFailures = desc("nbdmapper_snapshot_merge_failures_total",
		"snapshot-merge merges stopped by a device error (status Merge failed).")
	descSnapMergedBytes = desc("nbdmapper_snapshot_merged_bytes_total",
		"Bytes merges copied from COW devices back to their origins.")
	descSnapHandovers = desc("nbdmapper_snapshot_handovers_total",
		"COW stores handed from one loaded snapshot to another (lvconvert --merge, a reloaded snapshot).")

	// File system calls (backing.CallStats).
	descDeviceCalls = desc("nbdmapper_device_calls_in_progress",
		"System calls of backing files and block devices in the kernel now (at most 64 per device, 1024 in all).")
	descDeviceCallWaits = desc("nbdmapper_device_call_waits_total",
		"Times a system call of a backing device waited for a slot: its device had 64 in the kernel, or the process 1024.")

	// Tables.
	descExportSize = desc("nbdmapper_export_size_bytes",
		"Size of the export's virtual device.",
		"export")
	descExportSegments = desc("nbdmapper_export_segments",
		"Table lines of the export, by target type.",
		"export", "target")
	descExportDevices = desc("nbdmapper_export_backing_devices",
		"Distinct backing devices the export's table uses.",
		"export")
	descSuspended = desc("nbdmapper_export_suspended",
		"1 while the export's device is suspended (nbdmapper suspend), else 0.",
		"export")
	descSuspendedSeconds = desc("nbdmapper_export_suspended_seconds_total",
		"Time the export's device has spent suspended.",
		"export")
	descSuspends = desc("nbdmapper_export_suspends_total",
		"Suspends of the export's device (nbdmapper suspend, or resume with a reloaded table).",
		"export")
	descReloads = desc("nbdmapper_export_reloads_total",
		"Tables loaded into the export's device (nbdmapper reload).",
		"export")
	descRequestsHeld = desc("nbdmapper_export_requests_held_total",
		"Requests that waited for the export's device to be resumed.",
		"export")
	descDeviceSize = desc("nbdmapper_device_size_bytes",
		"Size of the backing device.",
		"device")
	descBuildInfo = desc("nbdmapper_build_info",
		"Always 1; the labels say which nbdmapper is running.",
		"version", "revision", "goversion")
)

// statsCollector turns the server's and engines' plain Stats into const
// metrics at scrape time. The table metrics never change, so they are built
// once.
type statsCollector struct {
	cfg     Config
	devices []string // from the tables: reported with zeros until an engine sees them
	static  []prometheus.Metric
}

func newStatsCollector(cfg Config, devices []string, version string) *statsCollector {
	c := &statsCollector{cfg: cfg, devices: devices}
	gauge := func(d *prometheus.Desc, v float64, labels ...string) {
		c.static = append(c.static, prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, labels...))
	}
	gauge(descBuildInfo, 1, version, buildRevision(), runtime.Version())
	if cfg.Server == nil {
		return c
	}
	devSize := make(map[string]int64)
	for _, x := range cfg.Server.ExportList() {
		for _, d := range x.Dev.Table().Devices() {
			devSize[d.Name()] = d.Size()
		}
	}
	for _, n := range devices {
		gauge(descDeviceSize, float64(devSize[n]), n)
	}
	return c
}

func buildRevision() string {
	if bi, ok := debug.ReadBuildInfo(); ok {
		for _, s := range bi.Settings {
			if s.Key == "vcs.revision" {
				return s.Value
			}
		}
	}
	return "unknown"
}

func (c *statsCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{
		descRequests, descRequestBytes, descRequestErrors, descInFlight,
		descConnections, descConnectionsTotal, descConnectionsOpen,
		descConnectionsRefused, descHandshakeTimeouts, descReplyTimeouts, descPayloadTimeouts, descAcceptRetries,
		descPanics, descMemoryInUse, descMemoryLimit, descMemoryWaits,
		descReadChunks, descReadHoleBytes, descReadSplicedBytes, descSerialRequests, descHoleLookups, descHoleRefused, descHoleKnown, descHoleSlots,
		descFlushes, descDeviceFlushes, descDeviceSyncs, descDeviceSkipped,
		descDeviceCoalesced, descDeviceSyncErrors, descDeviceDirty, descDeviceFailed,
		descDiscardRangesIn, descDiscardBytesIn, descDiscardCalls,
		descDiscardBytesOut, descDiscardMerged, descDiscardUnsupported,
		descDiscardErrors, descZeroRangesIn, descZeroCalls,
		descExportSize, descExportSegments, descExportDevices, descDeviceSize,
		descSuspended, descSuspendedSeconds, descSuspends, descReloads, descRequestsHeld,
		descRemoteConnections, descRemoteConnectionsWanted, descRemoteReconnects, descRemoteDisconnects,
		descRemoteConnectErrors, descRemoteRetries, descRemoteTimeouts, descRemoteRequests,
		descRemoteErrorReplies, descRemoteInFlight, descRemoteUnflushed, descRemoteLost,
		descSnapCommits, descSnapExceptions, descSnapMaxBatch, descSnapMergesRunning,
		descSnapMergesDone, descSnapMergeFailures, descSnapMergedBytes, descSnapHandovers,
		descDeviceCalls, descDeviceCallWaits, descBuildInfo,
	} {
		ch <- d
	}
}

func (c *statsCollector) Collect(ch chan<- prometheus.Metric) {
	for _, m := range c.static {
		ch <- m
	}
	if c.cfg.Server != nil {
		c.collectServer(ch, c.cfg.Server.Stats())
	}
	if c.cfg.Flush != nil {
		c.collectFlush(ch, c.cfg.Flush.Stats())
	}
	if c.cfg.Discard != nil {
		c.collectDiscard(ch, c.cfg.Discard.Stats())
	}
	if c.cfg.Remotes != nil {
		collectRemotes(ch, c.cfg.Remotes.Stats())
	}
	collectSnapshot(ch, snapshot.ReadStats())
	calls := backing.ReadCallStats()
	gauge(ch, descDeviceCalls, float64(calls.InProgress))
	counter(ch, descDeviceCallWaits, calls.Waits)
}

// collectRemotes reports every remote export the tables opened.
func collectRemotes(ch chan<- prometheus.Metric, stats []remote.Stats) {
	for _, s := range stats {
		gauge(ch, descRemoteConnections, float64(s.Connections), s.Name)
		gauge(ch, descRemoteConnectionsWanted, float64(s.Wanted), s.Name)
		counter(ch, descRemoteReconnects, s.Reconnects, s.Name)
		counter(ch, descRemoteDisconnects, s.Drops, s.Name)
		counter(ch, descRemoteConnectErrors, s.DialErrors, s.Name)
		counter(ch, descRemoteRetries, s.Retries, s.Name)
		counter(ch, descRemoteTimeouts, s.Timeouts, s.Name)
		for _, op := range remote.Ops() {
			counter(ch, descRemoteRequests, s.Requests[op], s.Name, op)
		}
		counter(ch, descRemoteErrorReplies, s.ErrorReplies, s.Name)
		gauge(ch, descRemoteInFlight, float64(s.InFlight), s.Name)
		gauge(ch, descRemoteUnflushed, float64(s.Unflushed), s.Name)
		gauge(ch, descRemoteLost, b2f(s.Lost), s.Name)
	}
}

func collectSnapshot(ch chan<- prometheus.Metric, s snapshot.Stats) {
	counter(ch, descSnapCommits, s.Commits)
	counter(ch, descSnapExceptions, s.Exceptions)
	gauge(ch, descSnapMaxBatch, float64(s.MaxBatch))
	gauge(ch, descSnapMergesRunning, float64(s.MergesRunning))
	counter(ch, descSnapMergesDone, s.MergesDone)
	counter(ch, descSnapMergeFailures, s.MergeFail)
	counter(ch, descSnapMergedBytes, s.MergedBytes)
	counter(ch, descSnapHandovers, s.Handovers)
}

func counter(ch chan<- prometheus.Metric, d *prometheus.Desc, v uint64, labels ...string) {
	ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, float64(v), labels...)
}

func gauge(ch chan<- prometheus.Metric, d *prometheus.Desc, v float64, labels ...string) {
	ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, labels...)
}

// collectServer reports every op of every export, zeros included: the
// server's Stats leaves out ops that never ran.
func (c *statsCollector) collectServer(ch chan<- prometheus.Metric, s nbdtarget.Stats) {
	// Every device below an export, with zeros (and 0 slots) for those
	// without a hole map (block devices, --hole-map=false).
	holeMaps := make(map[string]*backing.HoleMap)
	for _, x := range c.cfg.Server.ExportList() {
		collectDevice(ch, x.Name, x.Dev)
		for _, d := range table.Flatten(x.Dev.Table().Devices()) {
			if h := backing.HoleMapOf(d); h != nil || holeMaps[d.Name()] == nil {
				holeMaps[d.Name()] = h
			}
		}
	}
	for name, h := range holeMaps {
		var st backing.HoleMapStats
		if h != nil {
			st = h.Stats()
		}
		counter(ch, descHoleLookups, st.Hits, name, "hit")
		counter(ch, descHoleLookups, st.Misses, name, "miss")
		counter(ch, descHoleRefused, st.Refused, name)
		counter(ch, descHoleSkipped, st.Skipped, name)
		gauge(ch, descHoleKnown, float64(st.Known), name)
		gauge(ch, descHoleSlots, float64(st.Slots), name)
	}
	gauge(ch, descConnectionsOpen, float64(s.Connections))
	counter(ch, descConnectionsRefused, uint64(s.Refused))
	counter(ch, descHandshakeTimeouts, uint64(s.HandshakeTimeouts))
	counter(ch, descReplyTimeouts, uint64(s.ReplyTimeouts))
	counter(ch, descPayloadTimeouts, uint64(s.PayloadTimeouts))
	counter(ch, descAcceptRetries, uint64(s.AcceptRetries))
	counter(ch, descPanics, uint64(s.Panics))
	gauge(ch, descMemoryInUse, float64(s.MemoryInUse))
	gauge(ch, descMemoryLimit, float64(s.MemoryLimit))
	counter(ch, descMemoryWaits, uint64(s.MemoryWaits))
	for _, x := range s.Exports {
		gauge(ch, descConnections, float64(x.Connections), x.Name)
		counter(ch, descConnectionsTotal, uint64(x.ConnectionsTotal), x.Name)
		gauge(ch, descInFlight, float64(x.InFlight), x.Name)
		counter(ch, descReadChunks, uint64(x.ReadDataChunks), x.Name, "data")
		counter(ch, descReadChunks, uint64(x.ReadHoleChunks), x.Name, "hole")
		counter(ch, descReadHoleBytes, uint64(x.ReadHoleBytes), x.Name)
		counter(ch, descReadSplicedBytes, uint64(x.ReadSplicedBytes), x.Name)
		counter(ch, descSerialRequests, uint64(x.SerialRequests), x.Name)
		for _, name := range nbdtarget.Ops {
			op := x.Ops[name]
			counter(ch, descRequests, uint64(op.Requests), x.Name, name)
			counter(ch, descRequestBytes, uint64(op.Bytes), x.Name, name)
			var other int64
			for errno, n := range op.Errors {
				if _, ok := errnoNames[errno]; !ok {
					other += n
				}
			}
			for _, errno := range errnoOrder {
				counter(ch, descRequestErrors, uint64(op.Errors[errno]), x.Name, name, errnoNames[errno])
			}
			if other > 0 {
				counter(ch, descRequestErrors, uint64(other), x.Name, name, "other")
			}
		}
	}
}

// collectFlush reports the engine's devices, then zeros for table devices
// the engine does not track (yet).
func (c *statsCollector) collectFlush(ch chan<- prometheus.Metric, s flush.Stats) {
	counter(ch, descFlushes, s.Flushes)
	seen := make(map[string]bool, len(s.Devices))
	emit := func(d flush.DeviceStats) {
		seen[d.Name] = true
		counter(ch, descDeviceFlushes, d.Requested, d.Name)
		counter(ch, descDeviceSyncs, d.Syncs, d.Name)
		counter(ch, descDeviceSkipped, d.SkippedClean, d.Name)
		counter(ch, descDeviceCoalesced, d.Coalesced, d.Name)
		counter(ch, descDeviceSyncErrors, d.SyncErrors, d.Name)
		gauge(ch, descDeviceDirty, b2f(d.Dirty), d.Name)
		gauge(ch, descDeviceFailed, b2f(d.Failed), d.Name)
	}
	for _, d := range s.Devices {
		if !seen[d.Name] {
			emit(d)
		}
	}
	for _, n := range c.devices {
		if !seen[n] {
			emit(flush.DeviceStats{Name: n})
		}
	}
}

// collectDiscard reports the engine's devices, then zeros for table devices
// the engine has not seen yet (it learns devices on first use).
func (c *statsCollector) collectDiscard(ch chan<- prometheus.Metric, s discard.Stats) {
	seen := make(map[string]bool, len(s.Devices))
	emit := func(d discard.DeviceStats) {
		seen[d.Name] = true
		counter(ch, descDiscardRangesIn, d.RangesIn, d.Name)
		counter(ch, descDiscardBytesIn, d.BytesIn, d.Name)
		counter(ch, descDiscardCalls, d.Calls, d.Name)
		counter(ch, descDiscardBytesOut, d.BytesOut, d.Name)
		counter(ch, descDiscardMerged, d.MergedAway, d.Name)
		counter(ch, descDiscardUnsupported, d.Unsupported, d.Name)
		counter(ch, descDiscardErrors, d.Errors, d.Name)
		counter(ch, descZeroRangesIn, d.ZeroRangesIn, d.Name)
		counter(ch, descZeroCalls, d.ZeroCalls, d.Name)
	}
	for _, d := range s.Devices {
		if !seen[d.Name] {
			emit(d)
		}
	}
	for _, n := range c.devices {
		if !seen[n] {
			emit(discard.DeviceStats{Name: n})
		}
	}
}

func b2f(b bool) float64 {
	if b {
		return 1
	}
	return 0
}

// collectDevice reports an export's table, which a reload may change, and
// its lifecycle.
func collectDevice(ch chan<- prometheus.Metric, name string, d *mapped.Device) {
	t := d.Table()
	gauge(ch, descExportSize, float64(t.Size()), name)
	bytype := make(map[string]int)
	for _, l := range t.Lines {
		bytype[l.Target.Type()]++
	}
	types := table.Targets()
	for t := range bytype {
		if !slices.Contains(types, t) {
			types = append(types, t)
		}
	}
	for _, typ := range types {
		gauge(ch, descExportSegments, float64(bytype[typ]), name, typ)
	}
	gauge(ch, descExportDevices, float64(len(t.Devices())), name)
	in := d.Info()
	gauge(ch, descSuspended, b2f(in.Suspended), name)
	ch <- prometheus.MustNewConstMetric(descSuspendedSeconds, prometheus.CounterValue, in.SuspendedTime.Seconds(), name)
	counter(ch, descSuspends, in.Suspends, name)
	counter(ch, descReloads, in.Reloads, name)
	counter(ch, descRequestsHeld, uint64(in.Held), name)
}
