package snapshot

import (
	"bufio"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"github.com/nbdmapper/nbdmapper/internal/nbdtest"
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
