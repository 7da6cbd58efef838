package main

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"maps"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/nbdmapper/nbdmapper/control"
	"github.com/nbdmapper/nbdmapper/internal/testing/nbdtest"
	"github.com/nbdmapper/nbdmapper/internal/testing/sparse"
)

// lifecycle runs `nbdmapper OP ARGS... --control CTL` and returns its output.
func lifecycle(t *testing.T, ctl string, op string, args ...string) string {
	t.Helper()
	out, err := exec.Command(bin, append([]string{op, "--control", ctl}, args...)...).CombinedOutput()
	if err != nil {
		t.Fatalf("nbdmapper %s %s: %v\n%s", op, strings.Join(args, " "), err, out)
	}
	return string(out)
}

// TestLiveLifecycleUnderFio keeps fio's nbd engine writing and verifying
// (crc32c) through libnbd while the device's table changes under it, as
// dmsetup users change theirs: a reload that moves a segment to another
// file holding the same bytes, a suspend of 2 s, and a grow by appending
// a segment. Every fio run must end without an I/O error or a verify
// failure, and the suspend must have held requests rather than failed them.
func TestLiveLifecycleUnderFio(t *testing.T) {
	fio := nbdtest.Tool(t, "fio")
	dir := t.TempDir()
	for _, f := range []string{"a.img", "b.img", "a2.img", "c.img"} {
		sparse.Create(t, filepath.Join(dir, f), 4<<20)
	}
	writeFile(t, filepath.Join(dir, "t.table"), "0 8192 linear a.img 0\n8192 8192 linear b.img 0\n")
	writeFile(t, filepath.Join(dir, "moved.table"), "0 8192 linear a2.img 0\n8192 8192 linear b.img 0\n")
	writeFile(t, filepath.Join(dir, "grown.table"), "0 8192 linear a2.img 0\n8192 8192 linear b.img 0\n16384 8192 linear c.img 0\n")
	ctl := filepath.Join(dir, "control")
	s := nbdtest.Start(t, bin, dir, "--metrics", "off", "--control", ctl, "t=t.table")
	if out := lifecycle(t, ctl, "ls"); !strings.HasPrefix(out, "t\t(8388608 bytes)") {
		t.Fatalf("ls: %q", out)
	}

	var stop atomic.Bool
	runs := make(chan error, 1)
	var count int
	go func() {
		for !stop.Load() {
			out, err := exec.Command(fio, "--name=verify", "--ioengine=nbd", "--uri="+s.URI("t"),
				"--rw=randwrite", "--bs=4k", "--size=8m", "--iodepth=16", "--verify=crc32c",
				"--verify_fatal=1", "--verify_backlog=128", "--randrepeat=0", "--verify_state_save=0").CombinedOutput()
			count++
			if err != nil || !regexp.MustCompile(`err= 0`).Match(out) {
				runs <- fmt.Errorf("fio run %d: %v\n%s", count, err, out)
				return
			}
		}
		runs <- nil
	}()
	fioFailed := func() {
		t.Helper()
		select {
		case err := <-runs:
			if err != nil {
				t.Fatal(err)
			}
			t.Fatal("fio stopped early")
		default:
		}
	}

	// Move the first segment to a2.img: load the table, suspend (drains
	// and flushes), copy the bytes while nothing writes, resume.
	time.Sleep(200 * time.Millisecond) // let fio get going
	lifecycle(t, ctl, "reload", "t", filepath.Join(dir, "moved.table"))
	if out := lifecycle(t, ctl, "info", "t"); !strings.Contains(out, "LIVE & INACTIVE") {
		t.Fatalf("info after reload:\n%s", out)
	}
	lifecycle(t, ctl, "suspend", "t")
	copyFile(t, filepath.Join(dir, "a.img"), filepath.Join(dir, "a2.img"))
	lifecycle(t, ctl, "resume", "t")
	if out := lifecycle(t, ctl, "table", "t"); !strings.Contains(out, "a2.img") {
		t.Fatalf("table after resume: %q", out)
	}
	fioFailed()

	// Suspend for 2 s: requests wait, none fails.
	lifecycle(t, ctl, "suspend", "t")
	time.Sleep(2 * time.Second)
	lifecycle(t, ctl, "resume", "t")
	info := lifecycle(t, ctl, "info", "t")
	if m := regexp.MustCompile(`Requests held: +(\d+)`).FindStringSubmatch(info); m == nil || m[1] == "0" {
		t.Fatalf("the suspend held no request:\n%s", info)
	}
	fioFailed()

	// Grow by appending a segment; new connections see the new size.
	lifecycle(t, ctl, "reload", "t", filepath.Join(dir, "grown.table"))
	lifecycle(t, ctl, "resume", "t")
	out, err := exec.Command(nbdtest.Tool(t, "nbdinfo"), "--size", s.URI("t")).CombinedOutput()
	if err != nil || strings.TrimSpace(string(out)) != "12582912" {
		t.Fatalf("size after growing: %v %s", err, out)
	}

	stop.Store(true)
	select {
	case err := <-runs:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(5 * time.Minute):
		t.Fatal("fio never finished")
	}
	t.Logf("%d fio runs with verification, 0 errors\n%s", count, lifecycle(t, ctl, "info", "t"))
	s.Stop(t)
}

