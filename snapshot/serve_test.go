package snapshot

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/nbdmapper/nbdmapper/backing"
	"github.com/nbdmapper/nbdmapper/internal/testing/nbdtest"
)

// TestServeCrash is TestCrashSIGKILL through the real server: `nbdmapper
// serve` exports a snapshot and its snapshot-origin over real files, nbdsh
// streams the same writes over NBD (FLUSH on both exports after every 4th),
// and the server is SIGKILLed mid-stream. Every write acknowledged before
// the last acknowledged FLUSH must be in the snapshot (or origin), and
// neither device may show the other's writes.
func TestServeCrash(t *testing.T) {
	py := nbdtest.Python(t)
	bin := nbdtest.Binary(t)
	dir := t.TempDir()
	initial := crashInitial()
	origin, cow := filepath.Join(dir, "origin.img"), filepath.Join(dir, "cow.img")
	if err := os.WriteFile(origin, initial, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(cow, make([]byte, crashCOW), 0o644); err != nil {
		t.Fatal(err)
	}
	sectors := crashOrigin / 512
	write := func(name, text string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(text), 0o644); err != nil {
			t.Fatal(err)
		}
		return p
	}
	snapTable := write("snap.table", fmt.Sprintf("0 %d snapshot %s %s P 8\n", sectors, origin, cow))
	origTable := write("orig.table", fmt.Sprintf("0 %d snapshot-origin %s\n", sectors, origin))

	srv := nbdtest.Start(t, bin, dir, "--metrics=off", "snap="+snapTable, "orig="+origTable)

	// The plan: one line per op, "o|s offset byte".
	var plan strings.Builder
	for i := 0; i < crashOps; i++ {
		dev := "s"
		if i%3 == 0 {
			dev = "o"
		}
		fmt.Fprintf(&plan, "%s %d %d\n", dev, crashOff(i), crashData(i)[0])
	}
	planFile := write("plan", plan.String())
	script := write("writer.py", fmt.Sprintf(`
import nbd
hs = nbd.NBD(); hs.connect_uri("nbd+unix:///snap?socket=%[1]s")
ho = nbd.NBD(); ho.connect_uri("nbd+unix:///orig?socket=%[1]s")
for i, line in enumerate(open(%[2]q)):
    dev, off, b = line.split()
    (ho if dev == "o" else hs).pwrite(bytes([int(b)]) * %[3]d, int(off))
    if i %% 4 == 3:
        hs.flush(); ho.flush()
        print("flushed", i, flush=True)
`, srv.Socket, planFile, crashLen))
	writer := exec.Command(py, script)
	out, err := writer.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	var werr strings.Builder
	writer.Stderr = &werr
	if err := writer.Start(); err != nil {
		t.Fatal(err)
	}
	defer writer.Process.Kill()
	acked, flushes := -1, 0
	sc := bufio.NewScanner(out)
	for sc.Scan() {
		if n, ok := strings.CutPrefix(sc.Text(), "flushed "); ok {
			acked, _ = strconv.Atoi(n)
			if flushes++; flushes == 30 {
				break
			}
		}
	}
	srv.Signal(syscall.SIGKILL)
	srv.Wait()
	writer.Wait()
	if acked < 0 {
		t.Fatalf("no flush acknowledged; writer: %s\nserver log:\n%s", werr.String(), srv.Stderr())
	}
	t.Logf("server killed after op %d acknowledged", acked)

	originDev := openFile(t, origin)
	s, err := Open("crash", originDev, openFile(t, cow), Options{Type: Persistent, ChunkSectors: 8})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	verifyCrash(t, initial, readAll(t, s), readAll(t, originDev), acked)
}

