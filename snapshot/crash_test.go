package snapshot

import (
	"bufio"
	"bytes"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"github.com/nbdmapper/nbdmapper/backing"
)

// The crash stream: op i writes crashLen bytes into its own slot (so no
// two ops overlap), to the origin when i%3 == 0 and to the snapshot
// otherwise, at an offset that is not chunk aligned. After every 4th op
// the writer syncs the snapshot and the origin and prints "flushed i".
const (
	crashOrigin = 4 << 20
	crashCOW    = 16 << 20
	crashSlot   = 8 << 10
	crashLen    = 5000
	crashOps    = crashOrigin / crashSlot
)

var crashPerm = rand.New(rand.NewPCG(7, 7)).Perm(crashOps)

// crashOff is where op i writes: its slot, plus an offset off chunk bounds.
func crashOff(i int) int64 { return int64(crashPerm[i])*crashSlot + int64(i%7)*100 + 300 }

func crashData(i int) []byte {
	return bytes.Repeat([]byte{byte(i%250 + 1)}, crashLen)
}

func crashInitial() []byte {
	b := make([]byte, crashOrigin)
	for i := range b {
		b[i] = byte(i>>9) ^ 0x5A
	}
	return b
}

// TestCrashSIGKILL runs the crash stream in a child process on real files,
// SIGKILLs it mid-stream, reopens the store and checks that every write
// acknowledged before the last acknowledged flush is there, that the
// origin never shows a snapshot write and the snapshot never an origin
// write, and that everything else is either old or new, sector by sector.
func TestCrashSIGKILL(t *testing.T) {
	if dir := os.Getenv("SNAPSHOT_CRASH_CHILD"); dir != "" {
		crashChild(t, dir)
		return
	}
	for round, killAfter := range []int{3, 40, 90} { // acknowledged flushes before the kill
		t.Run(fmt.Sprintf("kill after %d flushes", killAfter), func(t *testing.T) {
			dir := t.TempDir()
			initial := crashInitial()
			if err := os.WriteFile(filepath.Join(dir, "origin.img"), initial, 0o644); err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(filepath.Join(dir, "cow.img"), make([]byte, crashCOW), 0o644); err != nil {
				t.Fatal(err)
			}
			cmd := exec.Command(os.Args[0], "-test.run=^TestCrashSIGKILL$")
			cmd.Env = append(os.Environ(), "SNAPSHOT_CRASH_CHILD="+dir)
			out, err := cmd.StdoutPipe()
			if err != nil {
				t.Fatal(err)
			}
			cmd.Stderr = os.Stderr
			if err := cmd.Start(); err != nil {
				t.Fatal(err)
			}
			acked, flushes := -1, 0
			sc := bufio.NewScanner(out)
			for sc.Scan() {
				if n, ok := strings.CutPrefix(sc.Text(), "flushed "); ok {
					acked, _ = strconv.Atoi(n)
					if flushes++; flushes == killAfter {
						break
					}
				}
			}
			cmd.Process.Signal(syscall.SIGKILL)
			cmd.Wait()
			if acked < 0 {
				t.Fatal("child acknowledged no flush")
			}
			t.Logf("round %d: killed after op %d acknowledged", round, acked)

			originDev := openFile(t, filepath.Join(dir, "origin.img"))
			s, err := Open("crash", originDev, openFile(t, filepath.Join(dir, "cow.img")), Options{Type: Persistent, ChunkSectors: 8})
			if err != nil {
				t.Fatal(err)
			}
			defer s.Close()
			if st := s.Status(); st == "Invalid" {
				t.Fatal("snapshot invalid after restart")
			}
			verifyCrash(t, initial, readAll(t, s), readAll(t, originDev), acked)
		})
	}
}

// verifyCrash checks the devices after a crash: every op up to acked is
// present, the device an op did not write is unchanged, and everything
// else is old or new, sector by sector.
func verifyCrash(t *testing.T, initial, snap, orig []byte, acked int) {
	t.Helper()
	for i := 0; i < crashOps; i++ {
		at := crashOff(i)
		toOrigin := i%3 == 0
		for sec := at; sec < at+crashLen; sec += 512 {
			end := min(sec+512, at+crashLen)
			newb := crashData(i)[:end-sec]
			oldb := initial[sec:end]
			other, mine := snap, orig
			if !toOrigin {
				other, mine = orig, snap
			}
			if !bytes.Equal(other[sec:end], oldb) {
				t.Fatalf("op %d (origin=%v): the other device changed at %d", i, toOrigin, sec)
			}
			switch got := mine[sec:end]; {
			case bytes.Equal(got, newb):
			case i <= acked:
				t.Fatalf("op %d acknowledged and flushed, but missing at byte %d", i, sec)
			case !bytes.Equal(got, oldb):
				t.Fatalf("op %d: byte %d is neither old nor new", i, sec)
			}
		}
	}
}

func readAll(t *testing.T, d backing.Device) []byte {
	t.Helper()
	b := make([]byte, d.Size())
	if _, err := d.ReadAt(b, 0); err != nil {
		t.Fatal(err)
	}
	return b
}

// crashChild is the writer, in its own process; it runs until killed.
func crashChild(t *testing.T, dir string) {
	origin, err := backing.OpenFile(filepath.Join(dir, "origin.img"), false)
	if err != nil {
		t.Fatal(err)
	}
	cow, err := backing.OpenFile(filepath.Join(dir, "cow.img"), false)
	if err != nil {
		t.Fatal(err)
	}
	s, err := Open("crash", origin, cow, Options{Type: Persistent, ChunkSectors: 8})
	if err != nil {
		t.Fatal(err)
	}
	o, err := NewOrigin("crash-origin", origin, 0)
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i < crashOps; i++ {
		var d backing.Device = s
		if i%3 == 0 {
			d = o
		}
		if _, err := d.WriteAt(crashData(i), crashOff(i)); err != nil {
			t.Fatal(err)
		}
		if i%4 == 3 {
			if err := s.Sync(); err != nil {
				t.Fatal(err)
			}
			if err := o.Sync(); err != nil {
				t.Fatal(err)
			}
			fmt.Printf("flushed %d\n", i)
		}
	}
	select {} // wait to be killed
}
