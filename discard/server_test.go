package discard_test

import (
	"bufio"
	"fmt"
	"io"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/nbdmapper/nbdmapper/backing"
	"github.com/nbdmapper/nbdmapper/internal/testing/nbdtest"
	"github.com/nbdmapper/nbdmapper/mapped"
	"github.com/nbdmapper/nbdmapper/nbdtarget"
)

// serve runs the real server for x on a unix socket and returns an NBD URI
// for libnbd.
func serve(t *testing.T, d *mapped.Device) string {
	t.Helper()
	x := &nbdtarget.Export{Name: d.DeviceName(), Dev: d}
	srv := &nbdtarget.Server{Exports: []*nbdtarget.Export{x}}
	return nbdtest.URI(nbdtest.ServeUnix(t, srv, nbdtarget.ErrServerClosed), x.Name)
}

// nbdsh runs a Python script against uri with h connected.
func nbdsh(t *testing.T, uri, script string) {
	t.Helper()
	out, err := nbdtest.Nbdsh(t, "-u", uri, "-c", script).CombinedOutput()
	if err != nil {
		t.Fatalf("nbdsh: %v\n%s", err, out)
	}
}

func TestServerWholeDeviceTrim(t *testing.T) {
	rg := fileRig(t, engine(time.Millisecond, 0))
	fill(t, rg.x)
	nbdsh(t, serve(t, rg.x), `h.trim(h.get_size(), 0)`)
	for i, rec := range rg.recs {
		if got, want := discards(rec), []backing.Range{{Off: 0, Len: half}}; !slices.Equal(got, want) {
			t.Errorf("file %d got discards %v, want one call %v", i, got, want)
		}
	}
}

// TestServerSmallTrimsCoalesce: libnbd sends 64 one-segment trims without
// waiting; the engine holds them until all 64 ranges are in (MaxRanges), so
// each file must see exactly one call.
func TestServerSmallTrimsCoalesce(t *testing.T) {
	eng := engine(time.Hour, 64)
	rg := memRig(t, eng, nil)
	nbdsh(t, serve(t, rg.x), fmt.Sprintf(`
cs = [h.aio_trim(%[1]d, i * %[1]d) for i in range(64)]
for c in cs:
    while not h.aio_command_completed(c):
        h.poll(-1)
`, segLen))
	for i, rec := range rg.recs {
		if got, want := discards(rec), []backing.Range{{Off: 0, Len: 32 * segLen}}; !slices.Equal(got, want) {
			t.Errorf("device %d got discards %v, want %v", i, got, want)
		}
	}
	for _, d := range eng.Stats().Devices {
		if d.RangesIn != 32 || d.Calls != 1 || d.MergedAway != 31 {
			t.Errorf("stats %+v, want 32 ranges in, 1 call, 31 merged away", d)
		}
	}
}

// TestServerWriteDuringTrimKept: the client sends a trim, and while it is
// unanswered writes into its range and gets the write's reply; then a second
// trim completes the batch. The written data must survive.
func TestServerWriteDuringTrimKept(t *testing.T) {
	eng := engine(time.Hour, 9)
	rg := memRig(t, eng, nil)
	fill(t, rg.x)
	uri := serve(t, rg.x)

	woff := 2*segLen + 4096
	cmd := nbdtest.Nbdsh(t, "-u", uri, "-c", fmt.Sprintf(`
import sys
c1 = h.aio_trim(8 * %[1]d, 0)
print("sent", flush=True)
sys.stdin.readline()
data = b"\x5c" * 8192
h.pwrite(data, %[2]d)
assert not h.aio_command_completed(c1), "trim answered before its batch was full"
c2 = h.aio_trim(%[1]d, 100 * %[1]d)
for c in (c1, c2):
    while not h.aio_command_completed(c):
        h.poll(-1)
assert h.pread(8192, %[2]d) == data, "write undone by the trim"
print("ok", flush=True)
`, segLen, woff))
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	var stderr strings.Builder
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	lines := bufio.NewScanner(stdout)
	if !lines.Scan() || lines.Text() != "sent" {
		cmd.Wait()
		t.Fatalf("nbdsh did not send the trim: %s", stderr.String())
	}
	waitRangesIn(t, eng, 8) // the trim is held by the engine
	io.WriteString(stdin, "go\n")
	var rest []string
	for lines.Scan() {
		rest = append(rest, lines.Text())
	}
	if err := cmd.Wait(); err != nil || !slices.Equal(rest, []string{"ok"}) {
		t.Fatalf("nbdsh: %v %q\n%s", err, rest, stderr.String())
	}
	wantA := []backing.Range{{Off: 0, Len: segLen + 4096}, {Off: segLen + 12288, Len: 3*segLen - 12288}, {Off: 50 * segLen, Len: segLen}}
	if got := discards(rg.recs[0]); !slices.Equal(got, wantA) {
		t.Errorf("device a discards = %v, want %v", got, wantA)
	}
}
