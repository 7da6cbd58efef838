package control_test

import (
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/nbdmapper/nbdmapper/backing"
	"github.com/nbdmapper/nbdmapper/control"
	"github.com/nbdmapper/nbdmapper/discard"
	"github.com/nbdmapper/nbdmapper/flush"
	"github.com/nbdmapper/nbdmapper/internal/testing/nbdtest"
	"github.com/nbdmapper/nbdmapper/internal/testing/sparse"
	"github.com/nbdmapper/nbdmapper/mapped"
	"github.com/nbdmapper/nbdmapper/table"
)

// gateOpener opens "gate" as disk once release is closed, after telling
// reached: it holds a parse between two of its lines.
type gateOpener struct {
	pool             *backing.Pool
	disk             string
	reached, release chan struct{}
}

func (g *gateOpener) Open(name string) (backing.Device, error) {
	if name == "gate" {
		close(g.reached)
		<-g.release
		name = g.disk
	}
	return g.pool.Open(name)
}

// topoRig is a control server (no socket) over devices x and y, each a
// linear table over one file, whose Remove waits for removing to be
// closed.
func topoRig(t *testing.T) (s *control.Server, g *gateOpener, dir string, removing, allow chan struct{}) {
	dir = t.TempDir()
	disk := sparse.Create(t, filepath.Join(dir, "disk.img"), 4<<20)
	pool := &backing.Pool{}
	t.Cleanup(func() { pool.Close() })
	f, d := flush.New(), discard.New()
	devs := map[string]*mapped.Device{}
	for _, n := range []string{"x", "y"} {
		tb, err := table.Parse(n, strings.NewReader("0 2048 linear "+disk+" 0\n"), pool)
		if err != nil {
			t.Fatal(err)
		}
		devs[n] = mapped.New(n, tb, f, d)
	}
	g = &gateOpener{pool: pool, disk: disk, reached: make(chan struct{}), release: make(chan struct{})}
	removing, allow = make(chan struct{}), make(chan struct{})
	s = &control.Server{Devices: devs, Open: g,
		Create: func(name string, tb *table.Table) (*mapped.Device, error) { return mapped.New(name, tb, f, d), nil },
		Remove: func(name string, force bool) error {
			close(removing)
			<-allow
			return devs[name].Close()
		},
	}
	return s, g, dir, removing, allow
}

func do(s *control.Server, req control.Request) chan error {
	c := make(chan error, 1)
	go func() { _, err := s.Do(req); c <- err }()
	return c
}

// Two reloads that would stack x on y and y on x are not both taken, even
// when each checks the other's table before the other is loaded: the
// second waits for the first and is refused.
func TestConcurrentReloadsDoNotStackOnEachOther(t *testing.T) {
	s, g, dir, _, _ := topoRig(t)
	xf := filepath.Join(dir, "x.table")
	yf := filepath.Join(dir, "y.table")
	os.WriteFile(xf, []byte("0 8 linear /dev/mapper/y 0\n8 8 linear gate 0\n"), 0o644)
	os.WriteFile(yf, []byte("0 16 linear /dev/mapper/x 0\n"), 0o644)
	xdone := do(s, control.Request{Op: "reload", Name: "x", File: xf})
	<-g.reached // x's parse has taken /dev/mapper/y
	ydone := do(s, control.Request{Op: "reload", Name: "y", File: yf})
	select {
	case err := <-ydone:
		t.Fatalf("reload y finished (%v) while reload x, which it would stack with, was still parsing", err)
	case <-time.After(100 * time.Millisecond): // long enough for a reload that does not wait to end
	}
	close(g.release)
	errX, errY := nbdtest.Recv(t, xdone, "reload x"), nbdtest.Recv(t, ydone, "reload y")
	if errX != nil || !errors.Is(errY, control.ErrStacked) {
		t.Fatalf("reload x: %v; reload y: %v, want %v", errX, errY, control.ErrStacked)
	}
}

