package main

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/nbdmapper/nbdmapper/internal/testing/nbdtest"
	"github.com/nbdmapper/nbdmapper/internal/testing/sparse"
)

// heldFiles lists the regular files process pid has open, by base name,
// sorted, and how many descriptors it has in all.
func heldFiles(t *testing.T, pid int) (files []string, fds int) {
	t.Helper()
	dir := fmt.Sprintf("/proc/%d/fd", pid)
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range ents {
		target, err := os.Readlink(filepath.Join(dir, e.Name()))
		if err != nil {
			continue // closed since
		}
		fds++
		if strings.HasSuffix(target, ".img") {
			files = append(files, filepath.Base(target))
		}
	}
	slices.Sort(files)
	return files, fds
}

// A server holds a backing file or remote export while some table names
// it, and lets go of it once none does, as `dmsetup remove` lets go of the
// disks below: `remove`, the resume of a reload that no longer names it,
// and a reload that fails each close what they leave unnamed, after
// syncing it. Before, every device stayed open until the server exited:
// devices that came and went (a --tables directory, create and remove)
// used up its descriptors, kept connections to remotes up, and kept the
// space of a removed and deleted image allocated.
func TestDevicesLetGo(t *testing.T) {
	dir := nbdtest.ShortDir(t)
	for _, f := range []string{"keep.img", "x.img", "y.img", "z.img", "r.img"} {
		sparse.Create(t, filepath.Join(dir, f), 4<<20)
	}
	peer := nbdtest.StartNbdkit(t, dir, "r", nbdtest.PeerOptions{}, "file", filepath.Join(dir, "r.img"))
	writeFile(t, filepath.Join(dir, "keep.table"), "0 8192 linear keep.img 0\n")
	writeFile(t, filepath.Join(dir, "x.table"), fmt.Sprintf("0 8192 linear %s 0\n8192 8192 linear %s 0\n",
		filepath.Join(dir, "x.img"), peer.URI("")))
	writeFile(t, filepath.Join(dir, "bad.table"), fmt.Sprintf("0 8192 linear %s 0\n8192 8 bogus\n", filepath.Join(dir, "y.img")))
	writeFile(t, filepath.Join(dir, "z.table"), fmt.Sprintf("0 8192 linear %s 0\n", filepath.Join(dir, "z.img")))
	ctl := filepath.Join(dir, "control")
	s := nbdtest.Start(t, bin, dir, "--metrics", "off", "--control", ctl, "keep=keep.table")
	files, fds := heldFiles(t, s.PID())
	if want := []string{"keep.img"}; !slices.Equal(files, want) {
		t.Fatalf("files held at start: %v, want %v", files, want)
	}

	for round := range 3 {
		lifecycle(t, ctl, "create", "x", filepath.Join(dir, "x.table"))
		if got, _ := heldFiles(t, s.PID()); !slices.Equal(got, []string{"keep.img", "x.img"}) {
			t.Fatalf("round %d: files held with x: %v", round, got)
		}
		// Written to both devices and never flushed by the client.
		flushes := peer.Count("Flush")
		nbdsh(t, s.URI("x"), fmt.Sprintf("h.pwrite(b'%d' * 4096, 0)\nh.pwrite(b'%d' * 4096, 4 << 20)", round, round))
		lifecycle(t, ctl, "remove", "x")
		if got, _ := heldFiles(t, s.PID()); !slices.Equal(got, []string{"keep.img"}) {
			t.Fatalf("round %d: files held after remove: %v, want [keep.img]", round, got)
		}
		// The control connection that carried the remove closes after
		// its reply, and nbdsh's connection closes just after it counts
		// out of the export, so the count may take a moment to come
		// down; a descriptor the device leaked never does.
		nbdtest.Until(t, fmt.Sprintf("round %d: the descriptors to come down to at most %d", round, fds), func() bool {
			_, n := heldFiles(t, s.PID())
			return n <= fds
		})
		nbdtest.Until(t, "the remote's connections to end", func() bool { return peer.Disconnects() == peer.Connects() })
		if n := peer.Count("Flush") - flushes; n != 1 {
			t.Errorf("round %d: the remote got %d flushes as the device closed, want 1 (it held acknowledged writes)", round, n)
		}
		stamp := bytes.Repeat([]byte{'0' + byte(round)}, 4096)
		mustFile(t, filepath.Join(dir, "x.img"), 0, stamp)
		mustFile(t, filepath.Join(dir, "r.img"), 0, stamp)
	}

	// A reload that fails holds nothing of what it opened before failing.
	if out, err := cmd2(dir, "reload", "--control", ctl, "keep", filepath.Join(dir, "bad.table")); err == nil {
		t.Fatalf("reload of a bad table succeeded: %s", out)
	}
	if got, _ := heldFiles(t, s.PID()); !slices.Equal(got, []string{"keep.img"}) {
		t.Errorf("files held after a failed reload: %v, want [keep.img]", got)
	}

	// The resume of a reload onto another file lets go of the old one.
	lifecycle(t, ctl, "reload", "keep", filepath.Join(dir, "z.table"))
	if got, _ := heldFiles(t, s.PID()); !slices.Equal(got, []string{"keep.img", "z.img"}) {
		t.Errorf("files held with a table loaded: %v, want both", got)
	}
	lifecycle(t, ctl, "resume", "keep")
	if got, _ := heldFiles(t, s.PID()); !slices.Equal(got, []string{"z.img"}) {
		t.Errorf("files held after the resume: %v, want [z.img]", got)
	}
}
