// Command nbdmapper serves device-mapper tables as NBD exports.
//
//	nbdmapper serve [flags] [NAME=TABLE_FILE ...]   serve tables (a demo without any)
//	nbdmapper check [--connect] TABLE_FILE          validate and print a normalised table
//	nbdmapper VERB --help                           one verb's usage, with an example
//
// main parses flags, sets up signals and wires the packages together; the
// work happens in nbdtarget, mapped, control, table, flush, discard and
// backing.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"os"
	"os/signal"
	"runtime/pprof"
	"strings"
	"syscall"
	"time"

	"github.com/nbdmapper/nbdmapper/backing"
	"github.com/nbdmapper/nbdmapper/discard"
	"github.com/nbdmapper/nbdmapper/flush"
	"github.com/nbdmapper/nbdmapper/mapped"
	"github.com/nbdmapper/nbdmapper/nbdtarget"
	"github.com/nbdmapper/nbdmapper/snapshot"
	"github.com/nbdmapper/nbdmapper/table"
)

const usage = `usage:
  nbdmapper serve [--socket PATH [--socket-mode 0660]] [--listen HOST:PORT] [--read-only] [--hole-map=false] [--splice=false]
                  [--metrics HOST:PORT|off] [--metrics-web-config FILE]
                  [--tls off|on|require --tls-cert FILE --tls-key FILE [--tls-ca FILE]]
                  [--allow EXPORT=ID,... | --allow-ro EXPORT=ID,...]
                  [--memory BYTES] [--max-connections N] [--handshake-timeout D] [--reply-timeout D]
                  [--description NAME=TEXT] [--control PATH|off] [--tables DIR] [--procs N|auto] [--merge-rate BYTES]
                  [--shutdown-timeout D]
                  [--remote-connections N] [--remote-timeout D] [--remote-backoff-max D] [--remote-queue-depth N]
                  [NAME=TABLE_FILE ...]
  nbdmapper create NAME TABLE_FILE | remove [--force] NAME   [--control PATH]
  nbdmapper reload NAME TABLE_FILE | suspend NAME | resume NAME | clear NAME   [--control PATH]
  nbdmapper table [--inactive] NAME | info NAME | ls | message NAME SECTOR TEXT   [--control PATH]
  nbdmapper check [--connect] TABLE_FILE
  nbdmapper attach [--connections N] [--block-size BYTES] [--timeout SECONDS] [--follow D]
                   (--socket PATH | --connect HOST:PORT) [--export NAME] /dev/nbdX
  nbdmapper detach /dev/nbdX
  nbdmapper status [--table] [--metrics HOST:PORT|URL] [--tls-ca FILE] [--tls-cert FILE --tls-key FILE]
                   [--user NAME --password-file FILE]   ask a running server, like dmsetup status/table
  nbdmapper wait [--interval D] [--control PATH] NAME   follow a snapshot-merge to its end
  nbdmapper version | --version
  nbdmapper help [VERB] | VERB --help

Table devices are paths, major:minor, /dev/mapper/NAME, or NBD URIs of other servers'
exports: nbd://HOST[:PORT]/EXPORT, nbd+unix:///EXPORT?socket=PATH, nbds://... and
nbds+unix://... with TLS (?tls-certificates=DIR). With no arguments at all, nbdmapper
serves a built-in demo.
`

// commands maps subcommand names to their entry points.
var commands = map[string]func(args []string) error{
	"serve":  runServe,
	"check":  runCheck,
	"attach": runAttach,
	"detach": runDetach,
	"status": runStatus,
	// dmsetup's lifecycle, through the control socket (lifecycle.go).
	"create":  runLifecycle("create"),
	"remove":  runLifecycle("remove"),
	"reload":  runLifecycle("reload"),
	"suspend": runLifecycle("suspend"),
	"resume":  runLifecycle("resume"),
	"clear":   runLifecycle("clear"),
	"table":   runLifecycle("table"),
	"info":    runLifecycle("info"),
	"ls":      runLifecycle("ls"),
	"message": runLifecycle("message"),
	"wait":    runWait,
	"version": runVersion,
}

// help reads commands, so it joins them at init.
func init() { commands["help"] = runHelp }

