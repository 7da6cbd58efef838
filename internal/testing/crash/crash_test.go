package crash_test

import (
	"context"
	"encoding/binary"
	"flag"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/nbdmapper/nbdmapper/backing"
	"github.com/nbdmapper/nbdmapper/discard"
	"github.com/nbdmapper/nbdmapper/flush"
	"github.com/nbdmapper/nbdmapper/internal/testing/crash"
	"github.com/nbdmapper/nbdmapper/internal/testing/nbdtest"
	"github.com/nbdmapper/nbdmapper/internal/testing/sparse"
	"github.com/nbdmapper/nbdmapper/mapped"
	"github.com/nbdmapper/nbdmapper/nbdtarget"
	"github.com/nbdmapper/nbdmapper/snapshot"
	"github.com/nbdmapper/nbdmapper/table"
)

// The long run (bench/crash.sh) raises these.
var (
	randomImages = flag.Int("crash.random", 2, "random crash images per crash point, besides the durable-only and all-writes ones")
	opsPerClient = flag.Int("crash.ops", 40, "requests per client connection in each workload")
	rounds       = flag.Int("crash.rounds", 1, "times each workload runs, with a different seed each time")
	minImages    = flag.Int("crash.min", 1000, "fail unless at least this many crash images were checked")
)

// workload is a set of tables served by one server, the files under them,
// and the exports clients write to.
type workload struct {
	name  string
	files map[string]int64 // file key -> size; tables name a file as @key
	// init are the tables whose virtual devices are filled with
	// crash.Pattern(0, sector) before the run (snapshots show their
	// origin's contents, so they need none of their own).
	init []def
	// defs are the tables served; views the exports clients write.
	defs  []def
	views []viewSpec
	// check, if set, are the tables crash images are read through (by
	// defs' names), instead of defs.
	check []def
	// prep, if set, makes the stores instead of loading defs once.
	prep func(t *testing.T, files map[string]string)
	// batched workloads must have committed some exceptions together.
	batched bool
	// awaitMerge keeps the server up after the clients until every
	// snapshot-merge line reports its merge done.
	awaitMerge bool
}

type def struct{ name, text string }

type viewSpec struct {
	name    string
	clients int
	stripe  int // sectors: sector s belongs to client (s/stripe) % clients
}

func workloads() []workload {
	var lin strings.Builder
	// 64 lines of 16 sectors alternating between two disks, each disk's
	// lines in reverse order, so that neighbours are far apart.
	for i := range 64 {
		fmt.Fprintf(&lin, "%d 16 linear @d%d %d\n", i*16, i%2, (31-i/2)*16)
	}
	var base strings.Builder
	for i := range 32 {
		fmt.Fprintf(&base, "%d 64 linear @disk %d\n", i*64, ((i*7)%32)*64)
	}
	return []workload{
		{
			name:  "linear",
			files: map[string]int64{"d0": 256 << 10, "d1": 256 << 10},
			init:  []def{{"lin", lin.String()}},
			defs:  []def{{"lin", lin.String()}},
			views: []viewSpec{{"lin", 4, 8}},
		},
		{
			name:  "striped",
			files: map[string]int64{"s0": 256 << 10, "s1": 256 << 10, "s2": 256 << 10},
			init:  []def{{"str", "0 1536 striped 3 8 @s0 0 @s1 0 @s2 0\n"}},
			defs:  []def{{"str", "0 1536 striped 3 8 @s0 0 @s1 0 @s2 0\n"}},
			views: []viewSpec{{"str", 4, 8}},
		},
		{
			// Chunks of 2 sectors and clients owning every other sector:
			// two origin clients and two snapshot clients race on the
			// first write of the same chunk; 64 exceptions fill an area.
			name:  "snapshot",
			files: map[string]int64{"origin": 256 << 10, "cow": 1 << 20},
			init:  []def{{"init", "0 512 linear @origin 0\n"}},
			defs: []def{
				{"snap", "0 512 snapshot @origin @cow P 2\n"},
				{"orig", "0 512 snapshot-origin @origin\n"},
			},
			views: []viewSpec{{"orig", 2, 1}, {"snap", 2, 1}},
		},
		{
			// Six snapshot clients and two origin clients, each owning
			// whole chunks: their first writes race to commit, and the
			// exceptions that are ready together share one commit.
			name:  "batched",
			files: map[string]int64{"origin": 256 << 10, "cow": 1 << 20},
			init:  []def{{"init", "0 512 linear @origin 0\n"}},
			defs: []def{
				{"snap", "0 512 snapshot @origin @cow P 2\n"},
				{"orig", "0 512 snapshot-origin @origin\n"},
			},
			views:   []viewSpec{{"snap", 6, 2}, {"orig", 2, 2}},
			batched: true,
		},
		{
			// A snapshot merged back while clients write to it. prep
			// copies every chunk out, one at a time in random order, so
			// that the merge has 128 runs of one chunk, each copied,
			// synced and cleared while the clients write; the images are
			// read as the snapshot (the same view the merge serves).
			name:  "merge",
			files: map[string]int64{"origin": 128 << 10, "cow": 512 << 10},
			init:  []def{{"init", "0 256 linear @origin 0\n"}},
			defs:  []def{{"merge", "0 256 snapshot-merge @origin @cow P 2\n"}},
			check: []def{{"merge", "0 256 snapshot @origin @cow P 2\n"}},
			views: []viewSpec{{"merge", 4, 2}},
			prep:  copyEveryChunkOut,
			// The log goes on until the merge is done, so that the merge
			// of the clients' acknowledged writes is cut too.
			awaitMerge: true,
		},
		{
			name:  "stacked",
			files: map[string]int64{"disk": 1 << 20, "cow": 2 << 20},
			init:  []def{{"base", base.String()}},
			defs: []def{
				{"base", base.String()},
				{"snap", "0 2048 snapshot /dev/mapper/base @cow P 8\n"},
				{"orig", "0 2048 snapshot-origin /dev/mapper/base\n"},
			},
			views: []viewSpec{{"orig", 2, 4}, {"snap", 2, 4}},
		},
	}
}

