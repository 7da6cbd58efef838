package mapped_test

import (
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/nbdmapper/nbdmapper/backing"
	"github.com/nbdmapper/nbdmapper/discard"
	"github.com/nbdmapper/nbdmapper/flush"
	"github.com/nbdmapper/nbdmapper/mapped"
	"github.com/nbdmapper/nbdmapper/snapshot"
	"github.com/nbdmapper/nbdmapper/table"
)

type memOpener map[string]backing.Device

func (o memOpener) Open(name string) (backing.Device, error) {
	if d, ok := o[name]; ok {
		return d, nil
	}
	return nil, fmt.Errorf("open %s: %w", name, fs.ErrNotExist)
}

// parseSet parses NAME=TABLE specs as one set of mapped devices over devs,
// sharing one flush and one discard engine.
func parseSet(t testing.TB, devs memOpener, specs ...string) []*mapped.Device {
	t.Helper()
	return parseSetWith(t, flush.New(), devs, specs...)
}

// parseSetWith is parseSet with the flush engine f, which may track devs.
func parseSetWith(t testing.TB, f *flush.Engine, devs memOpener, specs ...string) []*mapped.Device {
	t.Helper()
	var defs []table.Def
	for _, s := range specs {
		name, text, _ := strings.Cut(s, "=")
		defs = append(defs, table.Def{Name: name, File: name + ".table", Text: strings.NewReader(text)})
	}
	d := discard.New()
	mds, err := table.ParseSet(defs, devs, func(name string, t *table.Table) *mapped.Device { return mapped.New(name, t, f, d) })
	if err != nil {
		t.Fatal(err)
	}
	return mds
}

func names(ds []backing.Device) []string {
	var s []string
	for _, d := range ds {
		s = append(s, d.Name())
	}
	return s
}

// TestStackedSnapshot stacks a snapshot and a snapshot-origin on a striped-and-
// linear base device of the same set, listed in the "wrong" order, and
// checks copy-on-write through the stack, the status lines, and that the
// flush devices are the real ones.
func TestStackedSnapshot(t *testing.T) {
	disk := backing.NewMem("disk", 4<<20)
	cow := backing.NewMem("cow", 4<<20)
	devs := memOpener{"disk": disk, "cow": cow}
	var base strings.Builder
	for i := 0; i < 64; i++ { // 64 segments of 32 sectors, reversed on disk
		fmt.Fprintf(&base, "%d 32 linear disk %d\n", i*32, (63-i)*32)
	}
	mds := parseSet(t, devs,
		"snap=0 2048 snapshot /dev/mapper/base cow P 8",
		"orig=0 2048 snapshot-origin /dev/mapper/base",
		"base="+base.String(),
	)
	snapDev, origDev := mds[0], mds[1]
	snap, orig := snapDev.Table(), origDev.Table()
	defer snapDev.Close()
	if n := len(mds[2].Table().Lines); n != 64 {
		t.Fatalf("base has %d lines", n)
	}
	before := make([]byte, 1<<20)
	for i := range before {
		before[i] = byte(i * 7)
	}
	if _, err := origDev.WriteAt(before, 0); err != nil {
		t.Fatal(err)
	}
	// That write copied every chunk out: the snapshot still reads zeros.
	got := make([]byte, 1<<20)
	snapDev.ReadAt(got, 0)
	if !bytes.Equal(got, make([]byte, 1<<20)) {
		t.Fatal("snapshot changed by an origin write")
	}
	if _, err := snapDev.WriteAt([]byte("snapshot only"), 4096*3+1); err != nil {
		t.Fatal(err)
	}
	origDev.ReadAt(got, 0)
	if !bytes.Equal(got, before) {
		t.Fatal("origin changed by a snapshot write")
	}
	// 256 chunks copied out: next free 2+256 = 258, 8 sectors each; area 0
	// (256 entries) is full, so area 1 is current.
	if got, want := snap.Status(), "0 2048 snapshot 2072/8192 24\n"; got != want {
		t.Fatalf("status %q, want %q", got, want)
	}
	if got, want := orig.Status(), "0 2048 snapshot-origin \n"; got != want {
		t.Fatalf("origin status %q, want %q", got, want)
	}
	if got, want := snap.String(), "0 2048 snapshot /dev/mapper/base cow P 8\n"; got != want {
		t.Fatalf("table %q, want %q", got, want)
	}
	// Flushes go to the real devices, each once, the stacked device
	// expanded when the flush runs.
	if d := table.Flatten(snap.Devices()); len(d) != 2 || d[0] != cow || d[1] != disk {
		t.Fatalf("snapshot devices %v", names(d))
	}
	if d := table.Flatten(orig.Devices()); len(d) != 1 || d[0] != disk {
		t.Fatalf("origin devices %v", names(d))
	}
}