func main() {
	args := os.Args[1:]
	if len(args) == 0 {
		args = []string{"serve"}
	}
	switch {
	case args[0] == "--version" || args[0] == "-version":
		args[0] = "version"
	case isHelpFlag(args[0]):
		args = append([]string{"help"}, args[1:]...)
	}
	run, ok := commands[args[0]]
	if !ok {
		fmt.Fprintln(os.Stderr, "nbdmapper:", unknownVerb(args[0]))
		os.Exit(2)
	}
	helpWanted = asksHelp(args[1:])
	if err := run(args[1:]); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			if helpWanted {
				os.Exit(0)
			}
			os.Exit(2)
		}
		fmt.Fprintln(os.Stderr, "nbdmapper:", err)
		os.Exit(1)
	}
}

// runCheck validates a table and prints it normalised. Remote devices (NBD
// URIs) are checked for form only, unless --connect: then each is
// connected to, read-only, and the table's areas checked against its size.
func runCheck(args []string) error {
	fs := newFlagSet("check")
	connect := fs.Bool("connect", false, "connect to the remote exports the table names (read-only) and check their sizes")
	var rf remoteFlags
	rf.register(fs)
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() != 1 {
		return fmt.Errorf("check needs exactly one TABLE_FILE\n%s", usage)
	}
	if err := rf.check(); err != nil {
		return err
	}
	s := rf.scheme(slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn})), nil)
	s.Unconnected = !*connect
	images := rf.rbdScheme()
	images.Unconnected = !*connect
	pool := &backing.Pool{ReadOnly: true, Schemes: []backing.Scheme{s, images}}
	defer pool.Close()
	t, err := loadTable(fs.Arg(0), pool)
	if err != nil {
		return err
	}
	fmt.Print(t.String())
	return nil
}

func loadTable(path string, open table.Opener) (*table.Table, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	return table.Parse(path, f, open)
}

type serveFlags struct {
	socket, listen string
	readOnly       bool
	holeMap        bool
	splice         bool
	flushBaseline  string
	cpuProfile     string
	metrics        string
	tables         string
	metricsWeb     string
	socketMode     socketMode
	control        string
	stopTimeout    time.Duration
}