// TestCrashPoints runs each workload through the real server and checks
// every crash image the replayer builds from its write log.
func TestCrashPoints(t *testing.T) {
	total, lost := 0, 0
	for _, w := range workloads() {
		for round := range *rounds {
			t.Run(fmt.Sprintf("%s/%d", w.name, round), func(t *testing.T) {
				images, bad := runWorkload(t, w, uint64(round))
				total += images
				lost += bad
			})
		}
	}
	t.Logf("%d crash images checked in all, %d of them lost acknowledged writes", total, lost)
	if total < *minImages && !t.Failed() {
		t.Errorf("only %d crash images checked, want at least %d", total, *minImages)
	}
}

// paths maps file keys to files in dir.
func paths(dir, prefix string, w workload) map[string]string {
	m := make(map[string]string)
	for k := range w.files {
		m[k] = filepath.Join(dir, prefix+k+".img")
	}
	return m
}

// tableDefs turns defs into table.Defs naming the files in paths.
func tableDefs(ds []def, paths map[string]string) []table.Def {
	var out []table.Def
	for _, d := range ds {
		text := d.text
		for k, p := range paths {
			text = strings.ReplaceAll(text, "@"+k+" ", p+" ")
			text = strings.ReplaceAll(text, "@"+k+"\n", p+"\n")
		}
		out = append(out, table.Def{Name: d.name, File: d.name + ".table", Text: strings.NewReader(text)})
	}
	return out
}

// setup creates the files, fills the init tables' devices with the initial
// pattern, creates the snapshot stores by loading the tables once, syncs,
// and returns each file's contents.
func setup(t *testing.T, w workload, files map[string]string) map[string][]byte {
	for k, size := range w.files {
		sparse.Create(t, files[k], size)
	}
	pool := &backing.Pool{}
	devs, err := table.ParseSet(tableDefs(w.init, files), pool, newDevice(flush.New()))
	if err != nil {
		t.Fatal(err)
	}
	for _, d := range devs {
		p := make([]byte, d.Size())
		for s := range len(p) / crash.SectorSize {
			crash.Pattern(0, uint64(s), p[s*crash.SectorSize:])
		}
		if err := d.Write(p, 0, false); err != nil {
			t.Fatal(err)
		}
		d.Close()
	}
	if w.prep != nil {
		pool.Close()
		w.prep(t, files)
		pool = &backing.Pool{}
	} else {
		devs, err = table.ParseSet(tableDefs(w.defs, files), pool, newDevice(flush.New()))
		if err != nil {
			t.Fatal(err)
		}
		for _, d := range devs {
			d.Close()
		}
	}
	if err := pool.Sync(context.Background()); err != nil {
		t.Fatal(err)
	}
	pool.Close()
	initial := make(map[string][]byte)
	for k, p := range files {
		b, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		initial[k] = b
	}
	return initial
}

