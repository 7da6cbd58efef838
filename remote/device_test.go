package remote

import (
	"errors"
	"math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"syscall"
	"testing"

	"github.com/nbdmapper/nbdmapper/backing"
	"github.com/nbdmapper/nbdmapper/discard"
	"github.com/nbdmapper/nbdmapper/flush"
	"github.com/nbdmapper/nbdmapper/internal/testing/nbdtest"
	"github.com/nbdmapper/nbdmapper/mapped"
	"github.com/nbdmapper/nbdmapper/nbdtarget"
	"github.com/nbdmapper/nbdmapper/table"
)

const mib = 1 << 20

// server is one real NBD server exporting file, for tests that run the
// same checks against each kind.
type server struct {
	name string
	uri  string
	file string
}

// servers starts nbdkit (file plugin), qemu-nbd and nbdmapper's own
// server (in process, over a table on the file), each over its own
// sparse file of size bytes, skipping those not installed.
func servers(t *testing.T, size int64) []server {
	dir := shortDir(t)
	var out []server
	for _, kind := range []string{"nbdkit", "qemu-nbd", "nbdmapper"} {
		file := sparseFile(t, dir, kind+".img", size)
		switch kind {
		case "nbdkit":
			if _, err := lookPath("nbdkit"); err != nil {
				continue
			}
			p := startNbdkit(t, dir, "k", "file", file)
			out = append(out, server{kind, p.URI(""), file})
		case "qemu-nbd":
			if _, err := lookPath("qemu-nbd"); err != nil {
				continue
			}
			p := nbdtest.StartQemuNbd(t, dir, "q", file, nbdtest.PeerOptions{})
			out = append(out, server{kind, p.URI("e"), file})
		case "nbdmapper":
			out = append(out, server{kind, serveFile(t, file, size), file})
		}
	}
	return out
}

// serveFile serves file through nbdmapper's own server, in this process,
// as export "e" over a one-line linear table, and returns its URI.
func serveFile(t testing.TB, file string, size int64) string {
	t.Helper()
	f := flush.New()
	pool := &backing.Pool{Wrap: f.Track}
	t.Cleanup(func() { pool.Close() })
	tb, err := table.Parse("e.table", stringsReader("0 "+itoa(size/512)+" linear "+file+" 0\n"), pool)
	if err != nil {
		t.Fatal(err)
	}
	srv := &nbdtarget.Server{Exports: []*nbdtarget.Export{{Name: "e", Dev: mapped.New("e", tb, f, discard.New())}}}
	sock := nbdtest.ServeUnix(t, srv, nbdtarget.ErrServerClosed)
	return nbdtest.URI(sock, "e")
}

// TestReadWrite writes and reads random ranges through the client against
// each real server and checks every byte against the server's file.
func TestReadWrite(t *testing.T) {
	const size = 16 * mib
	for _, s := range servers(t, size) {
		t.Run(s.name, func(t *testing.T) {
			d := openURI(t, s.uri, testOptions(t))
			if d.Size() != size {
				t.Fatalf("size %d, want %d", d.Size(), size)
			}
			model := make([]byte, size)
			rng := rand.New(rand.NewPCG(1, 2))
			for i := range 200 {
				n := rng.Int64N(256<<10) + 1
				if i%10 == 0 {
					n = rng.Int64N(40*mib) % size // long: split at 32 MiB or the remote's maximum
				}
				off := rng.Int64N(size - n + 1)
				p := pattern(int(n), byte(i))
				if _, err := d.WriteAt(p, off); err != nil {
					t.Fatalf("write %d+%d: %v", off, n, err)
				}
				copy(model[off:], p)
				readBack(t, d, off, model[off:off+n])
			}
			syncedFile(t, d, s.file, model)
			if st := d.Stats(); st.Requests["flush"] != 1 || st.Unflushed != 0 || st.Lost {
				t.Errorf("stats after one flush: %+v", st)
			}
		})
	}
}