// TestServeMergeSIGKILL merges a store through the real `nbdmapper serve`
// (a snapshot-merge export over real files, at a slow --merge-rate) and
// SIGKILLs the server at random points until the merge is done, serving
// the store again after each kill. In every life a client writes a block
// and flushes before the kill. After each kill the store, read as a
// snapshot, must show the snapshot's bytes with every flushed write; at
// the end the origin holds them. At least 20 kills must land mid-merge.
func TestServeMergeSIGKILL(t *testing.T) {
	const (
		originSize = 8 << 20
		cowSize    = 16 << 20
		block      = 4096
		minKills   = 20
	)
	bin := nbdtest.Binary(t)
	dir := t.TempDir()
	originPath, cowPath := filepath.Join(dir, "origin.img"), filepath.Join(dir, "cow.img")
	rng := rand.New(rand.NewPCG(16, 16))
	initial := make([]byte, originSize)
	fill(rng, initial)
	if err := os.WriteFile(originPath, initial, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(cowPath, make([]byte, cowSize), 0o644); err != nil {
		t.Fatal(err)
	}
	// The store: 1024 chunks copied out one at a time in random order (so
	// the merge has as many runs), and some snapshot writes.
	want := func() []byte {
		origin, cow := openFile(t, originPath), openFile(t, cowPath)
		s, err := Open("prep", origin, cow, Options{Type: Persistent, ChunkSectors: 8})
		if err != nil {
			t.Fatal(err)
		}
		defer s.Close()
		o, err := NewOrigin("prep-origin", origin, 0)
		if err != nil {
			t.Fatal(err)
		}
		p := make([]byte, block)
		for _, c := range rng.Perm(originSize / block)[:1024] {
			fill(rng, p)
			mustWrite(t, o, p, int64(c)*block)
		}
		for range 64 {
			fill(rng, p)
			mustWrite(t, s, p[:1000], rng.Int64N(originSize-1000))
		}
		if err := errors.Join(origin.Sync(), cow.Sync()); err != nil {
			t.Fatal(err)
		}
		return readAll(t, s)
	}()
	table := filepath.Join(dir, "merge.table")
	if err := os.WriteFile(table, fmt.Appendf(nil, "0 %d snapshot-merge %s %s P 8\n", originSize/512, originPath, cowPath), 0o644); err != nil {
		t.Fatal(err)
	}
	// view reads the store as a snapshot, as the merge device serves it,
	// and reports whether the merge is done.
	view := func() ([]byte, bool) {
		origin, err := backing.OpenFile(originPath, true)
		if err != nil {
			t.Fatal(err)
		}
		defer origin.Close()
		cow, err := backing.OpenFile(cowPath, true)
		if err != nil {
			t.Fatal(err)
		}
		defer cow.Close()
		s, err := Open("check", origin, cow, Options{Type: Persistent})
		if err != nil {
			t.Fatal(err)
		}
		defer s.Close()
		var alloc, total, meta int
		if _, err := fmt.Sscanf(s.Status(), "%d/%d %d", &alloc, &total, &meta); err != nil {
			t.Fatalf("status %q: %v", s.Status(), err)
		}
		return readAll(t, s), alloc == meta
	}

	kills := 0
	for life := 0; ; life++ {
		if life == 10000 {
			t.Fatalf("the merge is not done after %d lives", life)
		}
		srv := nbdtest.Start(t, bin, dir, "--metrics=off", "--control=off", "--merge-rate=512K", "merge="+table)
		c, err := nbdtest.Dial(srv.Socket, "merge")
		if err != nil {
			t.Fatal(err)
		}
		p := make([]byte, block)
		fill(rng, p)
		off := rng.Int64N(originSize/block) * block
		if err := c.Pwrite(p, off, false); err != nil {
			t.Fatalf("life %d: write: %v", life, err)
		}
		if err := c.Flush(); err != nil {
			t.Fatalf("life %d: flush: %v", life, err)
		}
		copy(want[off:], p)
		time.Sleep(time.Duration(rng.Int64N(int64(300 * time.Millisecond))))
		srv.Signal(syscall.SIGKILL)
		srv.Wait()
		c.Close()
		got, done := view()
		if !bytes.Equal(got, want) {
			i := 0
			for got[i] == want[i] {
				i++
			}
			t.Fatalf("after kill %d: the store shows other bytes than the snapshot's, first at %d", life, i)
		}
		if done {
			break
		}
		kills++
	}
	if kills < minKills {
		t.Fatalf("only %d kills landed mid-merge, want %d", kills, minKills)
	}
	if got := readAll(t, openFile(t, originPath)); !bytes.Equal(got, want) {
		t.Fatal("after the merge the origin does not hold the snapshot's bytes")
	}
	t.Logf("%d kills mid-merge", kills)
}

// TestServeSeveralSnapshots serves one origin with two snapshots, each on
// its own COW and with its own chunk size, through `nbdmapper serve`, and
// races clients on all three exports: origin writes must be copied out to
// each snapshot that lacks the chunk, whichever of them already has it.
// Every export must read back as its own model, also after the server is
// stopped and started again.
func TestServeSeveralSnapshots(t *testing.T) {
	const size, block = 4 << 20, 4096
	bin := nbdtest.Binary(t)
	dir := t.TempDir()
	rng := rand.New(rand.NewPCG(3, 1))
	initial := make([]byte, size)
	fill(rng, initial)
	origin := filepath.Join(dir, "origin.img")
	if err := os.WriteFile(origin, initial, 0o644); err != nil {
		t.Fatal(err)
	}
	var args []string
	for _, x := range []struct{ name, text string }{
		{"a", fmt.Sprintf("0 %d snapshot %s %s P 8\n", size/512, origin, filepath.Join(dir, "a.cow"))},
		{"b", fmt.Sprintf("0 %d snapshot %s %s PO 32\n", size/512, origin, filepath.Join(dir, "b.cow"))},
		{"o", fmt.Sprintf("0 %d snapshot-origin %s\n", size/512, origin)},
	} {
		if x.name != "o" {
			if err := os.WriteFile(filepath.Join(dir, x.name+".cow"), make([]byte, 2*size), 0o644); err != nil {
				t.Fatal(err)
			}
		}
		if err := os.WriteFile(filepath.Join(dir, x.name+".table"), []byte(x.text), 0o644); err != nil {
			t.Fatal(err)
		}
		args = append(args, x.name+"="+filepath.Join(dir, x.name+".table"))
	}
	models := map[string][]byte{"a": bytes.Clone(initial), "b": bytes.Clone(initial), "o": bytes.Clone(initial)}
	srv := nbdtest.Start(t, bin, dir, append([]string{"--metrics=off", "--control=off"}, args...)...)
	// Each client owns the blocks b with b % 6 == its number, so that
	// writes to one block are never concurrent; two clients per export.
	var wg sync.WaitGroup
	var mu sync.Mutex
	for i, name := range []string{"a", "b", "o", "a", "b", "o"} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c, err := nbdtest.Dial(srv.Socket, name)
			if err != nil {
				t.Error(err)
				return
			}
			defer c.Close()
			r := rand.New(rand.NewPCG(uint64(i), 9))
			p := make([]byte, block)
			for range 150 {
				blk := int64(r.IntN(size/block/6)*6 + i)
				fill(r, p)
				n := 512 * (1 + r.Int64N(8))
				if err := c.Pwrite(p[:n], blk*block, false); err != nil {
					t.Error(err)
					return
				}
				mu.Lock()
				copy(models[name][blk*block:], p[:n])
				mu.Unlock()
			}
			if err := c.Flush(); err != nil {
				t.Error(err)
			}
		}()
	}
	nbdtest.Wait(t, &wg, "the clients")
	// The snapshots never see the origin's writes: their models are the
	// initial bytes with their own writes; the origin's writes are in o.
	check := func(when string) {
		for name, want := range models {
			if got := readExport(t, srv.Socket, name, size); !bytes.Equal(got, want) {
				t.Fatalf("%s: export %s differs from its model", when, name)
			}
		}
	}
	check("served")
	srv.Signal(syscall.SIGTERM)
	srv.Wait()
	srv = nbdtest.Start(t, bin, dir, append([]string{"--metrics=off", "--control=off"}, args...)...)
	check("served again")
}

