package remote

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/nbdmapper/nbdmapper/backing"
	"github.com/nbdmapper/nbdmapper/discard"
	"github.com/nbdmapper/nbdmapper/flush"
	"github.com/nbdmapper/nbdmapper/internal/testing/nbdtest"
	"github.com/nbdmapper/nbdmapper/mapped"
	"github.com/nbdmapper/nbdmapper/table"
)

// TestPoolOpensEachRemoteOnce: however a table spells a remote export,
// and however many lines name it, the Pool opens it once.
func TestPoolOpensEachRemoteOnce(t *testing.T) {
	dir := shortDir(t)
	k := startNbdkit(t, dir, "k", "file", sparseFile(t, dir, "f", 4*mib))
	s := &Scheme{Options: testOptions(t)}
	pool := &backing.Pool{Schemes: []backing.Scheme{s}}
	defer pool.Close()
	spellings := []string{
		"nbd+unix:///e?socket=" + k.Sock,
		"NBD+UNIX:///e?socket=" + k.Sock,
		"nbd+unix:///%65?socket=" + k.Sock,
		"nbd+unix:///e?socket=" + dir + "/./k.sock",
	}
	var first backing.Device
	for _, name := range spellings {
		d, err := pool.Open(name)
		if err != nil {
			t.Fatal(err)
		}
		if first == nil {
			first = d
		} else if d != first {
			t.Fatalf("%s opened as another device than %s", name, spellings[0])
		}
	}
	if n := len(pool.Devices()); n != 1 {
		t.Fatalf("pool has %d devices", n)
	}
	if n := k.Connects(); n != DefaultConnections {
		t.Fatalf("nbdkit saw %d connections, want one device's %d", n, DefaultConnections)
	}
	if _, err := pool.Open("nbd+unix:///e"); err == nil || !strings.Contains(err.Error(), "socket") {
		t.Fatalf("a malformed URI: %v", err)
	}

	// Released as often as opened, the device closes: its connections
	// end and the scheme lists it no more.
	for range spellings {
		if err := pool.Release(first); err != nil {
			t.Fatal(err)
		}
	}
	if n := len(s.Devices()); n != 0 {
		t.Errorf("the scheme lists %d devices after the last release, want 0", n)
	}
	nbdtest.Until(t, "nbdkit's connections to end", func() bool { return k.Disconnects() == k.Connects() })
}

// remoteRig is a mapped device over a table of remote exports, each a
// nbdkit on a unix socket, with the server's engines, as `nbdmapper serve`
// builds it.
type remoteRig struct {
	remotes []*nbdtest.Peer
	files   []string
	dev     *mapped.Device
	flush   *flush.Engine
	disc    *discard.Engine
	scheme  *Scheme
}

// newRemoteRig starts n nbdkits over files of size bytes (with extra
// nbdkit arguments, before the plugin), and builds the table
// gen(uris) returns.
func newRemoteRig(t *testing.T, n int, size int64, extra []string, gen func(uris []string) string) *remoteRig {
	dir := shortDir(t)
	r := &remoteRig{flush: flush.New(), disc: discard.New()}
	var uris []string
	for i := range n {
		file := sparseFile(t, dir, fmt.Sprintf("r%d.img", i), size)
		// nbdkit takes --filter options before the plugin, parameters after.
		var flags, params []string
		for _, a := range extra {
			if strings.HasPrefix(a, "--") {
				flags = append(flags, a)
			} else {
				params = append(params, a)
			}
		}
		args := append(append(flags, "file", file), params...)
		p := startNbdkit(t, dir, fmt.Sprintf("r%d", i), args...)
		r.remotes, r.files = append(r.remotes, p), append(r.files, file)
		uris = append(uris, p.URI(""))
	}
	r.scheme = &Scheme{Options: testOptions(t)}
	pool := &backing.Pool{Wrap: r.flush.Track, Schemes: []backing.Scheme{r.scheme}}
	t.Cleanup(func() { pool.Close() })
	tb, err := table.Parse("remote.table", strings.NewReader(gen(uris)), pool)
	if err != nil {
		t.Fatal(err)
	}
	if got := len(pool.Devices()); got != n {
		t.Fatalf("the pool opened %d devices for %d remotes", got, n)
	}
	r.dev = mapped.New("r", tb, r.flush, r.disc)
	return r
}