func copyFile(t *testing.T, from, to string) {
	t.Helper()
	src, err := os.Open(from)
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	dst, err := os.OpenFile(to, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer dst.Close()
	if _, err := io.Copy(dst, src); err != nil {
		t.Fatal(err)
	}
}

// serialWriter writes 4 KiB blocks at random to an export, one request at
// a time, so that at any instant at most one write is unacknowledged, and
// it knows which.
type serialWriter struct {
	mu      sync.Mutex
	acked   map[int64]ack // block -> the last acknowledged write
	pending int64         // block of the write in flight, or -1
	pendAck ack
	n       int // writes acknowledged
	stop    atomic.Bool
	blocks  atomic.Int64 // writes go to blocks [0, blocks)
	done    chan error
}

// ack is one write: its fill byte and its place in the sequence.
type ack struct {
	val byte
	seq int
}

const writerBlock = 4096

func startWriter(t *testing.T, socket, export string, blocks int64, seed uint64) *serialWriter {
	w := &serialWriter{acked: map[int64]ack{}, pending: -1, done: make(chan error, 1)}
	w.blocks.Store(blocks)
	go func() {
		c, err := nbdtest.DialNBD("unix", socket, export)
		if err != nil {
			w.done <- err
			return
		}
		defer c.Close()
		rng := rand.New(rand.NewPCG(seed, seed))
		for i := 1; !w.stop.Load(); i++ {
			blk, a := rng.Int64N(w.blocks.Load()), ack{val: byte(1 + i%250), seq: i}
			w.mu.Lock()
			w.pending, w.pendAck = blk, a
			w.mu.Unlock()
			c.Send(nbdtest.CmdWrite, 0, uint64(i), uint64(blk*writerBlock), writerBlock)
			c.Write(bytes.Repeat([]byte{a.val}, writerBlock))
			if r, err := c.Recv(); err != nil || r.Errno != 0 {
				w.done <- fmt.Errorf("write %d: %+v %v", i, r, err)
				return
			}
			w.mu.Lock()
			w.acked[blk], w.pending = a, -1
			w.n++
			w.mu.Unlock()
		}
		w.done <- nil
	}()
	return w
}

// state copies what the writer has acknowledged and has in flight.
func (w *serialWriter) state() (acked map[int64]ack, pending int64, pendAck ack) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return maps.Clone(w.acked), w.pending, w.pendAck
}

