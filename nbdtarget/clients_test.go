package nbdtarget

import (
	"bytes"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/nbdmapper/nbdmapper/backing"
	"github.com/nbdmapper/nbdmapper/discard"
	"github.com/nbdmapper/nbdmapper/flush"
	"github.com/nbdmapper/nbdmapper/internal/testing/nbdtest"
	"github.com/nbdmapper/nbdmapper/internal/testing/sparse"
	"github.com/nbdmapper/nbdmapper/mapped"
	"github.com/nbdmapper/nbdmapper/table"
)

// Integration tests against real NBD clients (libnbd's nbdinfo, nbdsh and
// nbdcopy; qemu-io) over a unix socket. The "disk" export is a parsed text
// table over two sparse files; every check of the backing files uses
// where(), which computes the mapping by hand, not through package table.
//
//	virtual  0     1M      1.5M   2M                 3M           4M
//	         | A@2M | B@0  | zero | striped 2x64K     | B@4M        |
//	                               A@4M, B@2M
const diskTable = `# test layout
0 2048 linear %[1]s 4096
2048 1024 linear %[2]s 0
3072 1024 zero
4096 2048 striped 2 128 %[1]s 8192 %[2]s 4096
6144 2048 linear %[2]s 8192
`

const (
	mib      = 1 << 20
	diskSize = 4 * mib
)

// where maps a virtual byte offset of the disk export to (file, offset);
// file is "" inside the zero target.
func where(v int64) (file string, off int64) {
	switch {
	case v < mib:
		return "A", 2*mib + v
	case v < 3*mib/2:
		return "B", v - mib
	case v < 2*mib:
		return "", 0
	case v < 3*mib:
		rel := v - 2*mib
		chunk, in := rel/(64<<10), rel%(64<<10)
		dev := chunk/2*(64<<10) + in
		if chunk%2 == 0 {
			return "A", 4*mib + dev
		}
		return "B", 2*mib + dev
	default:
		return "B", 4*mib + v - 3*mib
	}
}

type diskFix struct {
	sock  string
	files map[string]string // "A", "B" -> path
	srv   *Server
}

func (f *diskFix) uri(export string) string {
	return nbdtest.URI(f.sock, export)
}

// newDiskFix serves "disk" (the table above) and "ro" (a read-only linear
// export of A's first MiB) from real sparse files.
func newDiskFix(t *testing.T) *diskFix {
	t.Helper()
	dir := t.TempDir()
	f := &diskFix{files: map[string]string{}}
	for _, name := range []string{"A", "B"} {
		f.files[name] = sparse.Create(t, filepath.Join(dir, name), 8*mib)
	}
	pool := &backing.Pool{}
	t.Cleanup(func() { pool.Close() })
	parse := func(name, text string) *table.Table {
		tb, err := table.Parse(name, strings.NewReader(text), pool)
		if err != nil {
			t.Fatal(err)
		}
		return tb
	}
	disk := &Export{Name: "disk", Description: "test disk",
		Dev: mapped.New("disk", parse("disk", fmt.Sprintf(diskTable, f.files["A"], f.files["B"])), flush.New(), discard.New())}
	ro := &Export{Name: "ro", ReadOnly: true,
		Dev: mapped.New("ro", parse("ro", "0 2048 linear "+f.files["A"]+" 0\n"), flush.New(), discard.New())}
	f.srv = &Server{Exports: []*Export{disk, ro}}
	f.sock = nbdtest.ServeUnix(t, f.srv, ErrServerClosed)
	return f
}

// backingBytes reads n bytes of the virtual disk straight from the backing
// files, one byte at a time through where().
func (f *diskFix) backingBytes(t *testing.T, v, n int64) []byte {
	t.Helper()
	data := map[string][]byte{}
	for k, p := range f.files {
		b, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		data[k] = b
	}
	out := make([]byte, n)
	for i := range out {
		file, off := where(v + int64(i))
		if file != "" {
			out[i] = data[file][off]
		}
	}
	return out
}

