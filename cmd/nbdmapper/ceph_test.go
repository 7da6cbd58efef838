//go:build ceph

package main

import (
	"bytes"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"github.com/nbdmapper/nbdmapper/internal/testing/cephtest"
	"github.com/nbdmapper/nbdmapper/internal/testing/nbdtest"
	"github.com/nbdmapper/nbdmapper/internal/testing/sparse"
)

// cephTags are the tags the Ceph tests build the binary with: ours, and
// go-ceph's for Ceph 16 (Debian 12's librbd).
const cephTags = "ceph,pacific"

// TestServeCeph serves tables over RBD images of a throwaway single-node
// cluster with the real binary built with -tags ceph, and checks through
// real clients (nbdsh, nbdinfo) and Ceph's own rbd tool: bytes land where
// the tables say in the images (rbd export), one client flush is one
// rbd_flush per written image however many lines map it, merged trims
// free the images' space (rbd du), write zeroes reads back as zeros and
// frees it too, block status answers RBD's unallocated objects as holes,
// a snapshot target keeps its writes off its origin image, an RBD snapshot
// is served read-only, and across an OSD crash and restart the failure
// rules of remote devices hold (docs/ceph.md, "Failures").
func TestServeCeph(t *testing.T) {
	nbdtest.Python(t)
	dir := nbdtest.ShortDir(t)
	cbin := filepath.Join(dir, "nbdmapper-ceph")
	if out, err := exec.Command("go", "build", "-tags", cephTags, "-o", cbin, ".").CombinedOutput(); err != nil {
		t.Fatalf("go build -tags %s: %v\n%s", cephTags, err, out)
	}
	c := cephtest.Start(t)
	const size = 8 << 20
	a := c.CreateImage(t, "a", size)
	b := c.CreateImage(t, "b", size/2)
	d := c.CreateImage(t, "d", size/2)
	z := c.CreateImage(t, "z", 2*size)
	file := sparse.Create(t, filepath.Join(dir, "f.img"), size/2)
	peerFile := sparse.Create(t, filepath.Join(dir, "peer.img"), size/2)
	peer := nbdtest.StartNbdkit(t, dir, "peer", nbdtest.PeerOptions{}, "file", peerFile)
	sparse.Create(t, filepath.Join(dir, "cow.img"), size)

	// lin: 1024 lines of 8 KiB, in order, over all of image a. str: b
	// and d striped in 64 KiB chunks. mix: a file, image z's second half
	// and an nbdkit export. zero: image z's first half. snap: a snapshot
	// whose origin is image o, its COW store a file.
	var lin strings.Builder
	for i := range 1024 {
		fmt.Fprintf(&lin, "%d 16 linear %s %d\n", i*16, a, i*16)
	}
	writeFile(t, filepath.Join(dir, "lin.table"), lin.String())
	writeFile(t, filepath.Join(dir, "str.table"), fmt.Sprintf("0 16384 striped 2 128 %s 0 %s 0\n", b, d))
	writeFile(t, filepath.Join(dir, "mix.table"), fmt.Sprintf("0 8192 linear %s 0\n8192 16384 linear %s 16384\n24576 8192 linear %s 0\n", file, z, peer.URI("")))
	o := c.CreateImage(t, "o", size)
	c.RBD(t, "bench", "--io-type", "write", "--io-size", "4M", "--io-total", "8M", "--io-pattern", "seq", "rbd/o")
	writeFile(t, filepath.Join(dir, "snap.table"), fmt.Sprintf("0 16384 snapshot %s cow.img P 8\n", o))
	writeFile(t, filepath.Join(dir, "zero.table"), fmt.Sprintf("0 16384 linear %s 0\n", z))

	if out, err := cmd2In(cbin, dir, "check", "--connect", "str.table"); err != nil {
		t.Fatalf("check --connect: %v\n%s", err, out)
	}
	// The package's binary, built without the tag, says how to build it.
	if out, err := cmd2In(bin, dir, "check", "str.table"); err == nil || !strings.Contains(out, "built without ceph support; build with -tags ceph") {
		t.Errorf("check with a binary built without ceph: %v\n%s", err, out)
	}
	// A cluster that does not answer fails the load after the deadline.
	writeFile(t, filepath.Join(dir, "down.conf"), "[global]\nmon host = v2:127.0.0.1:1\nauth client required = none\n")
	writeFile(t, filepath.Join(dir, "down.table"), "0 2048 linear rbd:rbd/a:conf=down.conf 0\n")
	if out, err := cmd2In(cbin, dir, "check", "--connect", "--remote-timeout", "1s", "down.table"); err == nil || !regexp.MustCompile(`down\.table:1: .*connect: .*timed out`).MatchString(out) {
		t.Errorf("check --connect with the cluster down: %v\n%s", err, out)
	}
	s := serveBin(t, cbin, dir, "lin=lin.table", "str=str.table", "mix=mix.table", "zero=zero.table", "snap=snap.table")

	t.Run("round trip", func(t *testing.T) {
		pattern := `bytes((i * 7 + (i >> 12)) & 255 for i in range(%d))`
		nbdsh(t, s.URI("lin"), fmt.Sprintf("d = %s\nh.pwrite(d, 0)\nh.flush()\nassert h.pread(len(d), 0) == d", fmt.Sprintf(pattern, size)))
		nbdsh(t, s.URI("str"), "h.pwrite(bytes([7]) * (64 << 10) + bytes([9]) * (64 << 10), 0)\nh.flush()")
		nbdsh(t, s.URI("mix"), "h.pwrite(b'F' * 8192 + b'Z' * 8192, (4 << 20) - 8192)\nh.pwrite(b'P' * 8192, 12 << 20)\nh.flush()")
		want := make([]byte, size)
		for i := range want {
			want[i] = byte(i*7 + i>>12)
		}
		if got := export(t, c, "a"); !bytes.Equal(got, want) {
			t.Errorf("rbd export of a differs from what was written through lin")
		}
		if got := export(t, c, "b"); !bytes.Equal(got[:64<<10], bytes.Repeat([]byte{7}, 64<<10)) {
			t.Errorf("stripe chunk 0 is not at offset 0 of b")
		}
		if got := export(t, c, "d"); !bytes.Equal(got[:64<<10], bytes.Repeat([]byte{9}, 64<<10)) {
			t.Errorf("stripe chunk 1 is not at offset 0 of d")
		}
		mustFile(t, file, (4<<20)-8192, bytes.Repeat([]byte{'F'}, 8192))
		if got := export(t, c, "z"); !bytes.Equal(got[8<<20:8<<20+8192], bytes.Repeat([]byte{'Z'}, 8192)) {
			t.Errorf("mix's second line is not at 8 MiB of z")
		}
		mustFile(t, peerFile, 0, bytes.Repeat([]byte{'P'}, 8192))
		if n := peer.Count("Flush"); n != 1 {
			t.Errorf("%d NBD flushes reached the nbdkit export, want 1", n)
		}
	})

	t.Run("flush dedupe", func(t *testing.T) {
		syncs := func() float64 {
			return scrapeValue(t, s.metrics, fmt.Sprintf("nbdmapper_device_syncs_total{device=%q}", a))
		}
		before := syncs()
		// Writes to every one of lin's 1024 lines, then one flush.
		nbdsh(t, s.URI("lin"), "for i in range(1024):\n    h.pwrite(b'w' * 512, i * 8192)\nh.flush()")
		if n := syncs() - before; n != 1 {
			t.Errorf("%v rbd_flush calls for one client flush over 1024 lines of one image, want 1", n)
		}
		nbdsh(t, s.URI("lin"), "h.flush()")
		if n := syncs() - before; n != 1 {
			t.Errorf("a flush with nothing written since called rbd_flush (%v in all)", n)
		}
	})

	t.Run("merged discards free space", func(t *testing.T) {
		used := func() int64 { return rbdUsed(t, c, "a") }
		if u := used(); u < size {
			t.Fatalf("rbd du of a before trim: %d bytes used, want %d", u, size)
		}
		metric := func(name string) float64 {
			return scrapeValue(t, s.metrics, fmt.Sprintf("%s{device=%q}", name, a))
		}
		in0, calls0 := metric("nbdmapper_device_discard_ranges_received_total"), metric("nbdmapper_device_discard_calls_total")
		// One trim of all of lin: a range on each of its 1024 lines.
		nbdsh(t, s.URI("lin"), "h.trim(8 << 20, 0)\nh.flush()")
		in, calls := metric("nbdmapper_device_discard_ranges_received_total")-in0, metric("nbdmapper_device_discard_calls_total")-calls0
		if in != 1024 || calls != 1 {
			t.Errorf("one trim over 1024 lines of a: %v ranges in, %v rbd_discard calls; want 1024 and 1", in, calls)
		}
		if u := used(); u != 0 {
			t.Errorf("rbd du of a after trimming it all: %d bytes used, want 0", u)
		}
		nbdsh(t, s.URI("lin"), "assert h.pread(8 << 20, 0) == bytes(8 << 20)")
	})

	t.Run("write zeroes", func(t *testing.T) {
		nbdsh(t, s.URI("zero"), "h.pwrite(b'q' * (8 << 20), 0)\nh.flush()")
		if u := rbdUsed(t, c, "z"); u < size {
			t.Fatalf("rbd du of z: %d bytes used, want at least %d", u, size)
		}
		nbdsh(t, s.URI("zero"), "h.zero(8 << 20, 0)\nh.flush()\nassert h.pread(8 << 20, 0) == bytes(8 << 20)")
		if got := export(t, c, "z"); !bytes.Equal(got[:size], make([]byte, size)) {
			t.Errorf("rbd export of z after write zeroes is not zeros")
		}
		if u := rbdUsed(t, c, "z"); u >= size {
			t.Errorf("rbd du of z after write zeroes of 8 MiB: %d bytes used, want less than %d", u, size)
		}
	})

	t.Run("holes in block status", func(t *testing.T) {
		// z: its first 8 MiB zeroed above; mix writes at 8 MiB of z
		// (4 MiB of mix's second line, 4 MiB into mix) one 4 MiB
		// object's worth at most: block status says the rest are holes.
		out, err := exec.Command("nbdinfo", "--map", s.URI("zero")).CombinedOutput()
		if err != nil {
			t.Fatalf("nbdinfo --map: %v\n%s", err, out)
		}
		if !regexp.MustCompile(`(?m)^\s*0\s+8388608\s+3\s+hole,zero$`).Match(out) {
			t.Errorf("nbdinfo --map of zero (all zeroed) does not show one hole:\n%s", out)
		}
		nbdsh(t, s.URI("zero"), "h.pwrite(b'x' * 4096, 4 << 20)\nh.flush()")
		out, err = exec.Command("nbdinfo", "--map", s.URI("zero")).CombinedOutput()
		if err != nil {
			t.Fatalf("nbdinfo --map: %v\n%s", err, out)
		}
		for _, want := range []string{`(?m)^\s*0\s+4194304\s+3\s+hole,zero$`, `(?m)^\s*4194304\s+4194304\s+0\s+data$`} {
			if !regexp.MustCompile(want).Match(out) {
				t.Errorf("nbdinfo --map after a write in the second object lacks %s:\n%s", want, out)
			}
		}
	})
	t.Run("snapshot of an image", func(t *testing.T) {
		origin := export(t, c, "o")
		nbdsh(t, s.URI("snap"), "h.pwrite(b'S' * 65536, 4096)\nh.flush()")
		want := bytes.Clone(origin)
		copy(want[4096:], bytes.Repeat([]byte{'S'}, 65536))
		out, err := nbdtest.Nbdsh(t, "-u", s.URI("snap"), "-c", "import sys\nsys.stdout.buffer.write(h.pread(8 << 20, 0))").Output()
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(out, want) {
			t.Errorf("the snapshot does not read as the origin with its own write")
		}
		if got := export(t, c, "o"); !bytes.Equal(got, origin) {
			t.Errorf("a write to the snapshot changed its origin image")
		}
	})
	s.Stop(t)

	t.Run("snapshot read-only", func(t *testing.T) {
		c.RBD(t, "snap", "create", "rbd/b@s1")
		c.RBD(t, "bench", "--io-type", "write", "--io-size", "65536", "--io-total", "65536", "--io-pattern", "seq", "rbd/b")
		writeFile(t, filepath.Join(dir, "rbdsnap.table"), fmt.Sprintf("0 8192 linear %s 0\n", c.Device("b@s1")))
		s := serveBin(t, cbin, dir, "snap=rbdsnap.table")
		nbdsh(t, s.URI("snap"), "assert h.pread(65536, 0) == bytes([7]) * 65536")
		out, err := nbdtest.Nbdsh(t, "-u", s.URI("snap"), "-c", "h.pwrite(b'n' * 512, 0)").CombinedOutput()
		if err == nil || !strings.Contains(string(out), "Operation not permitted") {
			t.Errorf("a write to a snapshot: %v\n%s\nwant EPERM", err, out)
		}
		s.Stop(t)
	})

	// Last, as it takes the cluster down and up again.
	t.Run("osd killed and restarted", func(t *testing.T) {
		// Past the deadline: librbd's cache holds the writes since the
		// last flush, a flush while the OSD is down fails with EIO once
		// --remote-timeout has passed, and every later flush of the
		// image fails too, though the OSD is back; the server serves on,
		// and what was flushed before is all there.
		w := c.CreateImage(t, "w", size)
		writeFile(t, filepath.Join(dir, "w.table"), fmt.Sprintf("0 16384 linear %s 0\n", w))
		s := serveBin(t, cbin, dir, "--remote-timeout", "3s", "w=w.table")
		nbdsh(t, s.URI("w"), "h.pwrite(b'A' * (1 << 20), 0)\nh.flush()\nh.pwrite(b'B' * (1 << 20), 1 << 20)\nh.flush()")
		c.KillOSD(t)
		nbdsh(t, s.URI("w"), "h.pwrite(b'C' * 65536, 4 << 20)")
		flushFails := func(what string) {
			t.Helper()
			out, err := nbdtest.Nbdsh(t, "-u", s.URI("w"), "-c", "h.flush()").CombinedOutput()
			if err == nil || !strings.Contains(string(out), "Input/output error") {
				t.Errorf("flush %s: %v\n%s\nwant EIO", what, err, out)
			}
		}
		flushFails("with the OSD down")
		c.StartOSD(t)
		flushFails("after the OSD came back (sticky)")
		// The server's librados learns the restarted OSD's address from
		// the monitor in its own time; a read before then may time out.
		nbdtest.Until(t, "reads of the flushed writes through the server", func() bool {
			return nbdtest.Nbdsh(t, "-u", s.URI("w"), "-c", "assert h.pread(2 << 20, 0) == b'A' * (1 << 20) + b'B' * (1 << 20)").Run() == nil
		})
		out, _ := cmd2In(cbin, dir, "status", "--metrics", s.metrics)
		if !strings.Contains(scrapeText(t, s.metrics), fmt.Sprintf("nbdmapper_device_failed{device=%q} 1", w)) {
			t.Errorf("metrics do not show %s failed\n%s", w, out)
		}
		s.Signal(syscall.SIGTERM)
		if err := s.Wait(); err == nil {
			t.Errorf("serve exited 0 though the shutdown sync of %s cannot succeed", w)
		}
		if got := export(t, c, "w"); !bytes.Equal(got[:2<<20], append(bytes.Repeat([]byte{'A'}, 1<<20), bytes.Repeat([]byte{'B'}, 1<<20)...)) {
			t.Errorf("rbd export of w lost flushed writes")
		}

		// Within the deadline: with librbd's cache off every write is
		// durable when acknowledged; those sent while the OSD is down are
		// retried by librados and complete once it is back. fio writes
		// and verifies across the crash: no error, nothing lost.
		x := c.CreateImage(t, "x", size)
		writeFile(t, filepath.Join(dir, "x.table"), fmt.Sprintf("0 16384 linear %s:rbd_cache=false 0\n", x))
		s = serveBin(t, cbin, dir, "--remote-timeout", "60s", "x=x.table")
		done := make(chan []byte, 1)
		var fioErr error
		go func() {
			out, err := exec.Command("fio", "--name=verify", "--ioengine=nbd", "--uri="+s.URI("x"),
				"--rw=randwrite", "--bs=4k", "--size=8m", "--io_size=24m", "--iodepth=16",
				"--verify=crc32c", "--verify_fatal=1", "--randrepeat=0", "--verify_state_save=0").CombinedOutput()
			fioErr = err
			done <- out
		}()
		writes := func() float64 {
			return scrapeValue(t, s.metrics, `nbdmapper_requests_total{export="x",op="write"}`)
		}
		nbdtest.Until(t, "fio to be writing", func() bool { return writes() >= 200 })
		c.KillOSD(t)
		select {
		case out := <-done:
			t.Fatalf("fio ended before the OSD was killed: %v\n%s", fioErr, out)
		default:
		}
		c.StartOSD(t)
		if out := <-done; fioErr != nil || !regexp.MustCompile(`err= 0`).Match(out) {
			t.Errorf("fio across the OSD's restart: %v\n%s", fioErr, out)
		}
		s.Stop(t)
	})
}