// waitMore waits for n more acknowledged writes.
func (w *serialWriter) waitMore(t *testing.T, n int) {
	w.mu.Lock()
	target := w.n + n
	w.mu.Unlock()
	nbdtest.Until(t, "the writer to make progress", func() bool {
		w.mu.Lock()
		defer w.mu.Unlock()
		return w.n >= target
	})
}

func (w *serialWriter) finish(t *testing.T) {
	w.stop.Store(true)
	if err := nbdtest.Recv(t, w.done, "the writer"); err != nil {
		t.Fatal(err)
	}
}

// readExport reads a whole export.
func readExport(t *testing.T, socket, export string, size int) []byte {
	t.Helper()
	c, err := nbdtest.DialNBD("unix", socket, export)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if err := c.Send(nbdtest.CmdRead, 0, 1, 0, uint32(size)); err != nil {
		t.Fatal(err)
	}
	if r, err := c.Recv(); err != nil || r.Errno != 0 {
		t.Fatalf("%s: read: %+v %v", export, r, err)
	}
	got := make([]byte, size)
	if _, err := io.ReadFull(c, got); err != nil {
		t.Fatal(err)
	}
	return got
}

// TestLiveSnapshot takes a snapshot of a device under write load the way
// `lvcreate -s` does: create the origin's "-real" device on the same table,
// suspend the origin, reload it as snapshot-origin of the real device,
// create the snapshot device, resume. The snapshot must hold exactly what
// the writer had acknowledged when the origin was suspended (a write in
// flight then may be either way), and the origin everything acknowledged
// to the end.
func TestLiveSnapshot(t *testing.T) {
	const size = 8 << 20
	dir := t.TempDir()
	s, ctl := liveSnapshot(t, dir, size)
	w := startWriter(t, s.Socket, "lv", size/writerBlock, 7)
	w.waitMore(t, 100)
	lifecycle(t, ctl, "create", "lv-real", filepath.Join(dir, "lv.table"))
	lifecycle(t, ctl, "suspend", "lv")
	acked, pending, pendAck := w.state()
	lifecycle(t, ctl, "reload", "lv", filepath.Join(dir, "origin.table"))
	lifecycle(t, ctl, "create", "snap", filepath.Join(dir, "snap.table"))
	lifecycle(t, ctl, "resume", "lv")
	w.waitMore(t, 100)
	w.finish(t)

	check := func(export string, acked map[int64]ack, pending int64, pendAck ack) {
		t.Helper()
		got := readExport(t, s.Socket, export, size)
		for blk := int64(0); blk < size/writerBlock; blk++ {
			b := got[blk*writerBlock : (blk+1)*writerBlock]
			a, ok := acked[blk]
			okVals := []byte{a.val}
			if !ok {
				okVals = []byte{0}
			}
			if blk == pending {
				okVals = append(okVals, pendAck.val)
			}
			if !bytes.Equal(b, bytes.Repeat(b[:1], writerBlock)) || !slices.Contains(okVals, b[0]) {
				t.Fatalf("%s: block %d holds %d..., want one of %v", export, blk, b[0], okVals)
			}
		}
	}
	check("snap", acked, pending, pendAck)
	acked, pending, pendAck = w.state()
	check("lv", acked, pending, pendAck)
	if out := lifecycle(t, ctl, "ls"); !strings.Contains(out, "snap\t") || !strings.Contains(out, "lv-real\t") {
		t.Fatalf("ls: %q", out)
	}
	// The snapshot's device can go; the real device cannot while the
	// origin and snapshot stack on it.
	if out, err := exec.Command(bin, "remove", "--control", ctl, "lv-real").CombinedOutput(); err == nil || !strings.Contains(string(out), "stacked") {
		t.Fatalf("removing lv-real under lv and snap: %v %s", err, out)
	}
	lifecycle(t, ctl, "remove", "snap")
	s.Stop(t)
}