func run(t *testing.T, name string, args ...string) string {
	t.Helper()
	return output(t, exec.Command(name, args...))
}

// output runs cmd and returns its standard output, failing the test with
// both outputs if it fails.
func output(t *testing.T, cmd *exec.Cmd) string {
	t.Helper()
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("%s: %v\nstdout: %s\nstderr: %s", strings.Join(cmd.Args, " "), err, out, stderr.String())
	}
	return string(out)
}

func TestNbdinfo(t *testing.T) {
	nbdtest.Tool(t, "nbdinfo")
	f := newDiskFix(t)
	type info struct {
		Protocol   string `json:"protocol"`
		Structured bool   `json:"structured"`
		Exports    []struct {
			Name        string   `json:"export-name"`
			Description string   `json:"description"`
			Contexts    []string `json:"contexts"`
			ReadOnly    bool     `json:"is_read_only"`
			Rotational  bool     `json:"is_rotational"`
			CanCache    bool     `json:"can_cache"`
			CanDF       bool     `json:"can_df"`
			CanFastZero bool     `json:"can_fast_zero"`
			CanFlush    bool     `json:"can_flush"`
			CanFUA      bool     `json:"can_fua"`
			CanMulti    bool     `json:"can_multi_conn"`
			CanTrim     bool     `json:"can_trim"`
			CanZero     bool     `json:"can_zero"`
			BlockMin    int64    `json:"block_size_minimum"`
			BlockPref   int64    `json:"block_size_preferred"`
			BlockMax    int64    `json:"block_size_maximum"`
			Size        int64    `json:"export-size"`
		} `json:"exports"`
	}
	for _, tc := range []struct {
		name, export string
		size         int64
		ro           bool
	}{
		{"default export is the first", "", diskSize, false},
		{"named export", "disk", diskSize, false},
		{"read-only export", "ro", mib, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var got info
			out := run(t, "nbdinfo", "--json", f.uri(tc.export))
			if err := json.Unmarshal([]byte(out), &got); err != nil {
				t.Fatalf("%v\n%s", err, out)
			}
			if got.Protocol != "newstyle-fixed" || !got.Structured || len(got.Exports) != 1 {
				t.Fatalf("nbdinfo: %s", out)
			}
			x := got.Exports[0]
			if x.Size != tc.size || x.ReadOnly != tc.ro || x.Rotational {
				t.Errorf("size %d read-only %v", x.Size, x.ReadOnly)
			}
			if !x.CanCache || !x.CanDF || !x.CanFlush || !x.CanFUA || !x.CanMulti {
				t.Errorf("missing capability: %s", out)
			}
			if x.CanTrim == tc.ro || x.CanZero == tc.ro || x.CanFastZero == tc.ro {
				t.Errorf("trim/zero/fast zero should be advertised exactly on writable exports: %s", out)
			}
			if x.BlockMin != 1 || x.BlockPref != 4096 || x.BlockMax != 32*mib {
				t.Errorf("block sizes %d %d %d", x.BlockMin, x.BlockPref, x.BlockMax)
			}
			if len(x.Contexts) != 1 || x.Contexts[0] != "base:allocation" {
				t.Errorf("contexts %v", x.Contexts)
			}
		})
	}
	t.Run("list", func(t *testing.T) {
		var got info
		out := run(t, "nbdinfo", "--list", "--json", f.uri(""))
		if err := json.Unmarshal([]byte(out), &got); err != nil {
			t.Fatalf("%v\n%s", err, out)
		}
		if len(got.Exports) != 2 || got.Exports[0].Name != "disk" || got.Exports[0].Description != "test disk" || got.Exports[1].Name != "ro" {
			t.Fatalf("list: %s", out)
		}
	})
	t.Run("map", func(t *testing.T) {
		// Fresh sparse files: all holes, except that the zero target is
		// hole+zero too, so the whole disk is one extent.
		var m []struct {
			Offset int64 `json:"offset"`
			Length int64 `json:"length"`
			Type   int   `json:"type"`
		}
		out := run(t, "nbdinfo", "--map", "--json", f.uri("disk"))
		if err := json.Unmarshal([]byte(out), &m); err != nil {
			t.Fatalf("%v\n%s", err, out)
		}
		if len(m) != 1 || m[0].Offset != 0 || m[0].Length != diskSize || m[0].Type != 3 {
			t.Fatalf("map %s", out)
		}
	})
}

