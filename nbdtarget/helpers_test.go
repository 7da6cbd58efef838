package nbdtarget

import (
	"errors"
	"net"
	"path/filepath"
	"strconv"
	"sync"
	"testing"

	"github.com/nbdmapper/nbdmapper/backing"
	"github.com/nbdmapper/nbdmapper/discard"
	"github.com/nbdmapper/nbdmapper/flush"
	"github.com/nbdmapper/nbdmapper/internal/testing/sparse"
	"github.com/nbdmapper/nbdmapper/mapped"
	"github.com/nbdmapper/nbdmapper/table"
)

// Test-only targets, so that these tests do not depend on the table parser.

type linearT struct {
	dev backing.Device
	off int64
}

func (t linearT) Type() string              { return "linear" }
func (t linearT) Args() []string            { return []string{t.dev.Name(), strconv.FormatInt(t.off/512, 10)} }
func (t linearT) Status() string            { return "" }
func (t linearT) Devices() []backing.Device { return []backing.Device{t.dev} }
func (t linearT) Map(off, n int64, yield func(table.Extent) bool) bool {
	return yield(table.Extent{Kind: table.KindMapped, Dev: t.dev, Off: t.off + off, VOff: off, Len: n})
}

type kindT table.Kind

func (t kindT) Type() string {
	if table.Kind(t) == table.KindZero {
		return "zero"
	}
	return "error"
}
func (t kindT) Args() []string            { return nil }
func (t kindT) Status() string            { return "" }
func (t kindT) Devices() []backing.Device { return nil }
func (t kindT) Map(off, n int64, yield func(table.Extent) bool) bool {
	return yield(table.Extent{Kind: table.Kind(t), VOff: off, Len: n})
}

// seg is one table line in bytes (multiples of 512) for test layouts.
type seg struct {
	len  int64
	dev  backing.Device // nil: zero or error, per kind
	off  int64
	kind table.Kind
}

func newExport(t testing.TB, name string, segs ...seg) *Export {
	t.Helper()
	var lines []table.Line
	var start table.Sector
	for _, s := range segs {
		var tgt table.Target
		switch {
		case s.dev != nil:
			tgt = linearT{dev: s.dev, off: s.off}
		default:
			tgt = kindT(s.kind)
		}
		l := table.Line{Start: start, Length: table.Sector(s.len / 512), Target: tgt}
		lines = append(lines, l)
		start += l.Length
	}
	tb, err := table.New(name+".table", lines)
	if err != nil {
		t.Fatal(err)
	}
	return &Export{Name: name, Dev: mapped.New(name, tb, flush.New(), discard.New())}
}

// sparseFile creates a sparse file of size bytes and opens it through pool.
func sparseFile(t testing.TB, pool *backing.Pool, dir, name string, size int64) (backing.Device, string) {
	t.Helper()
	path := sparse.Create(t, filepath.Join(dir, name), size)
	d, err := pool.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	return d, path
}

// gateDev blocks ReadAt at one device offset until released, to force
// replies out of order; failDev fails I/O on a range; noZeroDev has no
// native zeroing.
type gateDev struct {
	backing.Device
	at      int64
	entered chan struct{}
	release chan struct{}
	once    sync.Once
}

func (g *gateDev) ReadAt(p []byte, off int64) (int, error) {
	if off == g.at {
		g.once.Do(func() { close(g.entered) })
		<-g.release
	}
	return g.Device.ReadAt(p, off)
}

type failDev struct {
	backing.Device
	from, to int64
}

var errInjected = errors.New("injected I/O error")

func (f *failDev) hit(off, n int64) bool { return off < f.to && off+n > f.from }

func (f *failDev) ReadAt(p []byte, off int64) (int, error) {
	if f.hit(off, int64(len(p))) {
		return 0, errInjected
	}
	return f.Device.ReadAt(p, off)
}

func (f *failDev) WriteAt(p []byte, off int64) (int, error) {
	if f.hit(off, int64(len(p))) {
		return 0, errInjected
	}
	return f.Device.WriteAt(p, off)
}

type noZeroDev struct{ backing.Device }

func (noZeroDev) Zero(off, n int64, mayPunch bool) error { return backing.ErrNotSupported }

var (
	_ backing.Device = (*gateDev)(nil)
	_ backing.Device = (*failDev)(nil)
	_ backing.Device = noZeroDev{}
)

// wrappingListener hands the server each accepted connection through wrap,
// for tests that watch or steer what the server does to its socket.
type wrappingListener struct {
	net.Listener
	wrap func(net.Conn) net.Conn
}

func (l *wrappingListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	return l.wrap(c), nil
}