// liveSnapshot serves lv (a linear table over disk.img) in dir, with the
// tables for lvcreate -s beside it: lv.table (also lv-real's),
// origin.table, snap.table.
func liveSnapshot(t *testing.T, dir string, size int64, flags ...string) (*nbdtest.Server, string) {
	sparse.Create(t, filepath.Join(dir, "disk.img"), size)
	sparse.Create(t, filepath.Join(dir, "cow.img"), size)
	writeFile(t, filepath.Join(dir, "lv.table"), fmt.Sprintf("0 %d linear disk.img 0\n", size/512))
	writeFile(t, filepath.Join(dir, "origin.table"), fmt.Sprintf("0 %d snapshot-origin /dev/mapper/lv-real\n", size/512))
	writeFile(t, filepath.Join(dir, "snap.table"), fmt.Sprintf("0 %d snapshot /dev/mapper/lv-real cow.img P 8\n", size/512))
	ctl := filepath.Join(dir, "control")
	args := append([]string{"--metrics", "off", "--control", ctl}, flags...)
	return nbdtest.Start(t, bin, dir, append(args, "lv=lv.table")...), ctl
}

// TestLVConvertMerge rolls a device back to its snapshot under write load,
// following lvconvert --merge's sequence for an active origin:
//
//	nbdmapper reload lv merge.table    snapshot-merge /dev/mapper/lv-real cow.img P 8:
//	                                   it names snap's COW, so it waits to take snap's store
//	nbdmapper suspend snap             (dm insists the handover's source is suspended)
//	nbdmapper suspend lv
//	nbdmapper resume lv                the store is handed over, the merge starts
//	nbdmapper remove snap
//	... until `status` shows allocated == metadata sectors (the merge is done):
//	nbdmapper reload lv lv.table       lv's table becomes lv-real's again
//	nbdmapper resume lv
//	nbdmapper remove lv-real
//
// The writer keeps writing lv throughout, from the merge on in its first
// quarter only. In the end lv must hold the snapshot's bytes, except for
// the blocks written after the suspend, which hold the last write.
func TestLVConvertMerge(t *testing.T) {
	const size = 8 << 20
	dir := t.TempDir()
	s, ctl := liveSnapshot(t, dir, size, "--merge-rate", "2M")
	writeFile(t, filepath.Join(dir, "merge.table"), fmt.Sprintf("0 %d snapshot-merge /dev/mapper/lv-real cow.img P 8\n", size/512))
	w := startWriter(t, s.Socket, "lv", size/writerBlock, 9)
	w.waitMore(t, 100)
	// lvcreate -s
	lifecycle(t, ctl, "create", "lv-real", filepath.Join(dir, "lv.table"))
	lifecycle(t, ctl, "suspend", "lv")
	lifecycle(t, ctl, "reload", "lv", filepath.Join(dir, "origin.table"))
	lifecycle(t, ctl, "create", "snap", filepath.Join(dir, "snap.table"))
	lifecycle(t, ctl, "resume", "lv")
	w.waitMore(t, 500) // the "failed upgrade": origin writes the merge must undo
	snap := readExport(t, s.Socket, "snap", size)

	// lvconvert --merge
	lifecycle(t, ctl, "reload", "lv", filepath.Join(dir, "merge.table"))
	lifecycle(t, ctl, "suspend", "snap")
	lifecycle(t, ctl, "suspend", "lv")
	w.blocks.Store(size / writerBlock / 4)
	before, _, _ := w.state()
	last := 0
	for _, a := range before {
		last = max(last, a.seq)
	}
	lifecycle(t, ctl, "resume", "lv")
	mid := status(t, ctl, "lv")
	lifecycle(t, ctl, "remove", "snap")
	nbdtest.Until(t, "the merge to finish", func() bool { return mergeFinished(t, status(t, ctl, "lv")) })
	w.waitMore(t, 50)
	lifecycle(t, ctl, "suspend", "lv")
	lifecycle(t, ctl, "reload", "lv", filepath.Join(dir, "lv.table"))
	lifecycle(t, ctl, "resume", "lv")
	lifecycle(t, ctl, "remove", "lv-real")
	w.waitMore(t, 50)
	w.finish(t)

	acked, _, _ := w.state()
	got := readExport(t, s.Socket, "lv", size)
	written := 0
	for blk := int64(0); blk < size/writerBlock; blk++ {
		want := snap[blk*writerBlock : (blk+1)*writerBlock]
		if a, ok := acked[blk]; ok && a.seq > last {
			want = bytes.Repeat([]byte{a.val}, writerBlock)
			written++
		}
		if b := got[blk*writerBlock : (blk+1)*writerBlock]; !bytes.Equal(b, want) {
			t.Fatalf("block %d holds %d..., want %d...", blk, b[0], want[0])
		}
	}
	if written == 0 || written > size/writerBlock/4+1 { // +1: the write in flight at the suspend
		t.Fatalf("%d blocks written during the merge, want some of the first quarter", written)
	}
	if mergeFinished(t, mid) {
		t.Fatalf("status just after the handover %q: the merge had nothing to do", mid)
	}
	t.Logf("status just after the handover: %q; %d blocks written since", mid, written)
	s.Stop(t)
}

