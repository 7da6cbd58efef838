package main

import (
	"bytes"
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
	"testing"
	"time"

	"github.com/nbdmapper/nbdmapper/internal/nbdtest"
	"github.com/nbdmapper/nbdmapper/internal/sparse"
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

// TestLiveSnapshot takes a snapshot of a device under write load the way
// `lvcreate -s` does: create the origin's "-real" device on the same table,
// suspend the origin, reload it as snapshot-origin of the real device,
// create the snapshot device, resume. The snapshot must hold exactly what
// the writer had acknowledged when the origin was suspended (a write in
// flight then may be either way), and the origin everything acknowledged
// to the end.
func TestLiveSnapshot(t *testing.T) {
	const size, block = 8 << 20, 4096
	dir := t.TempDir()
	sparse.Create(t, filepath.Join(dir, "disk.img"), size)
	sparse.Create(t, filepath.Join(dir, "cow.img"), size)
	writeFile(t, filepath.Join(dir, "lv.table"), fmt.Sprintf("0 %d linear disk.img 0\n", size/512))
	writeFile(t, filepath.Join(dir, "origin.table"), fmt.Sprintf("0 %d snapshot-origin /dev/mapper/lv-real\n", size/512))
	writeFile(t, filepath.Join(dir, "snap.table"), fmt.Sprintf("0 %d snapshot /dev/mapper/lv-real cow.img P 8\n", size/512))
	ctl := filepath.Join(dir, "control")
	s := nbdtest.Start(t, bin, dir, "--metrics", "off", "--control", ctl, "lv=lv.table")

	// The writer: one request at a time, so that at any instant at most
	// one write is unacknowledged, and it knows which.
	type state struct {
		acked   map[int64]byte // block -> fill byte of the last acknowledged write
		pending int64          // block of the write in flight, or -1
		pendVal byte
	}
	var mu sync.Mutex
	st := state{acked: map[int64]byte{}, pending: -1}
	var stop atomic.Bool
	writerDone := make(chan error, 1)
	go func() {
		c, err := nbdtest.DialNBD("unix", s.Socket, "lv")
		if err != nil {
			writerDone <- err
			return
		}
		defer c.Close()
		rng := rand.New(rand.NewPCG(7, 7))
		for i := 0; !stop.Load(); i++ {
			blk, val := rng.Int64N(size/block), byte(1+i%250)
			mu.Lock()
			st.pending, st.pendVal = blk, val
			mu.Unlock()
			c.Send(nbdtest.CmdWrite, 0, uint64(i), uint64(blk*block), block)
			c.Write(bytes.Repeat([]byte{val}, block))
			if r, err := c.Recv(); err != nil || r.Errno != 0 {
				writerDone <- fmt.Errorf("write %d: %+v %v", i, r, err)
				return
			}
			mu.Lock()
			st.acked[blk], st.pending = val, -1
			mu.Unlock()
		}
		writerDone <- nil
	}()
	until := func(cond func() bool) {
		deadline := time.Now().Add(60 * time.Second)
		for !cond() {
			if time.Now().After(deadline) {
				t.Fatal("the writer made no progress")
			}
			time.Sleep(time.Millisecond)
		}
	}
	until(func() bool { mu.Lock(); defer mu.Unlock(); return len(st.acked) > 100 })

	lifecycle(t, ctl, "create", "lv-real", filepath.Join(dir, "lv.table"))
	lifecycle(t, ctl, "suspend", "lv")
	mu.Lock()
	atSuspend := state{acked: maps.Clone(st.acked), pending: st.pending, pendVal: st.pendVal}
	mu.Unlock()
	lifecycle(t, ctl, "reload", "lv", filepath.Join(dir, "origin.table"))
	lifecycle(t, ctl, "create", "snap", filepath.Join(dir, "snap.table"))
	lifecycle(t, ctl, "resume", "lv")
	n := func() int { mu.Lock(); defer mu.Unlock(); return len(st.acked) }()
	until(func() bool { mu.Lock(); defer mu.Unlock(); return len(st.acked) > n+100 })
	stop.Store(true)
	if err := <-writerDone; err != nil {
		t.Fatal(err)
	}

	check := func(export string, want state) {
		t.Helper()
		c, err := nbdtest.DialNBD("unix", s.Socket, export)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		if err := c.Send(nbdtest.CmdRead, 0, 1, 0, size); err != nil {
			t.Fatal(err)
		}
		if r, err := c.Recv(); err != nil || r.Errno != 0 {
			t.Fatalf("%s: read: %+v %v", export, r, err)
		}
		got := make([]byte, size)
		if _, err := io.ReadFull(c, got); err != nil {
			t.Fatal(err)
		}
		for blk := int64(0); blk < size/block; blk++ {
			b := got[blk*block : (blk+1)*block]
			val, ok := want.acked[blk]
			okVals := []byte{val}
			if !ok {
				okVals = []byte{0}
			}
			if blk == want.pending {
				okVals = append(okVals, want.pendVal)
			}
			if !bytes.Equal(b, bytes.Repeat(b[:1], block)) || !slices.Contains(okVals, b[0]) {
				t.Fatalf("%s: block %d holds %d..., want one of %v", export, blk, b[0], okVals)
			}
		}
	}
	check("snap", atSuspend)
	check("lv", st)
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
