// Package control is nbdmapper's control socket: dmsetup's lifecycle
// commands (create, remove, reload, suspend, resume, table, status, info,
// ls, message) for the mapped devices of a running server. It sits beside the data flow:
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
	"io"
	"log/slog"
	"net"
	"os"
	"slices"
	"strings"
	"sync"
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
	Force    bool     `json:"force,omitempty"`    // remove: even with clients connected
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
	ErrExists     = errors.New("a device of that name exists")
	ErrInUse      = errors.New("another device is stacked on it")
	ErrNoCreate   = errors.New("this server cannot create or remove devices")
)

// Server answers requests for a set of mapped devices.
type Server struct {
	// Devices are the server's mapped devices, by name. Once Serve is
	// called only create and remove change it.
	Devices map[string]*mapped.Device
	// Create makes the device NAME with table t and serves it; Remove
	// stops serving it (force: even with clients connected, which are
	// disconnected once their requests in flight are answered) and closes
	// it. Once Remove has closed the device its name is gone, even if it
	// returns the close's error. Without them, create and remove are
	// refused.
	Create func(name string, t *table.Table) (*mapped.Device, error)
	Remove func(name string, force bool) error
	// Open opens the device paths of reloaded tables (the serve command's
	// backing.Pool, so each file is opened once).
	Open table.Opener
	// Clients, if set, reports how many clients have NAME open, for info.
	Clients func(name string) int
	Logger  *slog.Logger
	// Timeout is how long a client has to send its request, and then to
	// take the answer, before its connection is closed (default
	// DefaultTimeout).
	Timeout time.Duration
	// Changed, if set, is called after each create, remove, reload,
	// resume and clear: the tables the server holds may have changed
	// (serve sets the Go memory limit again).
	Changed func()

	mu sync.RWMutex // Devices
	// topo serialises the requests that change which device is built on
	// which (create, reload, remove), each from its stacking checks to its
	// change: two reloads that each pass the check against the other's
	// active table could otherwise stack two devices on each other. It is
	// held while a remove waits for its clients, s.mu is not, so that ls,
	// info and the resume that releases a suspended device's held
	// requests are still answered.
	topo sync.Mutex
}

// maxRequest bounds a control request.
const maxRequest = 1 << 20

// DefaultTimeout is Server.Timeout's default.
const DefaultTimeout = 30 * time.Second

func (s *Server) timeout() time.Duration {
	if s.Timeout > 0 {
		return s.Timeout
	}
	return DefaultTimeout
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
	c.SetReadDeadline(time.Now().Add(s.timeout()))
	var req Request
	if err := json.NewDecoder(bufio.NewReader(io.LimitReader(c, maxRequest))).Decode(&req); err != nil {
		return
	}
	c.SetReadDeadline(time.Time{})
	out, err := s.Do(req)
	resp := Response{Out: out}
	if err != nil {
		resp.Error = err.Error()
	}
	if s.Logger != nil {
		s.Logger.Info("control", "op", req.Op, "name", req.Name, "file", req.File, "err", err)
	}
	c.SetWriteDeadline(time.Now().Add(s.timeout()))
	json.NewEncoder(c).Encode(resp)
}

