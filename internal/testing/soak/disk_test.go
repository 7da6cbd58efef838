package soak

import (
	"bytes"
	"cmp"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/nbdmapper/nbdmapper/backing"
	"github.com/nbdmapper/nbdmapper/table"
)

// disk is a real file behind a volatile write cache that fails the way
// disks and Linux's page cache do, for the soak:
//
//   - Writes, discards and zeroings land in the cache, sector by sector,
//     and are read back from it; Sync writes the cached sectors to the file
//     and fdatasyncs it.
//   - Crash (a power cut) drops the cache: only synced data survives.
//   - A failed sync loses the sectors it was writing back, as Linux may mark
//     pages clean after a failed writeback: they still read back from the
//     cache but are never written to the file, so a later successful sync
//     does not save them. A server that acknowledges a flush after any
//     failed sync of the device has acknowledged a write it lost.
//   - With faults on, calls fail at random with EIO (reads, writes, discards,
//     zeroing), ENOSPC (writes), a failed sync, a delay, or a panic, before
//     or after the work is done.
//   - Once dead (the power is off), every call fails with EIO.
//
// Every soak I/O is sector-aligned, so the cache works in sectors; a
// partial sector is merged with what the sector holds.
type disk struct {
	f      *backing.File
	faults *faults

	dead atomic.Bool

	// syncMu makes syncs one at a time, so a slow write-back never lands
	// after a later one and undoes it.
	syncMu sync.Mutex

	mu    sync.Mutex
	cache map[int64]*slot // sector -> cached contents
	gen   uint64

	// Tests: waited runs in a read after its checks, before it reaches the
	// cache, where a read waits while the power goes (TestCutMidRead);
	// beside runs in a durable write between its write and its sync, where
	// another sync may run (TestDurableWriteSeesLostSectors).
	waited, beside func()
}

type slot struct {
	data []byte // nil: zeros
	lost bool   // a failed sync dropped it: never written back
	gen  uint64 // when it was last written
}

const sector = 512

var (
	_ backing.Device = (*disk)(nil)

	errInjected = fmt.Errorf("injected fault: %w", syscall.EIO)
	errDead     = fmt.Errorf("device powered off: %w", syscall.EIO)
	errNoSpace  = fmt.Errorf("injected fault: %w", syscall.ENOSPC)
	// errLostWriteBack is a durable write's own: a failed sync beside it
	// lost its sectors.
	errLostWriteBack = fmt.Errorf("write-back of a durable write failed: %w", syscall.EIO)
)

// injectedPanic is the value of every panic a disk injects; any other
// panic the server recovers from is a bug.
type injectedPanic struct{ dev, op string }

func (p injectedPanic) String() string { return "injected panic in " + p.op + " on " + p.dev }

// faults is what a disk injects, each a probability per call. One faults
// value may be shared by several disks; the counters count injections.
type faults struct {
	on                                           atomic.Bool
	eio, enospc, syncFail, slow, panics, holeLag float64
	maxDelay                                     time.Duration

	nEIO, nENOSPC, nSyncFail, nSlow, nPanic, nHoleLag atomic.Int64
	nSync                                             atomic.Int64 // syncs asked for
}

func (f *faults) hit(p float64) bool { return f != nil && f.on.Load() && p > 0 && rand.Float64() < p }

// inject runs before or after a call's work (at random) and may fail it.
// The error it returns replaces the call's result.
func (d *disk) inject(op string, write bool) (before, after func() error) {
	none := func() error { return nil }
	f := d.faults
	if f == nil || !f.on.Load() {
		return none, none
	}
	if f.hit(f.slow) {
		f.nSlow.Add(1)
		time.Sleep(rand.N(f.maxDelay + 1))
	}
	var fault func() error
	switch {
	case f.hit(f.panics):
		f.nPanic.Add(1)
		fault = func() error { panic(injectedPanic{dev: d.Name(), op: op}) }
	case f.hit(f.eio):
		f.nEIO.Add(1)
		fault = func() error { return errInjected }
	case write && f.hit(f.enospc):
		f.nENOSPC.Add(1)
		fault = func() error { return errNoSpace }
	default:
		return none, none
	}
	if rand.N(2) == 0 {
		return fault, none
	}
	return none, fault
}

func newDisk(f *backing.File, fl *faults) *disk {
	return &disk{f: f, faults: fl, cache: make(map[int64]*slot)}
}

