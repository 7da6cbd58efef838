package main

import (
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"

	"github.com/nbdmapper/nbdmapper/control"
	"github.com/nbdmapper/nbdmapper/mapped"
	"github.com/nbdmapper/nbdmapper/nbdtarget"
	"github.com/nbdmapper/nbdmapper/table"
)

// defaultControl is where serve puts its control socket, and where the
// lifecycle commands look for it, unless --control says otherwise.
const defaultControl = "/run/nbdmapper/control"

// startControl makes the control server for devs and serves it on passed,
// the control socket systemd passed, if any, or else at path ('off': none;
// SIGHUP's rescan of --tables still uses the server). With the default
// path, a place that cannot be had (not root, or another server there) is
// logged and skipped, so that serve runs anywhere; a path given with
// --control must work.
//
// create makes and serves a device for `nbdmapper create`; remove takes one
// out of srv and closes it.
func startControl(path string, explicit bool, passed net.Listener, log *slog.Logger, devs []*mapped.Device, open table.Opener, srv *nbdtarget.Server,
	create func(name string, t *table.Table) (*mapped.Device, error)) (ctl *control.Server, stop func(), err error) {
	byName := make(map[string]*mapped.Device, len(devs))
	for _, d := range devs {
		byName[d.DeviceName()] = d
	}
	remove := func(name string, force bool) error {
		x, err := srv.RemoveExport(name, force)
		if err != nil {
			return err
		}
		return x.Dev.Close()
	}
	ctl = &control.Server{Devices: byName, Open: open, Logger: log, Create: create, Remove: remove, Clients: func(name string) int {
		for _, x := range srv.Stats().Exports {
			if x.Name == name {
				return int(x.Connections)
			}
		}
		return 0
	}}
	serve := func(l net.Listener, cleanup func()) func() {
		done := make(chan struct{})
		go func() { defer close(done); ctl.Serve(l) }()
		return func() { l.Close(); <-done; cleanup() }
	}
	none := func() {}
	if passed != nil {
		if explicit {
			passed.Close()
			return nil, nil, errors.New("--control cannot be used with a control socket passed by systemd")
		}
		log.Info("control", "socket", passed.Addr().String(), "from", "systemd")
		return ctl, serve(passed, none), nil // systemd owns the socket file
	}
	if path == "off" {
		return ctl, none, nil
	}
	if !explicit {
		if c, err := net.Dial("unix", path); err == nil {
			c.Close()
			log.Warn("control socket in use by another server: serving none; give --control PATH", "path", path)
			return ctl, none, nil
		}
	}
	l, err := control.Listen(path)
	if err != nil {
		if !explicit {
			log.Warn("no control socket: give --control PATH for reload, suspend and resume", "path", path, "err", err)
			return ctl, none, nil
		}
		return nil, nil, fmt.Errorf("--control: %w", err)
	}
	log.Info("control", "socket", path)
	return ctl, serve(l, func() { os.Remove(path) }), nil
}

// runLifecycle is the client side of dmsetup's lifecycle commands:
//
//	nbdmapper create NAME TABLE_FILE     make and serve the device NAME
//	nbdmapper remove [--force] NAME      stop serving NAME and close it
//	nbdmapper reload NAME TABLE_FILE     load TABLE_FILE as NAME's inactive table
//	nbdmapper suspend NAME               drain, flush and hold NAME's I/O
//	nbdmapper resume NAME                activate the inactive table, release I/O
//	nbdmapper clear NAME                 drop the inactive table
//	nbdmapper table [--inactive] NAME    print NAME's table
//	nbdmapper info NAME                  print NAME's state
//	nbdmapper ls                         list the devices
//	nbdmapper message NAME SECTOR TEXT   send a target a message
func runLifecycle(op string) func(args []string) error {
	return func(args []string) error {
		fs := newFlagSet(op)
		path := fs.String("control", defaultControl, "the server's control socket (serve --control)")
		inactive, force := false, false
		switch op {
		case "table":
			fs.BoolVar(&inactive, "inactive", false, "print the inactive table")
		case "remove":
			fs.BoolVar(&force, "force", false, "remove even with clients connected: they are disconnected once their requests are answered")
		}
		if err := fs.Parse(args); err != nil {
			return err
		}
		req := control.Request{Op: op, Inactive: inactive, Force: force}
		want := 1 // arguments: NAME, mostly
		switch op {
		case "ls":
			want = 0
		case "reload", "create":
			want = 2
		case "message":
			want = 3
		}
		if fs.NArg() != want {
			return fmt.Errorf("%s takes %d argument(s)\n%s", op, want, usage)
		}
		if want > 0 {
			req.Name = fs.Arg(0)
		}
		switch op {
		case "reload", "create":
			abs, err := filepath.Abs(fs.Arg(1))
			if err != nil {
				return err
			}
			req.File = abs
		case "message":
			req.Args = fs.Args()[1:]
		}
		out, err := control.Call(*path, req)
		fmt.Print(out)
		if err != nil && errors.Is(err, os.ErrNotExist) {
			return fmt.Errorf("%w (is nbdmapper serve running with --control %s?)", err, *path)
		}
		return err
	}
}
