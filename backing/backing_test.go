package backing

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/nbdmapper/nbdmapper/internal/testing/nbdtest"
	"github.com/nbdmapper/nbdmapper/internal/testing/sparse"
)

func sparseFile(t *testing.T, size int64) string {
	t.Helper()
	return sparse.Create(t, filepath.Join(t.TempDir(), "disk.img"), size)
}

// devices returns one of each real kind of Device, for tests that every
// implementation must pass.
func devices(t *testing.T) map[string]Device {
	f, err := OpenFile(sparseFile(t, 1<<20), false)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	return map[string]Device{"file": f, "mem": NewMem("mem", 1<<20)}
}

func TestDeviceReadWriteZeroHoles(t *testing.T) {
	for name, d := range devices(t) {
		t.Run(name, func(t *testing.T) {
			if d.Size() != 1<<20 {
				t.Fatalf("size %d", d.Size())
			}
			holes, err := d.Holes(0, d.Size())
			if err != nil {
				t.Fatal(err)
			}
			if want := []Range{{0, 1 << 20}}; !equalRanges(holes, want) {
				t.Fatalf("fresh device holes %v, want %v", holes, want)
			}
			data := bytes.Repeat([]byte{0xab}, 64<<10)
			if _, err := d.WriteAt(data, 128<<10); err != nil {
				t.Fatal(err)
			}
			got := make([]byte, len(data))
			if _, err := d.ReadAt(got, 128<<10); err != nil || !bytes.Equal(got, data) {
				t.Fatalf("read back differs (err %v)", err)
			}
			holes, _ = d.Holes(0, d.Size())
			if want := []Range{{0, 128 << 10}, {192 << 10, (1 << 20) - (192 << 10)}}; !equalRanges(holes, want) {
				t.Fatalf("holes after write %v, want %v", holes, want)
			}
			// Zero without punching keeps blocks allocated; discard frees them.
			if err := d.Zero(128<<10, 16<<10, false); err != nil {
				t.Fatal(err)
			}
			if err := d.Discard(160<<10, 32<<10); err != nil {
				t.Fatal(err)
			}
			d.ReadAt(got, 128<<10)
			want := append(make([]byte, 16<<10), data[16<<10:32<<10]...)
			want = append(want, make([]byte, 32<<10)...)
			if !bytes.Equal(got, want) {
				t.Fatal("zeroed or discarded data does not read back as zeros")
			}
			holes, _ = d.Holes(0, d.Size())
			if want := []Range{{0, 128 << 10}, {160 << 10, (1 << 20) - (160 << 10)}}; !equalRanges(holes, want) {
				t.Fatalf("holes after discard %v, want %v", holes, want)
			}
			if err := d.Sync(); err != nil {
				t.Fatal(err)
			}
		})
	}
}

func TestPoolOpensEachDeviceOnce(t *testing.T) {
	path := sparseFile(t, 1<<20)
	link := filepath.Join(t.TempDir(), "link.img")
	if err := os.Symlink(path, link); err != nil {
		t.Fatal(err)
	}
	other := sparseFile(t, 1<<20)
	wraps := 0
	p := &Pool{Wrap: func(d Device) Device { wraps++; return d }}
	defer p.Close()
	a, err := p.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := p.Open(link)
	c, _ := p.Open(filepath.Join(filepath.Dir(path), ".", "disk.img"))
	d, _ := p.Open(other)
	if a != b || a != c {
		t.Fatal("two paths to one file opened as different devices")
	}
	if a == d {
		t.Fatal("different files opened as one device")
	}
	if n := len(p.Devices()); n != 2 || wraps != 2 {
		t.Fatalf("pool has %d devices, wrapped %d times; want 2 and 2", n, wraps)
	}
	if _, err := p.Open(filepath.Join(t.TempDir(), "missing")); !os.IsNotExist(err) {
		t.Fatalf("missing file: err %v, want not-exist", err)
	}
}

func TestResolveMajorMinor(t *testing.T) {
	for _, tc := range []struct {
		name     string
		isNumber bool
	}{
		{"7:0", true}, {"/dev/sda", false}, {"a:b", false}, {"7:", false}, {"disk.img", false},
	} {
		if _, ok := resolve(tc.name); ok != tc.isNumber {
			t.Errorf("resolve(%q) major:minor = %v, want %v", tc.name, ok, tc.isNumber)
		}
	}
}

func equalRanges(a, b []Range) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// memScheme opens "mem://NAME" names as in-memory devices; a name's
// identity ignores case, as a URI scheme's and host's do.
type memScheme struct{ opens int }

func (s *memScheme) Identify(name string) (ID, bool, error) {
	rest, ok := strings.CutPrefix(strings.ToLower(name), "mem://")
	if !ok {
		return ID{}, false, nil
	}
	if rest == "" {
		return ID{}, true, errors.New("mem:// needs a name")
	}
	return ID{URI: "mem://" + rest}, true, nil
}

func (s *memScheme) Open(name string, readOnly bool) (Device, error) {
	s.opens++
	return NewMem(name, 1<<20), nil
}

