// Package control is nbdmapper's control socket: dmsetup's lifecycle
// commands (reload, suspend, resume, table, status, info, ls, message) for
// the mapped devices of a running server. It sits beside the data flow:
//
//	nbdmapper reload|suspend|... --> control socket --> mapped.Device
//
// The socket is a unix socket created owner-only (mode 0600): whoever can
// reach it can change every device. Each connection carries one request
// and one response, each a line of JSON.
package control

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/nbdmapper/nbdmapper/backing"
	"github.com/nbdmapper/nbdmapper/mapped"
	"github.com/nbdmapper/nbdmapper/table"
)

// Request is one command. File is an absolute path, read by the server
// (device paths inside a table resolve as for `nbdmapper serve`).
type Request struct {
	Op       string   `json:"op"`
	Name     string   `json:"name,omitempty"`
	File     string   `json:"file,omitempty"`
	Inactive bool     `json:"inactive,omitempty"` // table: the inactive table
	Args     []string `json:"args,omitempty"`     // message: sector and text
}

// Response is the answer: the text dmsetup would print, or an error.
type Response struct {
	Out   string `json:"out,omitempty"`
	Error string `json:"error,omitempty"`
}

// Errors a client can act on.
var (
	ErrNoDevice   = errors.New("no such device")
	ErrUnknownOp  = errors.New("unknown command")
	ErrNoMessages = errors.New("target takes no messages")
	ErrStacked    = errors.New("the table would stack the device on itself")
)

// Server answers requests for a set of mapped devices.
type Server struct {
	// Devices are the server's mapped devices, by name; fixed once Serve
	// is called.
	Devices map[string]*mapped.Device
	// Open opens the device paths of reloaded tables (the serve command's
	// backing.Pool, so each file is opened once).
	Open table.Opener
	// Clients, if set, reports how many clients have NAME open, for info.
	Clients func(name string) int
	Logger  *slog.Logger
}

// Listen creates the control socket at path, owner-only, replacing a stale
// socket file.
func Listen(path string) (net.Listener, error) {
	if err := os.MkdirAll(dirOf(path), 0o700); err != nil {
		return nil, err
	}
	os.Remove(path)
	old := syscall.Umask(0o177)
	l, err := net.Listen("unix", path)
	syscall.Umask(old)
	if err != nil {
		return nil, err
	}
	return l, os.Chmod(path, 0o600)
}

func dirOf(path string) string {
	if i := strings.LastIndexByte(path, '/'); i > 0 {
		return path[:i]
	}
	return "."
}

// Serve answers requests on l until it is closed.
func (s *Server) Serve(l net.Listener) error {
	for {
		c, err := l.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return nil
			}
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				time.Sleep(10 * time.Millisecond)
				continue
			}
			return err
		}
		go s.serveConn(c)
	}
}

func (s *Server) serveConn(c net.Conn) {
	defer c.Close()
	var req Request
	if err := json.NewDecoder(bufio.NewReader(c)).Decode(&req); err != nil {
		return
	}
	out, err := s.Do(req)
	resp := Response{Out: out}
	if err != nil {
		resp.Error = err.Error()
	}
	if s.Logger != nil {
		s.Logger.Info("control", "op", req.Op, "name", req.Name, "file", req.File, "err", err)
	}
	json.NewEncoder(c).Encode(resp)
}

// Do carries out one request.
func (s *Server) Do(req Request) (string, error) {
	if req.Op == "ls" {
		return s.ls(), nil
	}
	d := s.Devices[req.Name]
	if d == nil {
		return "", fmt.Errorf("%w: %q", ErrNoDevice, req.Name)
	}
	switch req.Op {
	case "reload":
		return "", s.reload(d, req.File)
	case "suspend":
		return "", d.Suspend()
	case "resume":
		_, err := d.Resume()
		return "", err
	case "clear":
		d.ClearInactive()
		return "", nil
	case "table":
		t := d.Table()
		if req.Inactive {
			if t = d.InactiveTable(); t == nil {
				return "", nil
			}
		}
		return t.String(), nil
	case "status":
		return d.Table().Status(), nil
	case "info":
		return s.info(d), nil
	case "message":
		return "", fmt.Errorf("%s: %w", req.Name, ErrNoMessages)
	}
	return "", fmt.Errorf("%w %q", ErrUnknownOp, req.Op)
}