// runWorkload serves w over a write log, drives it, then checks every
// crash image. It returns the images checked and how many lost writes.
func runWorkload(t *testing.T, w workload, round uint64) (images, lostImages int) {
	return runWorkloadDump(t, w, round, nil)
}

// runWorkloadDump is runWorkload that also calls dump with each image, the
// image files (by file key) and every view's status lines and contents,
// while the files hold the image.
func runWorkloadDump(t *testing.T, w workload, round uint64, dump func(im crash.Image, imgs map[string]string, views map[string]viewImage) error) (images, lostImages int) {
	dir := t.TempDir()
	files := paths(dir, "", w)
	initial := setup(t, w, files)

	// A merge runs as fast as the disks let it, among the clients.
	snapshot.Configure(snapshot.Config{MergeRate: 0})
	defer snapshot.Configure(snapshot.Config{MergeRate: snapshot.DefaultMergeRate})
	before := snapshot.ReadStats()
	wlog := backing.NewWriteLog()
	engine := flush.New()
	pool := &backing.Pool{Wrap: func(d backing.Device) backing.Device { return engine.Track(wlog.Wrap(d)) }}
	defs := tableDefs(w.defs, files)
	devs, err := table.ParseSet(defs, pool, newDevice(engine))
	if err != nil {
		t.Fatal(err)
	}
	var exports []*nbdtarget.Export
	for i, d := range devs {
		exports = append(exports, &nbdtarget.Export{Name: defs[i].Name, Dev: d})
	}
	srv := &nbdtarget.Server{Exports: exports}
	socket := filepath.Join(dir, "nbd.sock")
	l, err := net.Listen("unix", socket)
	if err != nil {
		t.Fatal(err)
	}
	served := make(chan error, 1)
	go func() { served <- srv.Serve(l) }()

	m := crash.NewModel()
	for _, v := range w.views {
		for i, d := range defs {
			if d.Name == v.name {
				m.AddView(v.name, devs[i].Size())
			}
		}
	}
	drive(t, w, m, wlog, socket, round)
	if w.awaitMerge {
		for _, d := range devs {
			nbdtest.Until(t, d.DeviceName()+"'s merge", func() bool { return mergeDone(d.Table().Status()) })
		}
	}

	if err := srv.Shutdown(context.Background()); err != nil {
		t.Fatal(err)
	}
	if err := <-served; err != nil && err != nbdtarget.ErrServerClosed {
		t.Fatal(err)
	}
	for _, d := range devs {
		d.Close()
	}
	pool.Close()
	if t.Failed() {
		return 0, 0
	}
	after := snapshot.ReadStats()
	commits, exceptions := after.Commits-before.Commits, after.Exceptions-before.Exceptions
	if w.batched && exceptions <= commits {
		t.Errorf("%s: %d exceptions in %d commits: none was committed with another", w.name, exceptions, commits)
	}
	merged := after.MergedChunks - before.MergedChunks
	entries := wlog.Entries()
	syncs, writes := 0, 0
	for _, e := range entries {
		switch e.Op {
		case backing.OpSync:
			syncs++
		case backing.OpWrite:
			writes++
		}
	}

	// Image files start as the devices were before the run.
	imgs := paths(dir, "crash-", w)
	var order []string // image file of each log device
	for k, p := range imgs {
		if err := os.WriteFile(p, initial[k], 0o644); err != nil {
			t.Fatal(err)
		}
	}
	for _, d := range wlog.Devices() {
		for k, p := range files {
			if d.Name() == p {
				order = append(order, imgs[k])
			}
		}
	}
	r, err := crash.NewReplayer(entries, order, rand.New(rand.NewPCG(round, 42)))
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	points := r.Points(m.FlushPositions())
	var sum crash.Result
	images, err = r.Run(points, *randomImages, func(im crash.Image) error {
		views := make(map[string]viewImage)
		res, err := checkImage(w, imgs, m, im.Pos, func(name string, v viewImage) { views[name] = v })
		if err != nil {
			return err
		}
		if dump != nil {
			if err := dump(im, imgs, views); err != nil {
				return err
			}
		}
		if res.Lost > 0 {
			lostImages++
			if lostImages <= 3 {
				t.Errorf("%v: %d sectors lost (%d stale, %d garbage, %d foreign); first: %s",
					im, res.Lost, res.Stale, res.Garbage, res.Foreign, res.First)
			}
		}
		sum.Add(res)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("%s: %d log entries (%d writes, %d syncs), %d crash points, %d images; "+
		"%d sectors checked, %d of them holding a write that had to be durable; "+
		"%d images lost acknowledged writes (%d sectors: %d stale, %d garbage, %d foreign); "+
		"%d exceptions in %d commits, %d chunks merged",
		w.name, len(entries), writes, syncs, len(points), images,
		sum.Sectors, sum.Required, lostImages, sum.Lost, sum.Stale, sum.Garbage, sum.Foreign,
		exceptions, commits, merged)
	if w.prep != nil && merged == 0 {
		t.Errorf("%s: nothing was merged while the clients wrote", w.name)
	}
	if sum.Required == 0 {
		t.Errorf("no sector ever had to be durable: the workload proved nothing")
	}
	return images, lostImages
}

// drive runs every view's clients at once until each has sent its
// requests: writes (some FUA) inside the sectors it owns, and flushes.
func drive(t *testing.T, w workload, m *crash.Model, wlog *backing.WriteLog, socket string, round uint64) {
	var wg sync.WaitGroup
	for vi, v := range w.views {
		for c := range v.clients {
			wg.Add(1)
			go func() {
				defer wg.Done()
				nc, err := nbdtest.Dial(socket, v.name)
				if err != nil {
					t.Errorf("%s client %d: %v", v.name, c, err)
					return
				}
				defer nc.Close()
				rng := rand.New(rand.NewPCG(round, uint64(vi*100+c)))
				stripes := int(nc.Size()) / crash.SectorSize / v.stripe / v.clients
				for range *opsPerClient {
					if rng.IntN(100) < 15 {
						covers := m.FlushSent()
						if err := nc.Flush(); err != nil {
							t.Errorf("%s client %d: flush: %v", v.name, c, err)
							return
						}
						m.Flushed(v.name, covers, wlog.Len())
						continue
					}
					first := (rng.IntN(stripes)*v.clients + c) * v.stripe
					n := 1 + rng.IntN(v.stripe)
					first += rng.IntN(v.stripe - n + 1)
					fua := rng.IntN(100) < 10
					wr := m.Begin(v.name, int64(first*crash.SectorSize), n*crash.SectorSize)
					if err := nc.Pwrite(wr.Data, wr.Off, fua); err != nil {
						t.Errorf("%s client %d: write: %v", v.name, c, err)
						return
					}
					m.Acked(wr, fua, wlog.Len())
				}
			}()
		}
	}
	wg.Wait()
}

// viewImage is a view as nbdmapper reads it from a crash image.
type viewImage struct {
	status string // the table's status lines
	data   []byte
}

// checkImage loads the workload's tables over the image files read-only,
// as `nbdmapper check` and serve would, checks each snapshot store against
// the kernel's reading of it, and compares every view with the model,
// passing each view to seen.
func checkImage(w workload, imgs map[string]string, m *crash.Model, pos int, seen func(string, viewImage)) (crash.Result, error) {
	var sum crash.Result
	pool := &backing.Pool{ReadOnly: true}
	defer pool.Close()
	defs := tableDefs(w.defs, imgs)
	if w.check != nil {
		defs = tableDefs(w.check, imgs)
	}
	devs, err := table.ParseSet(defs, pool, newDevice(flush.New()))
	if err != nil {
		return sum, fmt.Errorf("tables do not load: %w", err)
	}
	defer func() {
		for _, d := range devs {
			d.Close()
		}
	}()
	for i, d := range devs {
		tab := d.Table()
		for _, l := range tab.Lines {
			if l.Target.Type() != "snapshot" {
				continue
			}
			want, err := kernelStatus(imgs["cow"])
			if err != nil {
				return sum, err
			}
			if got := l.Target.Status(); got != want {
				return sum, fmt.Errorf("%s: snapshot status %q, the kernel would report %q", defs[i].Name, got, want)
			}
		}
		name := defs[i].Name
		isView := false
		for _, v := range w.views {
			isView = isView || v.name == name
		}
		if !isView {
			continue
		}
		p := make([]byte, tab.Size())
		if _, err := d.Read(p, 0); err != nil {
			return sum, fmt.Errorf("%s: read: %w", name, err)
		}
		sum.Add(m.Check(name, pos, p))
		seen(name, viewImage{status: tab.Status(), data: p})
	}
	return sum, nil
}

// kernelStatus reads a persistent COW store the way the kernel's
// dm-snap-persistent.c does (read_header, read_exceptions) and returns the
// status line dm-snapshot would print for it: "<allocated>/<total>
// <metadata>" in sectors, or "Invalid". It is written from the format,
// independently of package snapshot.
func kernelStatus(cowPath string) (string, error) {
	b, err := os.ReadFile(cowPath)
	if err != nil {
		return "", err
	}
	le32 := func(off int) uint64 { return uint64(binary.LittleEndian.Uint32(b[off:])) }
	le64 := func(off uint64) uint64 { return binary.LittleEndian.Uint64(b[off:]) }
	if le32(0) != 0x70416e53 || le32(8) != 1 {
		return "", fmt.Errorf("COW header: magic %#x version %d: the kernel would refuse the store", le32(0), le32(8))
	}
	if le32(4) == 0 {
		return "Invalid", nil
	}
	chunk := le32(12) * 512
	perArea := chunk / 16
	nextFree := uint64(2) // the header and area 0
	area := uint64(0)
	for ; ; area++ {
		at := (1 + area*(perArea+1)) * chunk
		if at+chunk > uint64(len(b)) {
			return "", fmt.Errorf("COW metadata area %d beyond the device", area)
		}
		full := true
		for i := range perArea {
			e := at + i*16
			newChunk := le64(e + 8)
			if newChunk == 0 {
				full = false
				break
			}
			nextFree = max(nextFree, newChunk+1)
		}
		if !full {
			break
		}
	}
	if nextFree%(perArea+1) == 1 { // the next free chunk is a metadata area
		nextFree++
	}
	sectors := chunk / 512
	return fmt.Sprintf("%d/%d %d", nextFree*sectors, uint64(len(b))/512, (area+2)*sectors), nil
}

// mergeDone reads a table's status lines: every snapshot-merge line's
// merge is done when its allocated sectors equal its metadata sectors.
func mergeDone(status string) bool {
	for _, line := range strings.Split(strings.TrimSpace(status), "\n") {
		f := strings.Fields(line)
		if len(f) < 5 || f[2] != "snapshot-merge" {
			continue
		}
		if alloc, _, ok := strings.Cut(f[3], "/"); !ok || alloc != f[4] {
			return false
		}
	}
	return true
}

// copyEveryChunkOut makes the merge workload's store: the snapshot of
// the origin (which holds Pattern(0)) gets every chunk, copied out by
// one-chunk origin writes in random order; the origin is then overwritten
// with data of a write no view ever makes, which a wrong merge would show.
func copyEveryChunkOut(t *testing.T, files map[string]string) {
	pool := &backing.Pool{}
	defer pool.Close()
	devs, err := table.ParseSet(tableDefs([]def{
		{"snap", "0 256 snapshot @origin @cow P 2\n"},
		{"orig", "0 256 snapshot-origin @origin\n"},
	}, files), pool, newDevice(flush.New()))
	if err != nil {
		t.Fatal(err)
	}
	p := make([]byte, 2*crash.SectorSize)
	for _, c := range rand.New(rand.NewPCG(3, 3)).Perm(128) {
		for i := range 2 {
			crash.Pattern(1<<40, uint64(2*c+i), p[i*crash.SectorSize:])
		}
		if err := devs[1].Write(p, int64(c)*int64(len(p)), false); err != nil {
			t.Fatal(err)
		}
	}
	for _, d := range devs {
		d.Close()
	}
	if err := pool.Sync(context.Background()); err != nil {
		t.Fatal(err)
	}
}

// newDevice makes each table of a set a mapped device on the flush engine f.
func newDevice(f *flush.Engine) func(name string, t *table.Table) *mapped.Device {
	d := discard.New()
	return func(name string, t *table.Table) *mapped.Device { return mapped.New(name, t, f, d) }
}