// TestStackedFiles reads the tables from files through a real
// backing.Pool, as the serve command does.
func TestStackedFiles(t *testing.T) {
	dir := t.TempDir()
	write := func(name, text string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(text), 0o644); err != nil {
			t.Fatal(err)
		}
		return p
	}
	disk := write("disk.img", strings.Repeat("d", 1<<20))
	cow := write("cow.img", string(make([]byte, 1<<20)))
	pool := &backing.Pool{}
	defer pool.Close()
	f, dc := flush.New(), discard.New()
	mds, err := table.ParseSet([]table.Def{
		{Name: "snap", File: write("snap.table", "0 2048 snapshot /dev/mapper/base "+cow+" N 8\n")},
		{Name: "base", File: write("base.table", "0 1024 linear "+disk+" 1024\n1024 1024 linear "+disk+" 0\n")},
	}, pool, func(name string, t *table.Table) *mapped.Device { return mapped.New(name, t, f, dc) })
	if err != nil {
		t.Fatal(err)
	}
	defer mds[0].Close()
	d := mds[0]
	if _, err := d.WriteAt([]byte("x"), 0); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 2)
	d.ReadAt(buf, 0)
	if string(buf) != "xd" {
		t.Fatalf("read %q", buf)
	}
	if n := len(pool.Devices()); n != 2 {
		t.Fatalf("pool opened %d devices, want 2 (disk once, cow)", n)
	}
}

// A FLUSH through a snapshot, snapshot-origin or snapshot-merge stacked on
// /dev/mapper/base reaches the devices base maps now, not those it mapped
// when the upper table was parsed: base is reloaded from a onto b, a write
// lands on b, and the upper device's flush must sync b.
func TestStackedFlushAfterLowerReload(t *testing.T) {
	for _, upper := range []string{
		"0 2048 snapshot-origin /dev/mapper/base",
		"0 2048 snapshot /dev/mapper/base cow N 8",
		"0 2048 snapshot-merge /dev/mapper/base cow P 8",
		"0 2048 linear /dev/mapper/base 0",
	} {
		t.Run(strings.Fields(upper)[2], func(t *testing.T) {
			f := flush.New()
			a := backing.NewFaulty(backing.NewMem("a", 1<<20))
			b := backing.NewFaulty(backing.NewMem("b", 1<<20))
			devs := memOpener{"a": f.Track(a), "b": f.Track(b), "cow": f.Track(backing.NewMem("cow", 1<<20))}
			mds := parseSetWith(t, f, devs, "top="+upper, "base=0 2048 linear a 0")
			top, base := mds[0], mds[1]
			defer top.Close()
			defer base.Close()
			base.Load(mustParse(t, "0 2048 linear b 0\n", devs))
			if _, err := base.Resume(); err != nil {
				t.Fatal(err)
			}
			// A snapshot's writes go to its COW: dirty b through base,
			// as another user of the origin would, which the snapshot's
			// flush covers as dm's does.
			w := top
			if strings.Fields(upper)[2] == "snapshot" {
				w = base
			}
			if err := w.Write([]byte("acknowledged"), 8192, false); err != nil {
				t.Fatal(err)
			}
			if b.Pending() == 0 {
				t.Fatal("the write did not reach b")
			}
			if err := top.Flush(); err != nil {
				t.Fatal(err)
			}
			if n := b.Crash(); n != 0 {
				t.Fatalf("a power cut after the flush loses %d writes on b (b synced %d times)", n, b.Syncs())
			}
		})
	}
}

// A device stacked on /dev/mapper/base inherits base's doubt: once a
// reload of base swapped a table out after its flush failed, every flush
// of base fails, and so must every flush of the device above, which
// reaches the same writes.
func TestStackedFlushKeepsLowerUnsynced(t *testing.T) {
	f := flush.New()
	x := backing.NewFaulty(backing.NewMem("x", 1<<20))
	devs := memOpener{"x": f.Track(x), "y": f.Track(backing.NewMem("y", 1<<20))}
	mds := parseSetWith(t, f, devs, "top=0 2048 linear /dev/mapper/base 0", "base=0 2048 linear x 0")
	top, base := mds[0], mds[1]
	defer top.Close()
	defer base.Close()
	if err := top.Write([]byte("acknowledged"), 0, false); err != nil {
		t.Fatal(err)
	}
	base.Load(mustParse(t, "0 2048 linear y 0\n", devs))
	x.FailSync(syscall.EIO)
	if _, err := base.Resume(); err == nil {
		t.Fatal("a resume whose suspend could not flush the old table succeeded")
	}
	if swapped, err := base.Resume(); !swapped || err != nil {
		t.Fatalf("second resume: swapped %v, %v", swapped, err)
	}
	if err := base.Flush(); !errors.Is(err, flush.ErrSyncFailed) {
		t.Fatalf("base flush: %v, want %v", err, flush.ErrSyncFailed)
	}
	if err := top.Flush(); !errors.Is(err, flush.ErrSyncFailed) {
		t.Fatalf("top flush: %v, want %v: the write acknowledged through top may be lost (%d writes a crash would lose)", err, flush.ErrSyncFailed, x.Crash())
	}
}