func (s *Server) ls() string {
	names := make([]string, 0, len(s.Devices))
	for n := range s.Devices {
		names = append(names, n)
	}
	slices.Sort(names)
	var b strings.Builder
	for _, n := range names {
		fmt.Fprintf(&b, "%s\t(%d bytes)\n", n, s.Devices[n].Size())
	}
	return b.String()
}

// info prints what `dmsetup info` does, with nbdmapper's lifecycle counts.
func (s *Server) info(d *mapped.Device) string {
	in := d.Info()
	state := "ACTIVE"
	if in.Suspended {
		state = "SUSPENDED"
	}
	tables := "LIVE"
	if in.InactiveTable {
		tables = "LIVE & INACTIVE"
	}
	open := 0
	if s.Clients != nil {
		open = s.Clients(in.Name)
	}
	return fmt.Sprintf("Name:              %s\nState:             %s\nTables present:    %s\nOpen count:        %d\nNumber of targets: %d\nSize:              %d bytes\n"+
		"Suspends:          %d\nResumes:           %d\nReloads:           %d\nRequests held:     %d\nSuspended for:     %.3fs\n",
		in.Name, state, tables, open, len(d.Table().Lines), in.Size,
		in.Suspends, in.Resumes, in.Reloads, in.Held, in.SuspendedTime.Seconds())
}

// reload parses file completely (every device opened, every range
// checked) and loads it as d's inactive table. /dev/mapper/NAME names
// another device of the server; a table that would make d stack on itself
// is refused.
func (s *Server) reload(d *mapped.Device, file string) error {
	f, err := os.Open(file)
	if err != nil {
		return err
	}
	defer f.Close()
	t, err := table.Parse(file, f, opener{s, d})
	if err != nil {
		return err
	}
	d.Load(t)
	return nil
}

// opener resolves a reloaded table's devices: /dev/mapper/NAME against the
// server's devices, anything else through Open.
type opener struct {
	s    *Server
	self *mapped.Device
}

func (o opener) Open(name string) (backing.Device, error) {
	dm, ok := strings.CutPrefix(name, table.MapperPrefix)
	if !ok {
		return o.s.Open.Open(name)
	}
	d := o.s.Devices[dm]
	if d == nil {
		return nil, fmt.Errorf("%w: %q", ErrNoDevice, dm)
	}
	if stacksOn(d, o.self) {
		return nil, fmt.Errorf("%w: %s", ErrStacked, name)
	}
	return d, nil
}

// stacksOn reports whether d is self or is built, at any depth, on self.
func stacksOn(d, self *mapped.Device) bool {
	if d == self {
		return true
	}
	for _, below := range d.Table().Devices() {
		if m, ok := below.(*mapped.Device); ok && stacksOn(m, self) {
			return true
		}
	}
	return false
}

// Call sends req to the control socket at path and returns the server's
// output, or its error.
func Call(path string, req Request) (string, error) {
	c, err := net.Dial("unix", path)
	if err != nil {
		return "", fmt.Errorf("control socket: %w", err)
	}
	defer c.Close()
	if err := json.NewEncoder(c).Encode(req); err != nil {
		return "", err
	}
	var resp Response
	if err := json.NewDecoder(c).Decode(&resp); err != nil {
		return "", fmt.Errorf("control socket: %w", err)
	}
	if resp.Error != "" {
		return resp.Out, errors.New(resp.Error)
	}
	return resp.Out, nil
}
