package soak

import (
	"flag"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/nbdmapper/nbdmapper/internal/testing/nbdtest"
)

var (
	flagKills   = flag.Int("soak.kills", 4, "SIGKILLs of the real `nbdmapper serve` in TestSoakKill")
	flagKillOps = flag.Int64("soak.killops", 8000, "operations in all in TestSoakKill")
)

// TestSoakKill is the soak against the real binary over real files, with
// SIGKILL instead of a power cut: `nbdmapper serve` is killed with
// requests in flight and started again on the same files, and both exports
// are checked whole. A killed process loses nothing it wrote (the page
// cache survives it), so every acknowledged write must be there unless
// overwritten, FLUSH or not. No device faults: the binary has no hook for
// them; clients still abort at random.
func TestSoakKill(t *testing.T) {
	bin := nbdtest.Binary(t)
	ops, kills := *flagKillOps, *flagKills
	if testing.Short() {
		ops, kills = min(ops, 3000), min(kills, 2)
	}
	dir := t.TempDir()
	createDisks(t, dir)
	for name, text := range map[string]string{"main.table": mainTable, "org.table": orgTable} {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(text), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	r := &rig{t: t, dir: dir, kill: true, st: new(stats), full: &faults{}, slow: &faults{},
		models: map[string]*model{"main": newModel("main", 1, 12288), "org": newModel("org", 2, 2048)}}
	start := time.Now()
	perCycle := max(ops/int64(kills+1), 1)
	for cycle := 0; cycle <= kills; cycle++ {
		s := nbdtest.Start(t, bin, dir, "main=main.table", "org=org.table")
		r.sock = s.Socket
		r.cut = func() {
			s.Signal(syscall.SIGKILL)
			s.Wait()
		}
		r.close = func() {
			s.Signal(syscall.SIGTERM)
			s.Wait()
		}
		if cycle > 0 {
			r.sweep((*model).afterKill)
		}
		r.cutting.Store(false)
		r.run(perCycle, cycle < kills)
		if cycle < kills {
			r.st.crashes.Add(1)
		}
	}
	r.report(t, time.Since(start))
}