func runServe(args []string) error {
	var sf serveFlags
	fs := newFlagSet("serve")
	fs.StringVar(&sf.socket, "socket", "", "listen on this unix socket")
	fs.StringVar(&sf.listen, "listen", "", "listen on HOST:PORT (default 127.0.0.1:10809 when no --socket)")
	fs.BoolVar(&sf.readOnly, "read-only", false, "serve every export read-only")
	fs.BoolVar(&sf.holeMap, "hole-map", true, "keep a map of each backing file's holes, so that reads of holes are answered without reading them (hole chunks with structured replies); false asks the file system every time and reads holes as data, for files that other processes change while served")
	fs.BoolVar(&sf.splice, "splice", true, "send large reads on plain connections from the page cache to the socket with splice(2), without copying them; false reads them into buffers")
	fs.StringVar(&sf.metrics, "metrics", defaultMetricsAddr, "serve Prometheus /metrics on HOST:PORT ('off' disables)")
	fs.StringVar(&sf.metricsWeb, "metrics-web-config", "", "TLS and basic auth for --metrics: a Prometheus web config file, as node_exporter's --web.config.file")
	sf.socketMode = defaultSocketMode
	fs.Var(&sf.socketMode, "socket-mode", "permissions of the --socket file (octal)")
	var tf tlsFlags
	tf.register(fs)
	fs.StringVar(&sf.flushBaseline, "flush-baseline", "", "benchmark only: 'per-segment' syncs once per table line, as dm did before Linux 6.11")
	fs.StringVar(&sf.cpuProfile, "cpuprofile", "", "write a Go CPU profile of the whole run to this file")
	fs.StringVar(&sf.tables, "tables", "", "serve every NAME.table in DIR as export NAME")
	fs.DurationVar(&sf.stopTimeout, "shutdown-timeout", 30*time.Second, "on SIGINT or SIGTERM, wait this long for the requests in flight, then as long for the devices' syncs; exit 1 naming the devices whose syncs did not return")
	fs.StringVar(&sf.control, "control", defaultControl, "the control socket for reload, suspend, resume, ... ('off' disables)")
	var df discardFlags
	df.register(fs)
	mergeRate := rate(snapshot.DefaultMergeRate)
	fs.Var(&mergeRate, "merge-rate", "the most bytes per second each snapshot-merge device copies back to its origin (with K, M, G suffix; 0: no limit)")
	var lf limitFlags
	lf.register(fs)
	var procs procsFlag
	procs.register(fs)
	var rf remoteFlags
	rf.register(fs)
	if err := fs.Parse(args); err != nil {
		return err
	}
	if err := rf.check(); err != nil {
		return err
	}
	if sf.cpuProfile != "" {
		stop, err := startCPUProfile(sf.cpuProfile)
		if err != nil {
			return err
		}
		defer stop()
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, nil))
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGINT, syscall.SIGTERM)

	specs := fs.Args()
	demo := len(specs) == 0 && sf.tables == ""
	if demo {
		spec, err := makeDemo("demo")
		if err != nil {
			return fmt.Errorf("demo: %w", err)
		}
		specs = []string{spec}
	}

	// The server exists before the tables, so that a panic in device code
	// while they load (a snapshot reading its COW store) is logged and
	// counted like any other.
	srv := &nbdtarget.Server{Logger: log, NoSplice: !sf.splice}
	lf.apply(srv)
	procs.apply(srv)
	flusher := flush.New()
	discarder := discard.New()
	flusher.OnPanic, discarder.OnPanic = srv.Panicked, srv.Panicked
	snapshot.Configure(snapshot.Config{MergeRate: int64(mergeRate), OnPanic: srv.Panicked, Logger: log})
	df.apply(discarder)
	remotes := rf.scheme(log, srv.Panicked)
	pool := &backing.Pool{ReadOnly: sf.readOnly, NoHoleMap: !sf.holeMap, Wrap: flusher.Track, Forget: discarder.Forget, Schemes: []backing.Scheme{remotes, rf.rbdScheme()}}
	// Closing the devices syncs them; after a shutdown sync that did not
	// return, the exit closes them instead, without waiting for it again.
	closeDevices := true
	defer func() {
		if closeDevices {
			pool.Close()
		}
	}()

	defs, err := exportDefs(specs, sf.tables)
	if err != nil {
		return err
	}
	newDevice := func(name string, t *table.Table) *mapped.Device {
		d := mapped.New(name, t, flusher, discarder)
		d.PerSegmentFlush = sf.flushBaseline == "per-segment"
		return d
	}
	devs, err := table.ParseSet(defs, pool, newDevice)
	if err != nil {
		return err
	}
	// The devices served at the end, after any create and remove, are
	// closed at the end.
	defer func() {
		if closeDevices {
			for _, x := range srv.ExportList() {
				x.Dev.Close()
			}
		}
	}()
	exports := make([]*nbdtarget.Export, len(devs))
	for i, d := range devs {
		exports[i] = &nbdtarget.Export{
			Name:        defs[i].Name,
			Description: lf.descriptions[defs[i].Name],
			Dev:         d,
			ReadOnly:    sf.readOnly,
		}
		log.Info("export", "name", defs[i].Name, "table", defs[i].File, "bytes", d.Size(), "segments", len(d.Table().Lines))
	}

	// No request runs yet (and srv.Stats would fix srv's exports before
	// they are set).
	limitMemory(log, int64(lf.memory), func() int64 { return 0 })

	srv.Exports = exports
	certs, err := tf.apply(srv, exports)
	if err != nil {
		return err
	}
	ls, err := serveListeners(sf)
	if err != nil {
		return err
	}
	explicit := false
	fs.Visit(func(f *flag.Flag) { explicit = explicit || f.Name == "control" })
	ctl, stopControl, err := startControl(sf.control, explicit, ls.control, log, devs, pool, srv, func(name string, t *table.Table) (*mapped.Device, error) {
		d := newDevice(name, t)
		x := &nbdtarget.Export{Name: name, Description: lf.descriptions[name], Dev: d, ReadOnly: sf.readOnly, Access: tf.access(name)}
		if err := srv.AddExport(x); err != nil {
			return nil, err
		}
		log.Info("export", "name", name, "bytes", d.Size(), "segments", len(t.Lines))
		return d, nil
	})
	if err != nil {
		return err
	}
	ctl.Changed = func() {
		limitMemory(log, int64(lf.memory), func() int64 { return srv.Stats().MemoryInUse })
	}
	defer stopControl()
	var onHUP []func()
	if certs != nil {
		onHUP = append(onHUP, func() { reloadCerts(certs, log) })
	}
	if sf.tables != "" {
		td := newTablesDir(sf.tables, defs, ctl, log)
		onHUP = append(onHUP, td.rescan)
	}
	if len(onHUP) > 0 {
		defer handleHUP(onHUP)()
	}
	stopMetrics, err := startMetrics(sf.metrics, sf.metricsWeb, ls.metrics, log, srv, flusher, discarder, remotes, statusRoutes(srv.ExportList, flusher, remotes))
	if err != nil {
		return err
	}
	defer stopMetrics()
	errc := make(chan error, len(ls.nbd))
	for _, l := range ls.nbd {
		log.Info("listening", "addr", l.Addr().String())
		go func() { errc <- srv.Serve(l) }()
	}
	if demo {
		printDemoHelp(os.Stdout, ls.nbd[0].Addr(), exports[0], defs[0].File)
	}
	systemd := notifyReady(log, srv)

	// A listener that fails stops the server with its reason and a
	// non-zero exit, after the same orderly shutdown as a signal.
	var failed error
	select {
	case s := <-sig:
		log.Info("shutting down", "signal", s.String())
	case failed = <-errc:
		log.Error("listener failed: shutting down", "err", failed)
	}
	systemd.stopping()
	held := shutdown(srv, sf.stopTimeout, log)
	ctx, cancel := context.WithTimeout(context.Background(), sf.stopTimeout)
	defer cancel()
	synced := pool.Sync(ctx)
	closeDevices = !errors.Is(synced, context.DeadlineExceeded)
	logStats(log, flusher, discarder)
	logRemoteStats(log, remotes)
	return errors.Join(synced, held, failed)
}