// A remove that waits for its device's clients holds up no other request:
// ls and resume (which releases a suspended device's held requests, which
// the remove may be waiting for) are answered meanwhile.
func TestRemoveWaitingHoldsNoOneElse(t *testing.T) {
	s, _, _, removing, allow := topoRig(t)
	if _, err := s.Do(control.Request{Op: "suspend", Name: "x"}); err != nil {
		t.Fatal(err)
	}
	removed := do(s, control.Request{Op: "remove", Name: "x", Force: true})
	nbdtest.Recv(t, removing, "the remove to wait for the device's clients")
	if err := nbdtest.Recv(t, do(s, control.Request{Op: "ls"}), "ls while a remove waits"); err != nil {
		t.Fatal(err)
	}
	if err := nbdtest.Recv(t, do(s, control.Request{Op: "resume", Name: "x"}), "resume while a remove waits"); err != nil {
		t.Fatal(err)
	}
	close(allow)
	if err := nbdtest.Recv(t, removed, "the remove"); err != nil {
		t.Fatal(err)
	}
}

// A request that never ends is not read without bound: the server stops
// at its limit and closes the connection, and answers the next client.
func TestRequestTooLong(t *testing.T) {
	sock, _, _ := rig(t)
	c, err := net.Dial("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	go func() {
		c.Write([]byte(`{"op":"`))
		junk := make([]byte, 64<<10)
		for i := range junk {
			junk[i] = 'a'
		}
		for range 64 { // 4 MiB, past the limit
			if _, err := c.Write(junk); err != nil {
				return
			}
		}
	}()
	c.SetReadDeadline(time.Now().Add(nbdtest.Bound))
	if n, err := c.Read(make([]byte, 1)); err == nil || errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("a request past the limit: read %d bytes, %v; want the connection closed", n, err)
	}
	if out, err := control.Call(sock, control.Request{Op: "ls"}); err != nil || !strings.Contains(out, "base") {
		t.Fatalf("ls after it: %q, %v", out, err)
	}
}

// A client that connects and sends nothing is closed after Timeout, not
// kept for ever with a goroutine of the server's.
func TestIdleClientClosed(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "control")
	l, err := control.Listen(sock)
	if err != nil {
		t.Fatal(err)
	}
	srv := &control.Server{Devices: map[string]*mapped.Device{}, Timeout: 100 * time.Millisecond}
	go srv.Serve(l)
	t.Cleanup(func() { l.Close() })
	c, err := net.Dial("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetReadDeadline(time.Now().Add(nbdtest.Bound))
	if n, err := c.Read(make([]byte, 1)); err == nil || errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("an idle client: read %d bytes, %v; want the connection closed", n, err)
	}
}