// TestZeroTrimHoles zeroes, trims and asks for holes through each server
// and checks the file and the answers.
func TestZeroTrimHoles(t *testing.T) {
	const size = 8 * mib
	for _, s := range servers(t, size) {
		t.Run(s.name, func(t *testing.T) {
			d := openURI(t, s.uri, testOptions(t))
			if _, err := d.WriteAt(pattern(4*mib, 1), 2*mib); err != nil {
				t.Fatal(err)
			}
			if err := d.Zero(2*mib, 64<<10, false); err != nil {
				t.Fatal(err)
			}
			if err := d.Zero(3*mib, 1*mib, true); err != nil {
				t.Fatal(err)
			}
			if err := d.Discard(5*mib, 1*mib); err != nil {
				t.Fatal(err)
			}
			if err := d.Sync(); err != nil {
				t.Fatal(err)
			}
			got := readFile(t, s.file, 2*mib, 2*mib)
			want := pattern(4*mib, 1)[:2*mib]
			clear(want[:64<<10])
			clear(want[1*mib:])
			mustEqual(t, "zeroed ranges", got, want)

			holes, err := d.Holes(0, size)
			if err != nil {
				t.Fatal(err)
			}
			// Whatever the server reports must be real holes of the file:
			// each reads as zeros.
			for _, h := range holes {
				for _, b := range readFile(t, s.file, h.Off, h.Len) {
					if b != 0 {
						t.Fatalf("hole %v reads non-zero", h)
					}
				}
			}
			if d.x.Meta && (len(holes) == 0 || holes[0].Off != 0 || holes[0].Len < 2*mib) {
				t.Errorf("holes %v: want the unwritten first 2 MiB among them", holes)
			}
			fast := d.ZeroFast(0, 1*mib, true)
			switch {
			case d.flag(0x800) && fast != nil && !errors.Is(fast, backing.ErrNotSupported):
				t.Errorf("ZeroFast: %v", fast)
			case !d.flag(0x800) && !errors.Is(fast, backing.ErrNotSupported):
				t.Errorf("ZeroFast without SEND_FAST_ZERO: %v, want ErrNotSupported", fast)
			}
		})
	}
}

// TestMultiConn: an export with CAN_MULTI_CONN gets Options.Connections
// connections, and requests spread over them.
func TestMultiConn(t *testing.T) {
	dir := shortDir(t)
	k := startNbdkit(t, dir, "k", "file", sparseFile(t, dir, "f", 4*mib))
	opts := testOptions(t)
	opts.Connections = 3
	d := openURI(t, k.URI(""), opts)
	if st := d.Stats(); st.Connections != 3 || st.Wanted != 3 || st.State != StateUp {
		t.Fatalf("stats %+v, want 3 connections up", st)
	}
	if n := k.Connects(); n != 3 {
		t.Fatalf("nbdkit saw %d connections, want 3", n)
	}
	errs := make(chan error, 64)
	for i := range 64 {
		go func() {
			_, err := d.WriteAt(pattern(64<<10, byte(i)), int64(i)*64<<10)
			errs <- err
		}()
	}
	for range 64 {
		if err := nbdtest.Recv(t, errs, "a write"); err != nil {
			t.Fatal(err)
		}
	}
	if err := d.Sync(); err != nil {
		t.Fatal(err)
	}
	if n := k.Count("Flush"); n != 1 {
		t.Fatalf("%d flushes reached nbdkit, want 1 (multi-conn: one flush covers every connection)", n)
	}
}