func TestNbdcopyRoundTrip(t *testing.T) {
	nbdtest.Tool(t, "nbdcopy")
	f := newDiskFix(t)
	dir := t.TempDir()
	in := make([]byte, diskSize)
	rng := rand.New(rand.NewPCG(1, 2))
	for i := range in {
		in[i] = byte(rng.Uint32())
	}
	inPath, outPath := filepath.Join(dir, "in"), filepath.Join(dir, "out")
	if err := os.WriteFile(inPath, in, 0o644); err != nil {
		t.Fatal(err)
	}
	run(t, "nbdcopy", "--flush", inPath, f.uri("disk"))
	run(t, "nbdcopy", f.uri("disk"), outPath)

	want := bytes.Clone(in)
	clear(want[3*mib/2 : 2*mib]) // the zero target drops writes
	out, err := os.ReadFile(outPath)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(out, want) {
		t.Fatalf("read back differs at byte %d", firstDiff(out, want))
	}
	if got := f.backingBytes(t, 0, diskSize); !bytes.Equal(got, want) {
		t.Fatalf("backing files differ from the input at virtual byte %d", firstDiff(got, want))
	}
}

func TestQemuIO(t *testing.T) {
	nbdtest.Tool(t, "qemu-io")
	f := newDiskFix(t)
	// Writes straddling every line boundary, with distinct patterns.
	cmds := []struct {
		off, n  int64
		pattern byte
	}{
		{mib - 4096, 8192, 0x11},           // A | B
		{3*mib/2 - 512, 1024, 0x22},        // B | zero
		{2*mib - 4096, 4096 + 65536, 0x33}, // zero | striped A | striped B
		{3*mib - 512, 1024, 0x44},          // striped B | B
	}
	args := []string{"-f", "raw"}
	for _, c := range cmds {
		args = append(args, "-c", fmt.Sprintf("write -P 0x%x %d %d", c.pattern, c.off, c.n))
	}
	args = append(args, "-c", "flush")
	args = append(args, "-c", fmt.Sprintf("read -P 0x11 %d 8192", mib-4096))
	args = append(args, "-c", fmt.Sprintf("aio_write -P 0x55 %d 4096", 3*mib+65536), "-c", "aio_flush")
	args = append(args, f.uri("disk"))
	out := run(t, "qemu-io", args...)
	if strings.Contains(out, "error") || strings.Contains(out, "failed") {
		t.Fatalf("qemu-io: %s", out)
	}
	cmds = append(cmds, struct {
		off, n  int64
		pattern byte
	}{3*mib + 65536, 4096, 0x55})
	for _, c := range cmds {
		got := f.backingBytes(t, c.off, c.n)
		for i, b := range got {
			file, _ := where(c.off + int64(i))
			if want := map[bool]byte{true: 0, false: c.pattern}[file == ""]; b != want {
				t.Fatalf("write %#x at %d: virtual byte %d is %#x on disk, want %#x", c.pattern, c.off, c.off+int64(i), b, want)
			}
		}
	}
}