// linear1024 is 1024 equal linear segments spread over the remotes:
// segment i is on remote i%n, in slot (i/n*389) mod per of it, so that
// neighbours on the virtual device are far apart on their remote.
func linear1024(size int64) func(uris []string) string {
	return func(uris []string) string {
		n := int64(len(uris))
		per := int64(1024) / n
		seg := size / per / 512
		var b strings.Builder
		for i := int64(0); i < 1024; i++ {
			slot := (i / n * 389) % per
			fmt.Fprintf(&b, "%d %d linear %s %d\n", i*seg, seg, uris[i%n], slot*seg)
		}
		return b.String()
	}
}

// place is where the table puts virtual byte v: remote and offset there.
func place(tb *table.Table, v int64) (backing.Device, int64) {
	var dev backing.Device
	var off int64
	tb.Map(v, 1, func(e table.Extent) bool { dev, off = e.Dev, e.Off; return false })
	return dev, off
}

// TestLinear1024Placement writes through a 1024-segment table over four
// remotes and finds every byte on the remote file and offset the table
// says; one flush sends one NBD FLUSH to each remote written, none to the
// clean one; a whole-device trim reaches each remote as the fewest TRIMs
// its maximum allows.
func TestLinear1024Placement(t *testing.T) {
	const size = 16 * mib // per remote
	const maxTrim = 4 * mib
	r := newRemoteRig(t, 4, size, []string{"--filter=blocksize-policy",
		"blocksize-minimum=512", "blocksize-preferred=4096", "blocksize-maximum=4M", "blocksize-error-policy=error"},
		linear1024(size))
	tb := r.dev.Table()
	total := r.dev.Size()
	if total != 4*size {
		t.Fatalf("device of %d bytes", total)
	}
	rng := rand.New(rand.NewPCG(5, 6))
	type write struct {
		off int64
		p   []byte
	}
	var writes []write
	for i := range 300 {
		n := rng.Int64N(192<<10) + 1
		off := rng.Int64N(total - n)
		touches3 := false
		tb.Map(off, n, func(e table.Extent) bool {
			touches3 = e.Dev.Name() == r.remotes[3].URI("")
			return !touches3
		})
		if touches3 {
			continue // leave remote 3 clean for the flush check
		}
		p := pattern(int(n), byte(i))
		if err := r.dev.Write(p, off, false); err != nil {
			t.Fatal(err)
		}
		writes = append(writes, write{off, p})
	}
	flushes := func() []int {
		out := make([]int, len(r.remotes))
		for i, p := range r.remotes {
			out[i] = p.Count("Flush")
		}
		return out
	}
	if err := r.dev.Flush(); err != nil {
		t.Fatal(err)
	}
	if got := flushes(); fmt.Sprint(got) != "[1 1 1 0]" {
		t.Fatalf("NBD flushes per remote after one client flush: %v, want [1 1 1 0]", got)
	}
	if err := r.dev.Flush(); err != nil {
		t.Fatal(err)
	}
	if got := flushes(); fmt.Sprint(got) != "[1 1 1 0]" {
		t.Fatalf("a flush with nothing written sent NBD flushes: %v", got)
	}
	// Byte placement: each write's bytes are where the table maps them,
	// on the remote's own file (later writes win where they overlap).
	model := make([]byte, total)
	for _, w := range writes {
		copy(model[w.off:], w.p)
	}
	fileOf := map[string]string{}
	for i, p := range r.remotes {
		fileOf[p.URI("")] = r.files[i]
	}
	for v := int64(0); v < total; v += 997 {
		want := model[v]
		dev, off := place(tb, v)
		if got := readFile(t, fileOf[dev.Name()], off, 1)[0]; got != want {
			t.Fatalf("virtual byte %d: %#x on %s at %d, want %#x", v, got, dev.Name(), off, want)
		}
	}
	// A whole-device trim: per remote, the 256 segments merge into one
	// range, split at the remote's 4 MiB maximum.
	trims := make([]int, len(r.remotes))
	for i, p := range r.remotes {
		trims[i] = p.Count("Trim")
	}
	if err := r.dev.Trim(0, total, false); err != nil {
		t.Fatal(err)
	}
	for i, p := range r.remotes {
		if got, want := p.Count("Trim")-trims[i], int(size/maxTrim); got != want {
			t.Errorf("remote %d got %d TRIMs for the whole device, want %d: %v", i, got, want, p.LogLines("Trim"))
		}
	}
	for i := range r.remotes {
		if st := r.scheme.Stats()[i]; st.ErrorReplies != 0 {
			t.Errorf("remote %d: %d error replies (a request broke its limits)", i, st.ErrorReplies)
		}
	}
}