// Do carries out one request.
func (s *Server) Do(req Request) (string, error) {
	switch req.Op {
	case "create", "remove", "reload", "resume", "clear":
		if s.Changed != nil {
			defer s.Changed()
		}
	}
	switch req.Op {
	case "ls":
		return s.ls(), nil
	case "create":
		return "", s.create(req.Name, req.File)
	case "remove":
		return "", s.remove(req.Name, req.Force)
	}
	d := s.Device(req.Name)
	if d == nil {
		return "", fmt.Errorf("%w: %q", ErrNoDevice, req.Name)
	}
	switch req.Op {
	case "reload":
		return "", s.reload(req.Name, d, req.File)
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

// Device is the device name, or nil.
func (s *Server) Device(name string) *mapped.Device {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.Devices[name]
}

// create parses file completely and makes it the new device name.
func (s *Server) create(name, file string) error {
	if s.Create == nil {
		return ErrNoCreate
	}
	if name == "" || strings.ContainsAny(name, "/ \t") {
		return fmt.Errorf("bad device name %q", name)
	}
	s.topo.Lock()
	defer s.topo.Unlock()
	if s.Device(name) != nil {
		return fmt.Errorf("%w: %q", ErrExists, name)
	}
	t, err := s.parse(file, nil)
	if err != nil {
		return err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.Devices[name] != nil {
		t.Close()
		return fmt.Errorf("%w: %q", ErrExists, name)
	}
	d, err := s.Create(name, t)
	if err != nil {
		t.Close()
		return err
	}
	s.Devices[name] = d
	return nil
}

// remove stops serving and closes the device name, unless another device
// is stacked on it (dm's "device busy").
func (s *Server) remove(name string, force bool) error {
	if s.Remove == nil {
		return ErrNoCreate
	}
	s.topo.Lock()
	defer s.topo.Unlock()
	if err := s.removable(name); err != nil {
		return err
	}
	d := s.Device(name)
	// Without s.mu: Remove waits for the device's clients, and a client's
	// request held by a suspend goes on only once a resume comes.
	err := s.Remove(name, force)
	if err != nil && !d.Closed() {
		return err // still served: refused, or the clients did not go
	}
	// Closed, even if the close failed (a disk that could not be synced
	// on its last release): the name goes with it, or every later
	// request would find a device that is neither served nor usable.
	s.mu.Lock()
	delete(s.Devices, name)
	s.mu.Unlock()
	if err != nil {
		return fmt.Errorf("%s: removed, but closing it failed: %w", name, err)
	}
	return nil
}

// removable says why the device name cannot be removed, if it cannot.
func (s *Server) removable(name string) error {
	s.mu.RLock()
	defer s.mu.RUnlock()
	d := s.Devices[name]
	if d == nil {
		return fmt.Errorf("%w: %q", ErrNoDevice, name)
	}
	for other, od := range s.Devices {
		if od != d && s.stacksOn(od, d) {
			return fmt.Errorf("%s: %w: /dev/mapper/%s", name, ErrInUse, other)
		}
	}
	return nil
}

func (s *Server) ls() string {
	s.mu.RLock()
	defer s.mu.RUnlock()
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
func (s *Server) reload(name string, d *mapped.Device, file string) error {
	s.topo.Lock()
	defer s.topo.Unlock()
	if s.Device(name) != d {
		return fmt.Errorf("%w: %q", ErrNoDevice, name) // removed meanwhile
	}
	t, err := s.parse(file, d)
	if err != nil {
		return err
	}
	d.Load(t)
	return nil
}

// parse reads the table in file for the device self (nil for a new one).
func (s *Server) parse(file string, self *mapped.Device) (*table.Table, error) {
	f, err := os.Open(file)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	return table.Parse(file, f, opener{s, self})
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
	o.s.mu.RLock()
	defer o.s.mu.RUnlock()
	d := o.s.Devices[dm]
	if d == nil {
		return nil, fmt.Errorf("%w: %q", ErrNoDevice, dm)
	}
	if o.self != nil && o.s.stacksOn(d, o.self) {
		return nil, fmt.Errorf("%w: %s", ErrStacked, name)
	}
	return d, nil
}

// Release gives a device back to Open, unless it is one of the server's
// mapped devices, which remove closes.
func (o opener) Release(d backing.Device) error {
	if _, ok := d.(*mapped.Device); ok {
		return nil
	}
	if r, ok := o.s.Open.(table.Releaser); ok {
		return r.Release(d)
	}
	return nil
}

// stacksOn reports whether d is self or is built, at any depth, on self:
// whether its table, active or loaded, names /dev/mapper/<self> or a
// device that does, read from the tables' arguments: the stacking graph
// is not kept anywhere else yet. Each device is looked at once, so that a
// stack of diamonds costs its size, not its number of paths. s.mu must be
// held.
func (s *Server) stacksOn(d, self *mapped.Device) bool {
	seen := make(map[*mapped.Device]bool)
	var on func(d *mapped.Device) bool
	on = func(d *mapped.Device) bool {
		if d == self {
			return true
		}
		if seen[d] {
			return false // looked at already, and not on self
		}
		seen[d] = true
		for _, t := range []*table.Table{d.Table(), d.InactiveTable()} {
			if t == nil {
				continue
			}
			for _, l := range t.Lines {
				for _, a := range l.Target.Args() {
					name, ok := strings.CutPrefix(a, table.MapperPrefix)
					if below := s.Devices[name]; ok && below != nil && on(below) {
						return true
					}
				}
			}
		}
		return false
	}
	return on(d)
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