func (d *disk) Name() string           { return d.f.Name() }
func (d *disk) ID() backing.ID         { return d.f.ID() }
func (d *disk) Size() int64            { return d.f.Size() }
func (d *disk) Limits() backing.Limits { return d.f.Limits() }
func (d *disk) Close() error           { return d.f.Close() }

// Crash powers the disk off: the cache is dropped and every later call
// fails, and so do the calls in progress that reach the cache after it
// (they look under mu): a read that had passed its checks before the cut
// would otherwise answer from the file alone, the state after the cut,
// which no disk answers with. A sync writing back now may still complete,
// as a disk's may.
func (d *disk) Crash() {
	d.dead.Store(true)
	d.mu.Lock()
	d.cache = make(map[int64]*slot)
	d.mu.Unlock()
}

func (d *disk) check(off, n int64) error {
	if off < 0 || n < 0 || off > d.Size() || n > d.Size()-off {
		return fmt.Errorf("range %d+%d outside %s: %w", off, n, d.Name(), syscall.EINVAL)
	}
	if d.dead.Load() {
		return errDead
	}
	return nil
}

// sectorNow returns what sector s holds, cache first. Called with mu held.
func (d *disk) sectorNow(s int64) ([]byte, error) {
	b := make([]byte, sector)
	if sl := d.cache[s]; sl != nil {
		copy(b, sl.data)
		return b, nil
	}
	_, err := d.f.ReadAt(b, s*sector)
	return b, err
}

func (d *disk) ReadAt(p []byte, off int64) (int, error) {
	if err := d.check(off, int64(len(p))); err != nil {
		return 0, err
	}
	before, after := d.inject("read", false)
	if err := before(); err != nil {
		return 0, err
	}
	if d.waited != nil {
		d.waited()
	}
	d.mu.Lock()
	if d.dead.Load() { // the power went while the read waited: no answer
		d.mu.Unlock()
		return 0, errDead
	}
	n, err := d.f.ReadAt(p, off)
	if err == nil {
		for s := off / sector; s*sector < off+int64(len(p)); s++ {
			sl := d.cache[s]
			if sl == nil {
				continue
			}
			lo, hi := max(off, s*sector), min(off+int64(len(p)), (s+1)*sector)
			dst := p[lo-off : hi-off]
			if sl.data == nil {
				clear(dst)
			} else {
				copy(dst, sl.data[lo-s*sector:hi-s*sector])
			}
		}
	}
	d.mu.Unlock()
	if err != nil {
		return n, err
	}
	return n, after()
}

// put caches [off, off+n) as data (nil: zeros), sector by sector.
func (d *disk) put(op string, data []byte, off, n int64) error {
	_, err := d.putGen(op, data, off, n)
	return err
}

// putGen is put, also returning the generation its slots have.
func (d *disk) putGen(op string, data []byte, off, n int64) (gen uint64, err error) {
	if err := d.check(off, n); err != nil {
		return 0, err
	}
	before, after := d.inject(op, true)
	if err := before(); err != nil {
		return 0, err
	}
	d.mu.Lock()
	if d.dead.Load() { // the power went while the call waited
		d.mu.Unlock()
		return 0, errDead
	}
	d.gen++
	gen = d.gen
	for s := off / sector; s*sector < off+n; s++ {
		lo, hi := max(off, s*sector), min(off+n, (s+1)*sector)
		sl := &slot{gen: d.gen}
		switch {
		case lo == s*sector && hi == (s+1)*sector && data == nil:
		case lo == s*sector && hi == (s+1)*sector:
			sl.data = slices.Clone(data[lo-off : hi-off])
		default:
			cur, err := d.sectorNow(s)
			if err != nil {
				d.mu.Unlock()
				return gen, err
			}
			if data == nil {
				clear(cur[lo-s*sector : hi-s*sector])
			} else {
				copy(cur[lo-s*sector:hi-s*sector], data[lo-off:hi-off])
			}
			sl.data = cur
		}
		d.cache[s] = sl
	}
	d.mu.Unlock()
	return gen, after()
}

func (d *disk) WriteAt(p []byte, off int64) (int, error) {
	if err := d.put("write", p, off, int64(len(p))); err != nil {
		return 0, err
	}
	return len(p), nil
}

func (d *disk) Discard(off, n int64) error             { return d.put("discard", nil, off, n) }
func (d *disk) Zero(off, n int64, mayPunch bool) error { return d.put("zero", nil, off, n) }

