package main

// Running under systemd: serve takes its listening sockets from the service
// manager (socket activation, sd_listen_fds) and reports its state over the
// notify socket (sd_notify), both through coreos/go-systemd rather than
// hand-written protocol code. Neither needs systemd as PID 1:
// systemd-socket-activate passes sockets the same way, and NOTIFY_SOCKET
// may be any unixgram socket. See docs/systemd.md and deploy/systemd/.

import (
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"strings"
	"time"

	"github.com/coreos/go-systemd/v22/activation"
	"github.com/coreos/go-systemd/v22/daemon"

	"github.com/nbdmapper/nbdmapper/nbdtarget"
)

// FileDescriptorName= (LISTEN_FDNAMES entries) of passed sockets that are
// not NBD: metricsFDName serves /metrics, /status and /table, controlFDName
// is the control socket. Every other passed socket serves NBD.
const (
	metricsFDName = "metrics"
	controlFDName = "control"
)

// statusEvery is how often the STATUS= line is refreshed (it is sent only
// when it changed).
const statusEvery = 5 * time.Second

var errSocketConflict = errors.New("--socket and --listen cannot be used with sockets passed by systemd")

// listeners are what serve listens on.
type listeners struct {
	nbd     []net.Listener
	metrics net.Listener // passed by systemd, or nil
	control net.Listener // passed by systemd, or nil
}

func (ls listeners) close() { closeAll(append(ls.nbd, ls.metrics, ls.control)) }

// serveListeners returns the NBD listeners and any metrics or control
// listener systemd passed. Sockets passed by systemd (LISTEN_FDS) win;
// without NBD sockets among them, serve listens on --socket/--listen
// itself.
func serveListeners(sf serveFlags) (listeners, error) {
	ls, err := activatedListeners()
	if err != nil {
		return listeners{}, err
	}
	if len(ls.nbd) > 0 {
		if sf.socket != "" || sf.listen != "" {
			ls.close()
			return listeners{}, errSocketConflict
		}
		return ls, nil
	}
	if ls.nbd, err = listen(sf); err != nil {
		ls.close()
		return listeners{}, err
	}
	return ls, nil
}

// activatedListeners turns the sockets systemd passed into listeners,
// sorted by their names. It unsets LISTEN_FDS, LISTEN_PID and
// LISTEN_FDNAMES, so they are taken once.
func activatedListeners() (ls listeners, err error) {
	files := activation.Files(true)
	defer func() {
		for _, f := range files {
			f.Close() // the listeners hold dups
		}
	}()
	for _, f := range files {
		name, fd := f.Name(), f.Fd()
		l, err := net.FileListener(f)
		one := map[string]*net.Listener{metricsFDName: &ls.metrics, controlFDName: &ls.control}[name]
		if err == nil && one != nil && *one != nil {
			l.Close()
			err = fmt.Errorf("more than one socket named %q", name)
		}
		if err != nil {
			ls.close()
			return listeners{}, fmt.Errorf("socket %q (fd %d) from systemd: %w", name, fd, err)
		}
		if one != nil {
			*one = l
		} else {
			ls.nbd = append(ls.nbd, l)
		}
	}
	return ls, nil
}

func closeAll(ls []net.Listener) {
	for _, l := range ls {
		if l != nil {
			l.Close()
		}
	}
}

// notifier tells the service manager how serve is doing: READY=1 with a
// STATUS= line once serving, the STATUS= line again when the number of
// connections changes, WATCHDOG=1 at half the watchdog interval when the
// unit has WatchdogSec=, and STOPPING=1 on shutdown. Without NOTIFY_SOCKET
// it does nothing.
type notifier struct {
	log  *slog.Logger
	srv  *nbdtarget.Server
	stop chan struct{}
	done chan struct{}
}

// notifyReady sends READY=1 and starts the status and watchdog loop. Call
// it once every table is loaded and every listener is being served.
func notifyReady(log *slog.Logger, srv *nbdtarget.Server) *notifier {
	n := &notifier{log: log, srv: srv}
	if os.Getenv("NOTIFY_SOCKET") == "" {
		return n
	}
	watchdog, err := daemon.SdWatchdogEnabled(true)
	if err != nil {
		log.Error("systemd watchdog", "err", err)
	}
	status := n.status()
	n.send(daemon.SdNotifyReady + "\nSTATUS=" + status)
	n.stop, n.done = make(chan struct{}), make(chan struct{})
	go n.loop(watchdog, status)
	return n
}

func (n *notifier) loop(watchdog time.Duration, status string) {
	defer close(n.done)
	var ping <-chan time.Time
	if watchdog > 0 {
		t := time.NewTicker(watchdog / 2)
		defer t.Stop()
		ping = t.C
		n.log.Info("systemd watchdog", "interval", watchdog)
	}
	refresh := time.NewTicker(statusEvery)
	defer refresh.Stop()
	for {
		select {
		case <-n.stop:
			return
		case <-ping:
			n.send(daemon.SdNotifyWatchdog)
		case <-refresh.C:
			if s := n.status(); s != status {
				status = s
				n.send("STATUS=" + s)
			}
		}
	}
}

// stopping sends STOPPING=1 and ends the loop; the watchdog does not
// apply while a unit stops.
func (n *notifier) stopping() {
	if n.stop == nil {
		return
	}
	close(n.stop)
	<-n.done
	n.send(daemon.SdNotifyStopping + "\nSTATUS=shutting down")
}

// statusNames is how many export names the STATUS= line lists.
const statusNames = 8

// status is the STATUS= text: `2 exports (data, snap); 3 connections`,
// with at most statusNames names and `+N more` after them.
func (n *notifier) status() string {
	st := n.srv.Stats()
	var names []string
	var conns int64
	for _, x := range st.Exports {
		if len(names) < statusNames {
			names = append(names, x.Name)
		}
		conns += x.Connections
	}
	if more := len(st.Exports) - len(names); more > 0 {
		names = append(names, fmt.Sprintf("+%d more", more))
	}
	return fmt.Sprintf("%d exports (%s); %d connections", len(st.Exports), strings.Join(names, ", "), conns)
}

func (n *notifier) send(state string) {
	if _, err := daemon.SdNotify(false, state); err != nil {
		n.log.Error("sd_notify", "state", state, "err", err)
	}
}