// TestServeBlockStatus: nbdinfo --map on a snapshot over a sparse origin
// shows holes where the origin has one and the COW no exception.
func TestServeBlockStatus(t *testing.T) {
	nbdinfo := nbdtest.Tool(t, "nbdinfo")
	bin := nbdtest.Binary(t)
	dir := t.TempDir()
	origin, cow := filepath.Join(dir, "origin.img"), filepath.Join(dir, "cow.img")
	for _, f := range []string{origin, cow} {
		if err := os.WriteFile(f, nil, 0o644); err != nil {
			t.Fatal(err)
		}
		if err := os.Truncate(f, 4<<20); err != nil {
			t.Fatal(err)
		}
	}
	o := openFile(t, origin)
	mustWrite(t, o, bytes.Repeat([]byte{1}, 1<<20), 1<<20) // data in [1M, 2M)
	o.Close()
	table := filepath.Join(dir, "snap.table")
	if err := os.WriteFile(table, fmt.Appendf(nil, "0 8192 snapshot %s %s P 128\n", origin, cow), 0o644); err != nil { // 64 KiB chunks
		t.Fatal(err)
	}
	srv := nbdtest.Start(t, bin, dir, "--metrics=off", "--control=off", "snap="+table)
	c, err := nbdtest.Dial(srv.Socket, "snap")
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Pwrite([]byte("x"), 3<<20+100, false); err != nil { // chunk 48: [3M, 3M+64K)
		t.Fatal(err)
	}
	c.Close()
	out, err := exec.Command(nbdinfo, "--map", srv.URI("snap")).CombinedOutput()
	if err != nil {
		t.Fatalf("nbdinfo --map: %v\n%s", err, out)
	}
	var got []string
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		got = append(got, strings.Join(strings.Fields(line), " "))
	}
	want := []string{
		"0 1048576 3 hole,zero",
		"1048576 1048576 0 data",
		"2097152 1048576 3 hole,zero",
		"3145728 65536 0 data",
		"3211264 983040 3 hole,zero",
	}
	if strings.Join(got, "\n") != strings.Join(want, "\n") {
		t.Fatalf("nbdinfo --map:\n%s\nwant\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
}

// readExport reads a whole export over NBD.
func readExport(t *testing.T, socket, export string, size int) []byte {
	t.Helper()
	c, err := nbdtest.Dial(socket, export)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	p := make([]byte, size)
	if err := c.Pread(p, 0); err != nil {
		t.Fatal(err)
	}
	return p
}