// TestNbdsh drives every command through libnbd's Python bindings,
// including many asynchronous requests in flight at once.
func TestNbdsh(t *testing.T) {
	f := newDiskFix(t)
	script := `
import nbd
h.add_meta_context("base:allocation")
h.connect_uri(URI)
assert h.get_size() == 4*1024*1024
for cap in ("flush", "fua", "trim", "zero", "fast_zero", "cache", "multi_conn", "df"):
    assert getattr(h, "can_" + cap)(), cap
assert h.can_meta_context("base:allocation")

M = 1024*1024
data = bytes(range(256)) * 64   # 16 KiB
h.pwrite(data, M - 8192)
h.pwrite(data, 2*M + 60*1024, nbd.CMD_FLAG_FUA)
assert h.pread(len(data), M - 8192) == data
assert h.pread(len(data), 2*M + 60*1024) == data
h.flush()
h.cache(M, 0)

h.zero(4096, M - 8192, nbd.CMD_FLAG_NO_HOLE)
assert h.pread(4096, M - 8192) == bytes(4096)
assert h.pread(4096, M - 4096) == data[4096:8192]
h.zero(4096, M - 8192, nbd.CMD_FLAG_FAST_ZERO)
h.trim(65536, 3*M)

extents = []
def cb(metacontext, offset, entries, err):
    assert metacontext == "base:allocation"
    extents.extend(zip(entries[0::2], entries[1::2]))
h.block_status(M, M, cb)
assert sum(l for l, _ in extents) <= M and extents, extents
assert extents[0] == (8192, 0), extents      # the data written at 1M-8192 spills 8 KiB into B
extents.clear()
h.block_status(512*1024, 3*M//2, cb, nbd.CMD_FLAG_REQ_ONE)
assert len(extents) == 1 and extents[0][1] == 3, extents   # a hole in A

for op, args in (("pread", (512, 4*M)), ("pwrite", (b"x"*512, 4*M))):
    try:
        getattr(h, op)(*args)
        raise AssertionError(op + " past the end succeeded")
    except nbd.Error as e:
        assert e.errno in ("EINVAL", "ENOSPC"), e

# Many requests in flight: writes, then reads, completing in any order.
N = 48
bufs = [nbd.Buffer(4096) for _ in range(N)]
cookies = [h.aio_pwrite(bytes([i]) * 4096, 3*M + i*4096) for i in range(N)]
while h.aio_in_flight() > 0:
    h.poll(-1)
for c in cookies:
    assert h.aio_command_completed(c)
cookies = [h.aio_pread(bufs[i], 3*M + i*4096) for i in range(N)]
peak = h.aio_in_flight()
while h.aio_in_flight() > 0:
    h.poll(-1)
for i, c in enumerate(cookies):
    assert h.aio_command_completed(c)
    assert bufs[i].to_bytearray() == bytes([i]) * 4096, i
h.aio_flush()
while h.aio_in_flight() > 0:
    h.poll(-1)
print("OK", peak)
`
	out := output(t, nbdtest.Nbdsh(t, "-c", fmt.Sprintf("URI = %q", f.uri("disk")), "-c", script))
	if !strings.HasPrefix(out, "OK ") {
		t.Fatalf("nbdsh: %s", out)
	}
	t.Logf("libnbd had %s requests in flight at once", strings.TrimSpace(strings.TrimPrefix(out, "OK ")))
	// The async writes landed where the table says.
	for i := range 48 {
		got := f.backingBytes(t, 3*mib+int64(i)*4096, 4096)
		if !bytes.Equal(got, bytes.Repeat([]byte{byte(i)}, 4096)) {
			t.Fatalf("async write %d: backing bytes %x...", i, got[:8])
		}
	}
	st := f.srv.Stats().Exports[0]
	for _, op := range []string{"read", "write", "flush", "trim", "write_zeroes", "cache", "block_status"} {
		if st.Ops[op].Requests == 0 {
			t.Errorf("no %s request counted: %+v", op, st.Ops)
		}
	}
}

func firstDiff(a, b []byte) int {
	for i := range min(len(a), len(b)) {
		if a[i] != b[i] {
			return i
		}
	}
	return min(len(a), len(b))
}