// TestServeCephx serves an image of a cluster that requires cephx, as a
// user of its own named in the device (id=, keyring=) with only RBD's
// rights to one pool: the table checks and serves, and the bytes reach the
// image; without the keyring the user cannot connect.
func TestServeCephx(t *testing.T) {
	nbdtest.Python(t)
	dir := nbdtest.ShortDir(t)
	cbin := filepath.Join(dir, "nbdmapper-ceph")
	if out, err := exec.Command("go", "build", "-tags", cephTags, "-o", cbin, ".").CombinedOutput(); err != nil {
		t.Fatalf("go build -tags %s: %v\n%s", cephTags, err, out)
	}
	c := cephtest.StartCephx(t)
	const size = 4 << 20
	dev := c.CreateImage(t, "img", size)
	keyring := c.User(t, "nbdm")
	writeFile(t, filepath.Join(dir, "user.table"), fmt.Sprintf("0 8192 linear %s:id=nbdm:keyring=%s 0\n", dev, keyring))
	writeFile(t, filepath.Join(dir, "nokey.table"), fmt.Sprintf("0 8192 linear %s:id=nbdm 0\n", dev))
	if out, err := cmd2In(cbin, dir, "check", "--connect", "user.table"); err != nil {
		t.Fatalf("check --connect as client.nbdm: %v\n%s", err, out)
	}
	if out, err := cmd2In(cbin, dir, "check", "--connect", "--remote-timeout", "5s", "nokey.table"); err == nil || !strings.Contains(out, "nokey.table:1: ") || !strings.Contains(out, "connect") {
		t.Errorf("check --connect as client.nbdm without its keyring: %v\n%s\nwant a failure to connect", err, out)
	}
	s := serveBin(t, cbin, dir, "user=user.table")
	nbdsh(t, s.URI("user"), "h.pwrite(b'k' * (1 << 20), 4096)\nh.flush()\nassert h.pread(1 << 20, 4096) == b'k' * (1 << 20)")
	s.Stop(t)
	want := make([]byte, size)
	copy(want[4096:], bytes.Repeat([]byte{'k'}, 1<<20))
	if got := export(t, c, "img"); !bytes.Equal(got, want) {
		t.Errorf("rbd export of the image differs from what client.nbdm wrote")
	}
}

