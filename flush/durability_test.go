package flush_test

import (
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"

	"github.com/nbdmapper/nbdmapper/backing"
	"github.com/nbdmapper/nbdmapper/discard"
	"github.com/nbdmapper/nbdmapper/flush"
	"github.com/nbdmapper/nbdmapper/internal/testing/nbdtest"
	"github.com/nbdmapper/nbdmapper/internal/testing/sparse"
	"github.com/nbdmapper/nbdmapper/mapped"
	"github.com/nbdmapper/nbdmapper/nbdtarget"
	"github.com/nbdmapper/nbdmapper/table"
	"golang.org/x/sys/unix"
)

const (
	blockSize = 4096
	workers   = 6
	perWorker = 8 // blocks; a worker's 32 KiB crosses a 24 KiB line boundary
	lineSecs  = 48
	devSize   = 1 << 20
)

// tableText maps the workers' blocks over lines of 24 KiB alternating
// between devices a and b at spaced offsets, so that writes and flushes
// spread over two devices and two-block writes cross devices.
func tableText(a, b string) string {
	var s strings.Builder
	total := workers * perWorker * blockSize / 512
	for i, start := 0, 0; start < total; i, start = i+1, start+lineSecs {
		dev := a
		if i%2 == 1 {
			dev = b
		}
		fmt.Fprintf(&s, "%d %d linear %s %d\n", start, lineSecs, dev, 8+(i/2)*2*lineSecs)
	}
	return s.String()
}

// TestDurabilityCrash serves a table over two fault-injecting devices with
// the real server, drives several connections of random writes, FUA writes
// and flushes, and then crashes: the devices stop accepting writes and
// syncs, and every write no sync covered is dropped. Every write
// acknowledged before a flush completed, and every FUA write, must be on the
// devices byte for byte. Each round restarts on what the crash left.
func TestDurabilityCrash(t *testing.T) {
	inners := []*backing.Mem{backing.NewMem("a", devSize), backing.NewMem("b", devSize)}
	m := newModel(workers*perWorker, blockSize)
	const rounds = 4
	var totalSyncs, totalFlushes uint64
	for round := range rounds {
		engine := flush.New()
		pool := &backing.Pool{Wrap: engine.Track}
		faulty := []*backing.Faulty{backing.NewFaulty(inners[0]), backing.NewFaulty(inners[1])}
		pool.Add("a", faulty[0])
		pool.Add("b", faulty[1])
		tab, err := table.Parse("durability", strings.NewReader(tableText("a", "b")), pool)
		if err != nil {
			t.Fatal(err)
		}
		x := &nbdtarget.Export{Dev: mapped.New("x", tab, engine, discard.New())}
		srv := &nbdtarget.Server{Exports: []*nbdtarget.Export{x}}
		socket := filepath.Join(t.TempDir(), "nbd.sock")
		l, err := net.Listen("unix", socket)
		if err != nil {
			t.Fatal(err)
		}
		go srv.Serve(l)

		var crash sync.Once
		target := int64(150 + 50*round)
		m.run(t, socket, workers, func(ops int64) bool {
			if ops < target {
				return false
			}
			crash.Do(func() {
				for _, f := range faulty {
					f.FailWrites(unix.EIO)
					f.FailSync(unix.EIO)
					f.Crash()
				}
			})
			return true
		})
		ctx, cancel := context.WithCancel(context.Background())
		cancel()
		srv.Shutdown(ctx)

		durable := m.check(t, func(block int, p []byte) {
			if _, err := x.Dev.Read(p, int64(block*blockSize)); err != nil {
				t.Fatal(err)
			}
		})
		s := engine.Stats()
		for _, d := range s.Devices {
			totalSyncs += d.Syncs
		}
		totalFlushes += s.Flushes
		t.Logf("round %d: %d of %d blocks had a durable write; %+v", round, durable, len(m.blocks), s)
		if durable == 0 {
			t.Errorf("round %d: no write was ever durable: the test proved nothing", round)
		}
	}
	t.Logf("%d flushes (FUA fallbacks included), %d syncs", totalFlushes, totalSyncs)
}

// TestDurabilitySIGKILL runs the real nbdmapper binary on two backing
// files, kills it with SIGKILL right after a flush reply, and checks the
// files: everything acknowledged before that flush (and every FUA write) is
// there. The page cache survives a process kill, so this checks that
// replies never run ahead of the writes and syncs they promise.
func TestDurabilitySIGKILL(t *testing.T) {
	bin := nbdtest.Binary(t)
	dir := t.TempDir()
	files := []string{filepath.Join(dir, "a.img"), filepath.Join(dir, "b.img")}
	for _, f := range files {
		sparse.Create(t, f, devSize)
	}
	tablePath := filepath.Join(dir, "disk.table")
	if err := os.WriteFile(tablePath, []byte(tableText(files[0], files[1])), 0o600); err != nil {
		t.Fatal(err)
	}
	m := newModel(workers*perWorker, blockSize)
	for round := range 3 {
		srv := nbdtest.Start(t, bin, dir, "--metrics=off", "disk="+tablePath)
		var kill sync.Once
		target := int64(100 + 60*round)
		m.run(t, srv.Socket, workers, func(ops int64) bool {
			if ops < target {
				return false
			}
			kill.Do(func() { srv.Signal(syscall.SIGKILL) })
			return true
		})
		if err := srv.Wait(); err == nil || !strings.Contains(err.Error(), "killed") {
			t.Fatalf("round %d: server ended with %v, want killed\n%s", round, err, srv.Stderr())
		}

		pool := &backing.Pool{ReadOnly: true}
		tab, err := table.Parse(tablePath, strings.NewReader(tableText(files[0], files[1])), pool)
		if err != nil {
			t.Fatal(err)
		}
		durable := m.check(t, func(block int, p []byte) {
			tab.Map(int64(block*blockSize), blockSize, func(e table.Extent) bool {
				if _, err := e.Dev.ReadAt(p[e.VOff-int64(block*blockSize):][:e.Len], e.Off); err != nil {
					t.Fatal(err)
				}
				return true
			})
		})
		pool.Close()
		if durable == 0 {
			t.Errorf("round %d: no write was ever durable: the test proved nothing", round)
		}
		t.Logf("round %d: %d of %d blocks had a durable write", round, durable, len(m.blocks))
	}
}