// WriteAtDSync is the FUA path: cache the write, then sync. Like
// backing.File's, which writes through an open file description of its
// own, it fails when a sync beside it failed and lost its sectors: the
// kernel reports a write-back error to every description, each once, so
// this write's sees it even if another sync's checked first.
func (d *disk) WriteAtDSync(p []byte, off int64) (int, error) {
	gen, err := d.putGen("write", p, off, int64(len(p)))
	if err != nil {
		return 0, err
	}
	if d.beside != nil {
		d.beside()
	}
	if err := d.Sync(); err != nil {
		return len(p), err
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	for s := off / sector; s*sector < off+int64(len(p)); s++ {
		if sl := d.cache[s]; sl != nil && sl.gen == gen && sl.lost {
			return len(p), errLostWriteBack
		}
	}
	return len(p), nil
}

// Sync writes back every cached sector that is not lost and fdatasyncs the
// file. An injected failure (before or after the write-back) loses every
// sector it covered.
func (d *disk) Sync() error {
	if d.dead.Load() {
		return errDead
	}
	if d.faults != nil {
		d.faults.nSync.Add(1)
	}
	fail := d.faults.hit(d.faults.syncFail)
	if fail {
		d.faults.nSyncFail.Add(1)
	}
	before, after := d.inject("sync", false)
	if err := before(); err != nil {
		return err
	}
	d.syncMu.Lock()
	defer d.syncMu.Unlock()
	d.mu.Lock()
	gen := d.gen
	type wb struct {
		s    int64
		data []byte
	}
	var todo []wb
	for s, sl := range d.cache {
		if !sl.lost && sl.gen <= gen {
			todo = append(todo, wb{s, sl.data})
		}
	}
	if fail {
		for _, w := range todo {
			d.cache[w.s].lost = true
		}
		d.mu.Unlock()
		return fmt.Errorf("injected sync failure: %w", syscall.EIO)
	}
	d.mu.Unlock()
	// Write back runs of consecutive sectors with one call each.
	slices.SortFunc(todo, func(a, b wb) int { return cmp.Compare(a.s, b.s) })
	var err error
	var run []byte
	for i, w := range todo {
		if w.data == nil {
			run = append(run, make([]byte, sector)...)
		} else {
			run = append(run, w.data...)
		}
		if i+1 < len(todo) && todo[i+1].s == w.s+1 {
			continue
		}
		first := w.s - int64(len(run)/sector) + 1
		if _, err = d.f.WriteAt(run, first*sector); err != nil {
			break
		}
		run = run[:0]
	}
	if err == nil {
		err = d.f.Sync()
	}
	d.mu.Lock()
	for _, w := range todo {
		if sl := d.cache[w.s]; sl != nil && sl.gen <= gen {
			if err != nil {
				sl.lost = true
			} else {
				delete(d.cache, w.s)
			}
		}
	}
	d.mu.Unlock()
	if err != nil {
		return err
	}
	if d.dead.Load() {
		return errDead
	}
	return after()
}

// Holes reports the sectors that read as zeros because they were never
// written or were discarded or zeroed, as far as the cache and the file
// tell. It fails like any call (before or after its work), and with
// probability holeLag it delays its answer after computing it, as a
// thread descheduled after lseek would, so that writes land between the
// answer and its use (the hole map must not keep such an answer).
func (d *disk) Holes(off, n int64) ([]backing.Range, error) {
	if err := d.check(off, n); err != nil {
		return nil, err
	}
	before, after := d.inject("holes", false)
	if err := before(); err != nil {
		return nil, err
	}
	out, err := d.holes(off, n)
	if f := d.faults; err == nil && f.hit(f.holeLag) {
		f.nHoleLag.Add(1)
		time.Sleep(rand.N(f.maxDelay + 1))
	}
	if err != nil {
		return nil, err
	}
	return out, after()
}

func (d *disk) holes(off, n int64) ([]backing.Range, error) {
	// Under mu, so that no write-back lands between asking the file and
	// looking at the cache.
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.dead.Load() {
		return nil, errDead
	}
	inner, err := d.f.Holes(off, n)
	if err != nil {
		return nil, err
	}
	var out []backing.Range
	add := func(lo, hi int64) {
		if k := len(out) - 1; k >= 0 && out[k].End() == lo {
			out[k].Len += hi - lo
			return
		}
		out = append(out, backing.Range{Off: lo, Len: hi - lo})
	}
	h := 0
	for pos := off; pos < off+n; {
		s := pos / sector
		hi := min(off+n, (s+1)*sector)
		for h < len(inner) && inner[h].End() <= pos {
			h++
		}
		hole := false
		if sl := d.cache[s]; sl != nil {
			hole = sl.data == nil && pos == s*sector && hi == (s+1)*sector
		} else {
			hole = h < len(inner) && inner[h].Off <= pos && inner[h].End() >= hi
		}
		if hole {
			add(pos, hi)
		}
		pos = hi
	}
	return out, nil
}

// peek reads the sector at off as the disk holds it, cache first, with no
// fault injected, for a wrong read's report; cached says whether the cache
// had it.
func (d *disk) peek(off int64) (b []byte, cached bool, err error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	sl := d.cache[off/sector]
	b, err = d.sectorNow(off / sector)
	return b, sl != nil, err
}

// probe says, for a wrong read's report, what sector s of export m holds
// below the server: on the disk (its cache, else its file) and in the hole
// map in front of it, so that a report tells a disk that lost a write from
// a read path that answered wrongly.
func (r *rig) probe(m *model, s int64) (out string) {
	defer func() {
		if v := recover(); v != nil { // an injected panic in the hole query
			out += fmt.Sprintf("; probe: %v", v)
		}
	}()
	out = "probe: not on a disk"
	tb := r.tables[m.name]
	if tb == nil { // the server is another process (TestSoakKill)
		return "probe: no disks here"
	}
	tb.Map(s*sector, sector, func(e table.Extent) bool {
		hm := backing.HoleMapOf(e.Dev)
		if hm == nil {
			return false
		}
		d, ok := hm.Unwrap().(*disk)
		if !ok {
			return false
		}
		b, cached, err := d.peek(e.Off)
		val, stamped := decode(b, m.export, s)
		out = fmt.Sprintf("probe: %s at %d holds op %d (stamp %v, cached %v, err %v, powered off %v)", d.Name(), e.Off, val, stamped, cached, err, d.dead.Load())
		holes, err := hm.Holes(e.Off, sector)
		out += fmt.Sprintf(", its hole map says holes %v (err %v)", holes, err)
		return false
	})
	return out
}

// TestCutMidRead: a read under way when the power goes fails; it does not
// answer from what the file held before the cache's writes, which a read
// after the cut would see (the soak once took such an answer for a wrong
// read).
func TestCutMidRead(t *testing.T) {
	d := testDisk(t, nil)
	written := make([]byte, sector)
	stamp(written, 1, 0, 7)
	if _, err := d.WriteAt(written, 0); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, sector)
	if _, err := d.ReadAt(got, 0); err != nil || !bytes.Equal(got, written) {
		t.Fatalf("read before the cut: %v, data equal %v", err, bytes.Equal(got, written))
	}
	d.waited = d.Crash
	if n, err := d.ReadAt(got, 0); !errors.Is(err, errDead) {
		t.Fatalf("read under way at the cut: %d bytes, err %v; want %v", n, err, errDead)
	}
}