// A remove whose close fails (the last release of the disk cannot sync
// it) reports the error, but the device is gone all the same: it was no
// longer served, so keeping its name would wedge it (ls listing it, create
// refusing it, suspend saying it is closed, remove saying it does not
// exist).
func TestRemoveWhoseCloseFailsFreesTheName(t *testing.T) {
	dir := t.TempDir()
	disk := sparse.Create(t, filepath.Join(dir, "disk.img"), 1<<20)
	var faulty []*backing.Faulty
	pool := &backing.Pool{Wrap: func(d backing.Device) backing.Device {
		f := backing.NewFaulty(d)
		faulty = append(faulty, f)
		return f
	}}
	t.Cleanup(func() { pool.Close() })
	f, dc := flush.New(), discard.New()
	tb, err := table.Parse("x", strings.NewReader("0 2048 linear "+disk+" 0\n"), pool)
	if err != nil {
		t.Fatal(err)
	}
	x := mapped.New("x", tb, f, dc)
	var served []string
	s := &control.Server{Devices: map[string]*mapped.Device{"x": x}, Open: pool,
		Create: func(name string, tb *table.Table) (*mapped.Device, error) {
			served = append(served, name)
			return mapped.New(name, tb, f, dc), nil
		},
	}
	// As serve's: stop serving it (nothing serves it here), then close it.
	s.Remove = func(name string, force bool) error { return s.Device(name).Close() }
	if err := x.Write([]byte("data"), 0, false); err != nil {
		t.Fatal(err)
	}
	faulty[0].FailSync(syscall.EIO)
	if _, err := s.Do(control.Request{Op: "remove", Name: "x"}); !errors.Is(err, syscall.EIO) {
		t.Fatalf("remove: %v, want the close's %v", err, syscall.EIO)
	}
	if out, _ := s.Do(control.Request{Op: "ls"}); out != "" {
		t.Fatalf("ls after the remove: %q", out)
	}
	if _, err := s.Do(control.Request{Op: "suspend", Name: "x"}); !errors.Is(err, control.ErrNoDevice) && (err == nil || !strings.Contains(err.Error(), control.ErrNoDevice.Error())) {
		t.Fatalf("suspend after the remove: %v, want %v", err, control.ErrNoDevice)
	}
	tf := filepath.Join(dir, "x.table")
	if err := os.WriteFile(tf, []byte("0 2048 linear "+disk+" 0\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Do(control.Request{Op: "create", Name: "x", File: tf}); err != nil {
		t.Fatalf("create after the remove: %v", err)
	}
	if len(served) != 1 || s.Device("x") == nil || s.Device("x") == x {
		t.Fatalf("create served %v, device %p (old %p)", served, s.Device("x"), x)
	}
	if _, err := s.Do(control.Request{Op: "remove", Name: "x"}); err != nil {
		t.Fatalf("removing the new x: %v", err)
	}
}

// The stacking check walks each device once: over 40 levels of diamonds
// (a_i and b_i each stacked on both a_{i-1} and b_{i-1}) there are 2^40
// paths from the top to the bottom, and a remove of an unrelated device,
// which asks whether each device stacks on it, must not try them all.
func TestStackingCheckOnDiamonds(t *testing.T) {
	const levels = 40
	devs := memOpener{"disk": backing.NewMem("disk", 1<<20)}
	defs := []table.Def{
		{Name: "a0", File: "a0", Text: strings.NewReader("0 2048 linear disk 0\n")},
		{Name: "b0", File: "b0", Text: strings.NewReader("0 2048 linear disk 0\n")},
		{Name: "lone", File: "lone", Text: strings.NewReader("0 2048 linear disk 0\n")},
	}
	for i := 1; i < levels; i++ {
		text := fmt.Sprintf("0 1024 linear /dev/mapper/a%d 0\n1024 1024 linear /dev/mapper/b%d 1024\n", i-1, i-1)
		defs = append(defs,
			table.Def{Name: fmt.Sprintf("a%d", i), File: "a", Text: strings.NewReader(text)},
			table.Def{Name: fmt.Sprintf("b%d", i), File: "b", Text: strings.NewReader(text)})
	}
	f, dc := flush.New(), discard.New()
	mds, err := table.ParseSet(defs, devs, func(name string, t *table.Table) *mapped.Device { return mapped.New(name, t, f, dc) })
	if err != nil {
		t.Fatal(err)
	}
	byName := map[string]*mapped.Device{}
	for i, d := range mds {
		byName[defs[i].Name] = d
	}
	s := &control.Server{Devices: byName, Open: devs}
	s.Remove = func(name string, force bool) error { return s.Device(name).Close() }
	if err := nbdtest.Recv(t, do(s, control.Request{Op: "remove", Name: "lone"}), "the remove of a device nothing stacks on"); err != nil {
		t.Fatal(err)
	}
	if err := nbdtest.Recv(t, do(s, control.Request{Op: "remove", Name: "a0"}), "the remove of a device the diamonds stack on"); !errors.Is(err, control.ErrInUse) && (err == nil || !strings.Contains(err.Error(), control.ErrInUse.Error())) {
		t.Fatalf("remove a0: %v, want %v", err, control.ErrInUse)
	}
}

type memOpener map[string]backing.Device

func (o memOpener) Open(name string) (backing.Device, error) {
	if d, ok := o[name]; ok {
		return d, nil
	}
	return nil, fmt.Errorf("open %s: %w", name, os.ErrNotExist)
}