// scrapeText is a scrape of addr/metrics.
func scrapeText(t *testing.T, addr string) string {
	t.Helper()
	resp, err := http.Get("http://" + addr + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// serveBin starts bin (built with other tags than the package's bin) as
// serve does.
func serveBin(t *testing.T, bin, dir string, exports ...string) *server {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	metrics := l.Addr().String()
	l.Close()
	s := &server{nbdtest.Start(t, bin, dir, append([]string{"--metrics", metrics, "--control", "off"}, exports...)...), metrics}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("serve's log:\n%s", s.Stderr())
		}
	})
	s.WaitListening(t, "tcp", metrics)
	return s
}

func cmd2In(bin, dir string, args ...string) (string, error) {
	cmd := exec.Command(bin, args...)
	cmd.Dir = dir
	out, err := cmd.CombinedOutput()
	return string(out), err
}

// export is the image's bytes as `rbd export` reads them.
func export(t *testing.T, c *cephtest.Cluster, image string) []byte {
	t.Helper()
	path := filepath.Join(t.TempDir(), image+".raw")
	c.RBD(t, "export", "rbd/"+image, path)
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return data
}

// rbdUsed is the bytes `rbd du` says the image uses.
func rbdUsed(t *testing.T, c *cephtest.Cluster, image string) int64 {
	t.Helper()
	out := c.RBD(t, "du", "--format", "json", "rbd/"+image)
	m := regexp.MustCompile(`"used_size":(\d+)`).FindStringSubmatch(out)
	if m == nil {
		t.Fatalf("rbd du: no used_size in %s", out)
	}
	n, _ := strconv.ParseInt(m[1], 10, 64)
	return n
}