// TestDurableWriteSeesLostSectors: a sync that fails beside a durable write
// loses the write's sectors; the write's own sync then finds nothing to
// write back and succeeds, and the write must fail all the same, as one
// through a description of its own does (backing.File.WriteAtDSync).
func TestDurableWriteSeesLostSectors(t *testing.T) {
	fl := &faults{syncFail: 1}
	d := testDisk(t, fl)
	d.beside = func() {
		fl.on.Store(true)
		if err := d.Sync(); err == nil {
			t.Error("the sync beside did not fail")
		}
		fl.on.Store(false)
	}
	p := make([]byte, sector)
	stamp(p, 1, 0, 7)
	if _, err := d.WriteAtDSync(p, 0); !errors.Is(err, errLostWriteBack) {
		t.Fatalf("durable write whose sectors a failed sync lost: %v; want %v", err, errLostWriteBack)
	}
	d.beside = nil
	if _, err := d.WriteAtDSync(p, 0); err != nil {
		t.Fatalf("durable write with nothing failing beside it: %v", err)
	}
}

// testDisk is a disk of four sectors over a file of the test's, with fl.
func testDisk(t *testing.T, fl *faults) *disk {
	t.Helper()
	path := filepath.Join(t.TempDir(), "d")
	if err := os.WriteFile(path, make([]byte, 4*sector), 0o644); err != nil {
		t.Fatal(err)
	}
	f, err := backing.OpenFile(path, false)
	if err != nil {
		t.Fatal(err)
	}
	d := newDisk(f, fl)
	t.Cleanup(func() { d.Close() })
	return d
}