// status is a device's status lines through the control socket.
func status(t *testing.T, ctl, name string) string {
	t.Helper()
	out, err := control.Call(ctl, control.Request{Op: "status", Name: name})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// mergeFinished reads a snapshot-merge status line: done when
// sectors_allocated equals metadata_sectors.
func mergeFinished(t *testing.T, status string) bool {
	var start, length, alloc, total, meta int64
	if _, err := fmt.Sscanf(status, "%d %d snapshot-merge %d/%d %d", &start, &length, &alloc, &total, &meta); err != nil {
		t.Fatalf("status %q: %v", status, err)
	}
	return alloc == meta
}

// A suspended device holds its clients' requests until a resume, which
// does not come at SIGTERM: serve then fails the held requests once
// --shutdown-timeout has passed, syncs the devices as usual, and exits 1
// naming the suspended device, rather than waiting for the requests for
// good (systemd would kill it, unsynced and saying nothing).
func TestShutdownWithHeldRequest(t *testing.T) {
	dir := t.TempDir()
	sparse.Create(t, filepath.Join(dir, "d.img"), 1<<20)
	writeFile(t, filepath.Join(dir, "d.table"), "0 2048 linear d.img 0\n")
	ctl := filepath.Join(dir, "control")
	s := nbdtest.Start(t, bin, dir, "--metrics", "off", "--control", ctl, "--shutdown-timeout", "1s", "d=d.table")
	nbdsh(t, s.URI("d"), "h.pwrite(b'w' * 4096, 0)")
	lifecycle(t, ctl, "suspend", "d")
	held := nbdtest.Nbdsh(t, "-u", s.URI("d"), "-c", "h.pread(4096, 0)")
	if err := held.Start(); err != nil {
		t.Fatal(err)
	}
	defer held.Process.Kill()
	nbdtest.Until(t, "the read to be held", func() bool {
		return strings.Contains(lifecycle(t, ctl, "info", "d"), "Requests held:     1\n")
	})
	s.Signal(syscall.SIGTERM)
	exited := make(chan error, 1)
	go func() { exited <- s.Wait() }()
	err := nbdtest.Recv(t, exited, "serve to exit after SIGTERM with a held request")
	var exit *exec.ExitError
	if !errors.As(err, &exit) || exit.ExitCode() != 1 {
		t.Fatalf("serve after SIGTERM: %v, want exit status 1\n%s", err, s.Stderr())
	}
	if logs := s.Stderr(); !strings.Contains(logs, "suspended device d") {
		t.Errorf("the exit does not name the suspended device:\n%s", logs)
	}
	if err := held.Wait(); err == nil {
		t.Error("the held read succeeded on a device that was never resumed")
	}
}