// TestBlockSizeLimits runs against nbdkit advertising a 4 KiB minimum and
// a 64 KiB maximum and refusing (EINVAL) any request that breaks them: the
// client must align every request and split long ones.
func TestBlockSizeLimits(t *testing.T) {
	dir := shortDir(t)
	const size = 4 * mib
	file := sparseFile(t, dir, "f", size)
	k := startNbdkit(t, dir, "k", "--filter=blocksize-policy", "file", file,
		"blocksize-minimum=4096", "blocksize-preferred=4096", "blocksize-maximum=64K", "blocksize-error-policy=error")
	d := openURI(t, k.URI(""), testOptions(t))
	if d.minBlock != 4096 || d.maxIO != 64<<10 || d.Limits() != (backing.Limits{Granularity: 4096, MaxBytes: 64 << 10, RequestMemory: 2 * 4096}) {
		t.Fatalf("min %d, max io %d, limits %+v", d.minBlock, d.maxIO, d.Limits())
	}
	model := readFile(t, file, 0, size)
	rng := rand.New(rand.NewPCG(3, 4))
	for i := range 100 {
		n := rng.Int64N(300<<10) + 1
		off := rng.Int64N(size - n + 1)
		switch i % 3 {
		case 0, 1:
			p := pattern(int(n), byte(i))
			if _, err := d.WriteAt(p, off); err != nil {
				t.Fatalf("write %d+%d: %v", off, n, err)
			}
			copy(model[off:], p)
		case 2:
			if err := d.Zero(off, n, i%2 == 0); err != nil {
				t.Fatalf("zero %d+%d: %v", off, n, err)
			}
			clear(model[off : off+n])
		}
		readBack(t, d, off, model[off:off+n])
	}
	syncedFile(t, d, file, model)

	// A trim is cut inward to whole blocks and split at the maximum.
	before := k.Count("Trim")
	if err := d.Discard(1000, mib); err != nil {
		t.Fatal(err)
	}
	if got, want := k.Count("Trim")-before, int((mib-4096)/(64<<10))+1; got != want {
		t.Fatalf("%d trims reached nbdkit for 1 MiB, want %d", got, want)
	}
	if st := d.Stats(); st.ErrorReplies != 0 {
		t.Fatalf("%d error replies: a request broke the limits", st.ErrorReplies)
	}
}

// TestNoFlushRefused: a writable remote must advertise SEND_FLUSH, or no
// flush could make its writes durable. nbdkit's eval plugin with no flush
// script advertises none.
func TestNoFlushRefused(t *testing.T) {
	dir := shortDir(t)
	k := startNbdkit(t, dir, "k", "eval", "get_size=echo 1048576",
		"pread=dd if=/dev/zero count=$3 iflag=count_bytes status=none", "pwrite=cat >/dev/null")
	if x, err := dialExport(k.Sock, ""); err != nil || x.Flags&0x4 != 0 {
		t.Fatalf("the eval plugin advertises flags %#x (%v); want no SEND_FLUSH", x.Flags, err)
	}
	u, _ := ParseURI(k.URI(""))
	if d, err := Open(k.URI(""), u, false, testOptions(t)); !errors.Is(err, ErrNoFlush) {
		if d != nil {
			d.Close()
		}
		t.Fatalf("Open of a writable export without SEND_FLUSH: %v, want ErrNoFlush", err)
	}
	// Read-only it is fine: nothing needs flushing.
	d, err := Open(k.URI(""), u, true, testOptions(t))
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	if _, err := d.WriteAt([]byte{1}, 0); !errors.Is(err, syscall.EROFS) {
		t.Fatalf("write to a read-only remote: %v, want EROFS", err)
	}
	if err := d.Sync(); err != nil {
		t.Fatal(err)
	}
	b := make([]byte, 4096)
	if _, err := d.ReadAt(b, 4096); err != nil {
		t.Fatal(err)
	}
}

func dialExport(sock, export string) (Export, error) {
	nc, err := net.Dial("unix", sock)
	if err != nil {
		return Export{}, err
	}
	defer nc.Close()
	return Handshake(nc, HandshakeOptions{Export: export})
}

func lookPath(name string) (string, error) {
	for _, dir := range filepath.SplitList(os.Getenv("PATH")) {
		p := filepath.Join(dir, name)
		if st, err := os.Stat(p); err == nil && !st.IsDir() && st.Mode()&0o111 != 0 {
			return p, nil
		}
	}
	return "", os.ErrNotExist
}