// shutdown stops srv, waiting up to timeout for the requests in flight.
// A request held by a suspended device would wait for a resume that no one
// will send now: after timeout the suspended devices are closed, which
// fails their held requests, and shutdown returns an error naming them.
// It waits for the connections to end at most timeout more: a request
// stuck in a device below is left to the exit (the final sync, bounded
// the same way, names that device).
func shutdown(srv *nbdtarget.Server, timeout time.Duration, log *slog.Logger) error {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- srv.Shutdown(ctx) }()
	select {
	case err := <-done:
		if err != nil {
			log.Error("shutdown", "err", err)
		}
		return nil
	case <-ctx.Done():
	}
	var names []string
	for _, x := range srv.ExportList() {
		if in := x.Dev.Info(); in.Suspended {
			log.Error("shutdown: failing the requests a suspended device holds", "device", in.Name)
			names = append(names, in.Name)
			x.Dev.Close()
		}
	}
	select {
	case err := <-done:
		if err != nil {
			log.Error("shutdown", "err", err)
		}
	case <-time.After(timeout):
		log.Error("shutdown: connections still running requests; exiting without them")
	}
	if names == nil {
		return nil
	}
	return fmt.Errorf("shutdown: requests held by suspended device %s failed: no resume came within --shutdown-timeout", strings.Join(names, ", "))
}

// handleHUP runs every action on each SIGHUP, in order, until stop is
// called. Without it SIGHUP would end serve, as it ends any program that
// does not handle it.
func handleHUP(actions []func()) (stop func()) {
	hup := make(chan os.Signal, 1)
	signal.Notify(hup, syscall.SIGHUP)
	done := make(chan struct{})
	go func() {
		for {
			select {
			case <-hup:
				for _, act := range actions {
					act()
				}
			case <-done:
				return
			}
		}
	}()
	return func() { signal.Stop(hup); close(done) }
}

func startCPUProfile(path string) (stop func(), err error) {
	f, err := os.Create(path)
	if err != nil {
		return nil, err
	}
	if err := pprof.StartCPUProfile(f); err != nil {
		f.Close()
		return nil, err
	}
	return func() { pprof.StopCPUProfile(); f.Close() }, nil
}

// listen opens the unix socket and/or TCP listener; TCP binds loopback
// unless told otherwise.
func listen(sf serveFlags) ([]net.Listener, error) {
	var ls []net.Listener
	if sf.socket != "" {
		l, err := listenUnix(sf.socket, sf.socketMode)
		if err != nil {
			return nil, err
		}
		ls = append(ls, l)
	}
	if sf.listen == "" && sf.socket == "" {
		sf.listen = "127.0.0.1:10809"
	}
	if sf.listen != "" {
		l, err := net.Listen("tcp", sf.listen)
		if err != nil {
			for _, l := range ls {
				l.Close()
			}
			return nil, err
		}
		ls = append(ls, l)
	}
	return ls, nil
}

func logStats(log *slog.Logger, f *flush.Engine, d *discard.Engine) {
	logFlushStats(log, f)
	logDiscardStats(log, d)
	st := snapshot.ReadStats()
	log.Info("snapshot stats", "commits", st.Commits, "exceptions", st.Exceptions, "max_batch", st.MaxBatch,
		"merged_chunks", st.MergedChunks, "merges_done", st.MergesDone, "merge_failures", st.MergeFail, "handovers", st.Handovers)
}