// TestStripedPlacement: a striped table over four remotes puts chunk k of
// the virtual device on remote k%4 at chunk k/4.
func TestStripedPlacement(t *testing.T) {
	const size = 8 * mib
	const chunk = 64 << 10
	r := newRemoteRig(t, 4, size, nil, func(uris []string) string {
		args := ""
		for _, u := range uris {
			args += " " + u + " 0"
		}
		return fmt.Sprintf("0 %d striped 4 %d%s\n", 4*size/512, chunk/512, args)
	})
	total := r.dev.Size()
	data := make([]byte, total)
	for i := range data {
		data[i] = byte(i*31 + i>>16)
	}
	start := time.Now()
	for off := int64(0); off < total; off += 3 * mib {
		n := min(3*mib, total-off)
		if err := r.dev.Write(data[off:off+n], off, false); err != nil {
			t.Fatal(err)
		}
	}
	if err := r.dev.Flush(); err != nil {
		t.Fatal(err)
	}
	t.Logf("wrote %d MiB striped over 4 remotes in %v", total/mib, time.Since(start).Round(time.Millisecond))
	for k := int64(0); k < total/chunk; k++ {
		remote, at := k%4, k/4*chunk
		mustEqual(t, fmt.Sprintf("chunk %d on remote %d", k, remote),
			readFile(t, r.files[remote], at, chunk), data[k*chunk:(k+1)*chunk])
	}
	for i, p := range r.remotes {
		if n := p.Count("Flush"); n != 1 {
			t.Errorf("remote %d got %d flushes, want 1", i, n)
		}
	}
}

// A remote whose handshake hangs (nbdkit's delay filter holds its open)
// holds up only the Open of that remote: the pool opens other devices
// meanwhile, as a table load, a create or a reload elsewhere asks it to.
func TestPoolOpensOthersWhileARemoteDials(t *testing.T) {
	dir := shortDir(t)
	slow := startNbdkit(t, dir, "slow", "--filter=delay", "file", sparseFile(t, dir, "s.img", 4*mib), "delay-open=3600")
	file := sparseFile(t, dir, "f.img", 4*mib)
	opts := testOptions(t)
	opts.Timeout, opts.DialTimeout = time.Hour, time.Hour
	pool := &backing.Pool{Schemes: []backing.Scheme{&Scheme{Options: opts}}}
	go pool.Open(slow.URI("")) // ends when the test stops nbdkit
	// nbdkit logs a connection once it is open: count the socket's
	// entries in /proc/net/unix instead, the listener and, once nbdkit
	// has accepted the pool's connection, its end of it.
	nbdtest.Until(t, "nbdkit to accept the remote's connection", func() bool {
		b, err := os.ReadFile("/proc/net/unix")
		return err == nil && bytes.Count(b, []byte(" "+slow.Sock+"\n")) >= 2
	})
	opened := make(chan error, 1)
	go func() {
		d, err := pool.Open(file)
		if err == nil {
			err = pool.Release(d)
		}
		opened <- err
	}()
	if err := nbdtest.Recv(t, opened, "a file to open while a remote dials"); err != nil {
		t.Fatal(err)
	}
}