// A request holds a copy buffer below an export with a snapshot-origin,
// also when the origin line is in a device below it, loaded by a reload.
func TestRequestMemoryFollowsStackAndReload(t *testing.T) {
	devs := memOpener{"disk": backing.NewMem("disk", 1<<20), "cow": backing.NewMem("cow", 1<<20)}
	mds := parseSet(t, devs, "top=0 2048 linear /dev/mapper/base 0", "base=0 2048 linear disk 0", "snap=0 2048 snapshot disk cow N 8")
	top, base := mds[0], mds[1]
	defer top.Close()
	defer base.Close()
	defer mds[2].Close()
	if got := top.RequestMemory(); got != 0 {
		t.Fatalf("linear over linear: %d bytes", got)
	}
	if got := mds[2].RequestMemory(); got != snapshot.CopyMemory {
		t.Fatalf("snapshot: %d bytes, want %d", got, snapshot.CopyMemory)
	}
	base.Load(mustParse(t, "0 2048 snapshot-origin disk\n", devs))
	if _, err := base.Resume(); err != nil {
		t.Fatal(err)
	}
	if got := top.RequestMemory(); got != snapshot.CopyMemory {
		t.Fatalf("linear over a reloaded snapshot-origin: %d bytes, want %d", got, snapshot.CopyMemory)
	}
}

// Each reload of a snapshot table makes a new snapshot device, which a
// TRIM makes known to the discard engine; the old one goes when its table
// is closed (by the resume that swaps it out, or by Close), with what the
// engine keeps of it, rather than staying for the life of the server.
func TestReloadedSnapshotsLeaveTheDiscardEngine(t *testing.T) {
	devs := memOpener{"disk": backing.NewMem("disk", 1<<20), "cow": backing.NewMem("cow", 1<<20)}
	dc := discard.New()
	const text = "0 2048 snapshot disk cow N 8 1 discard_zeroes_cow\n"
	d := mapped.New("d", mustParse(t, text, devs), flush.New(), dc)
	for range 5 {
		if err := d.Trim(0, 1<<20, false); err != nil {
			t.Fatal(err)
		}
		d.Load(mustParse(t, text, devs))
		if _, err := d.Resume(); err != nil {
			t.Fatal(err)
		}
	}
	if n := len(dc.Stats().Devices); n > 2 { // the live snapshot, and the COW below it
		t.Errorf("the discard engine keeps %d devices after 5 reloads: %v", n, dc.Stats().Devices)
	}
	if err := d.Trim(0, 1<<20, false); err != nil {
		t.Fatal(err)
	}
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	for _, s := range dc.Stats().Devices {
		if strings.HasPrefix(s.Name, "snapshot ") {
			t.Errorf("the discard engine keeps %s after the device closed", s.Name)
		}
	}
}

// A flush of a device on 40 levels of diamonds (a_i and b_i each stacked
// on both a_{i-1} and b_{i-1}: 2^40 paths down) expands each device once.
func TestFlushOnDiamonds(t *testing.T) {
	devs := memOpener{"disk": backing.NewMem("disk", 1<<20)}
	specs := []string{"a0=0 2048 linear disk 0", "b0=0 2048 linear disk 0"}
	for i := 1; i < 40; i++ {
		text := fmt.Sprintf("0 1024 linear /dev/mapper/a%d 0\n1024 1024 linear /dev/mapper/b%d 1024", i-1, i-1)
		specs = append(specs, fmt.Sprintf("a%d=%s", i, text), fmt.Sprintf("b%d=%s", i, text))
	}
	made := make(chan []*mapped.Device, 1)
	go func() { made <- parseSet(t, devs, specs...) }()
	mds := wait(t, "the stack to load", made)
	flushed := make(chan error, 1)
	go func() { flushed <- mds[len(mds)-1].Flush() }()
	if err := wait(t, "the flush of the top device", flushed); err != nil {
		t.Fatal(err)
	}
	if d := table.Flatten(mds[len(mds)-1].Devices()); len(d) != 1 || d[0] != devs["disk"] {
		t.Fatalf("devices below the top: %v", names(d))
	}
}