// TestPoolSchemes: names a Scheme claims are opened by it, once per
// identity however they are spelled; a claimed but malformed name is its
// error; other names are still paths.
func TestPoolSchemes(t *testing.T) {
	s := &memScheme{}
	wraps := 0
	p := &Pool{Schemes: []Scheme{s}, Wrap: func(d Device) Device { wraps++; return d }}
	defer p.Close()
	a, err := p.Open("mem://disk")
	if err != nil {
		t.Fatal(err)
	}
	b, err := p.Open("MEM://DISK")
	if err != nil {
		t.Fatal(err)
	}
	if a != b || s.opens != 1 || wraps != 1 {
		t.Fatalf("two spellings: same device %v, %d opens, %d wraps; want one of each", a == b, s.opens, wraps)
	}
	if a.Name() != "mem://disk" {
		t.Errorf("name %q, want the first spelling", a.Name())
	}
	if _, err := p.Open("mem://"); err == nil || !strings.Contains(err.Error(), "needs a name") {
		t.Fatalf("malformed name: %v", err)
	}
	f, err := p.Open(sparseFile(t, 1<<20))
	if err != nil {
		t.Fatal(err)
	}
	if h, ok := f.(*HoleMap); !ok || len(p.Devices()) != 2 {
		t.Fatalf("a path beside a scheme: %T, %d devices", f, len(p.Devices()))
	} else if _, ok := h.Unwrap().(*File); !ok {
		t.Fatalf("a path beside a scheme: a hole map over %T", h.Unwrap())
	}
	if id := a.(*Mem).ID(); id.String() == "" {
		t.Fatal("empty ID string")
	}
	if got := (ID{URI: "nbd://h:10809/e"}).String(); got != "nbd://h:10809/e" {
		t.Errorf("a remote ID prints as %q", got)
	}
}

// closeLog is a Recorder that also logs Close, after the calls before it.
type closeLog struct{ *Recorder }

func (c closeLog) Close() error {
	c.record(Call{Op: "close"})
	return c.Recorder.Close()
}

// String is the log, a call a line.
func (c closeLog) String() string {
	var lines []string
	for _, call := range c.Calls() {
		lines = append(lines, call.String())
	}
	return strings.Join(lines, "\n")
}

// TestPoolReleases: a device stays open while any Open of it is not
// released, whichever name it was opened by; the last Release syncs it,
// closes it, hands it to Forget and takes it out of the pool, whose next
// Open of the file opens it afresh.
func TestPoolReleases(t *testing.T) {
	path := sparseFile(t, 1<<20)
	link := filepath.Join(t.TempDir(), "link.img")
	if err := os.Symlink(path, link); err != nil {
		t.Fatal(err)
	}
	var logs []closeLog
	var forgot []Device
	p := &Pool{
		Wrap:   func(d Device) Device { c := closeLog{NewRecorder(d)}; logs = append(logs, c); return c },
		Forget: func(d Device) { forgot = append(forgot, d) },
	}
	defer p.Close()
	a, err := p.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	if b, err := p.Open(link); err != nil || b != a {
		t.Fatalf("the link: %v, same device %v", err, b == a)
	}
	if _, err := a.WriteAt([]byte("kept"), 0); err != nil {
		t.Fatal(err)
	}
	if err := p.Release(a); err != nil {
		t.Fatal(err)
	}
	if got := logs[0].String(); got != "write 0+4" || len(forgot) != 0 || len(p.Devices()) != 1 {
		t.Fatalf("after one of two releases: calls %q, forgot %d, %d devices; want it open", got, len(forgot), len(p.Devices()))
	}
	if err := p.Release(a); err != nil {
		t.Fatal(err)
	}
	if got := logs[0].String(); got != "write 0+4\nsync\nclose 0+0" {
		t.Errorf("the last release made the calls %q, want a sync and a close", got)
	}
	if len(forgot) != 1 || forgot[0] != a || len(p.Devices()) != 0 {
		t.Errorf("after the last release: forgot %v, %d devices left; want the device forgotten and gone", forgot, len(p.Devices()))
	}
	if _, err := a.ReadAt(make([]byte, 4), 0); !errors.Is(err, os.ErrClosed) {
		t.Errorf("a read of the released device: %v, want os.ErrClosed", err)
	}
	if err := p.Release(a); !errors.Is(err, ErrNotPooled) {
		t.Errorf("one release too many: %v, want ErrNotPooled", err)
	}

	again, err := p.Open(link)
	if err != nil {
		t.Fatal(err)
	}
	got := make([]byte, 4)
	if again == a || len(logs) != 2 {
		t.Fatalf("the file opened again is the closed device (%v), or was not wrapped afresh (%d wraps)", again == a, len(logs))
	}
	if _, err := again.ReadAt(got, 0); err != nil || string(got) != "kept" {
		t.Fatalf("the file opened again reads %q, %v", got, err)
	}
	if err := p.Close(); err != nil {
		t.Fatal(err)
	}
	if err := p.Release(again); err != nil {
		t.Errorf("a release after Close: %v, want nothing to do", err)
	}
}

// hungSync is a device whose Sync blocks until release is closed.
type hungSync struct {
	Device
	release chan struct{}
}

func (h hungSync) Sync() error { <-h.release; return nil }

// TestPoolSyncBounded: the pool syncs its devices at once, so that one
// whose sync hangs holds up no other's, and Sync returns when ctx ends,
// naming the device whose sync has not returned.
func TestPoolSyncBounded(t *testing.T) {
	release := make(chan struct{})
	defer close(release)
	p := &Pool{}
	defer p.Close()
	p.Add("hung", hungSync{NewMem("hung", 4096), release})
	ok := NewRecorder(NewMem("ok", 4096))
	p.Add("ok", ok)
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() { errc <- p.Sync(ctx) }()
	nbdtest.Until(t, "the other device's sync", func() bool { return ok.Count(OpSync) == 1 })
	cancel()
	err := nbdtest.Recv(t, errc, "Sync to return once ctx is done")
	if !errors.Is(err, context.Canceled) || !strings.Contains(err.Error(), "syncs of hung not returned") {
		t.Errorf("Sync with a hung device: %v, want it named and context.Canceled", err)
	}
}
