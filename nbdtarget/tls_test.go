package nbdtarget

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/binary"
	"errors"
	"io/fs"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/nbdmapper/nbdmapper/backing"
	"github.com/nbdmapper/nbdmapper/internal/testing/nbdtest"
	"github.com/nbdmapper/nbdmapper/table"
	"github.com/nbdmapper/nbdmapper/wire"
)

const repPOLICY, repTLSREQD = 1<<31 + 2, 1<<31 + 5

// tlsFix is a server with TLS on a unix socket and on loopback TCP, and
// certificate directories for the clients the tests play:
//
//	alice     CN=alice, read-write on "secret"
//	reader    CN=reader DNS:reader.example, read-only on "secret" (by SAN)
//	mallory   CN=mallory, same CA, not named by "secret"
//	stranger  CN=alice, but issued by another CA
//	nocert    the CA only: no client certificate
//
// Exports: "main" (1 MiB, anyone who gets through TLS) and "secret"
// (512 KiB, Access as above).
type tlsFix struct {
	srv   *Server
	sock  string
	addr  string
	ca    *nbdtest.CA
	certs *Certs
	dir   string // server cert, key and CA files
	dirs  map[string]string
}

func newTLSFix(t *testing.T, mode TLSMode) *tlsFix {
	t.Helper()
	f := &tlsFix{ca: nbdtest.NewCA(t, "test CA"), dir: t.TempDir(), dirs: map[string]string{}}
	srvLeaf := f.ca.Server(t)
	nbdtest.CertDir(t, f.dir, f.ca, &srvLeaf, nil)
	base := t.TempDir()
	clients := map[string]nbdtest.Leaf{
		"alice":   f.ca.Client(t, "alice"),
		"reader":  f.ca.Client(t, "reader", "reader.example"),
		"mallory": f.ca.Client(t, "mallory"),
	}
	for name, leaf := range clients {
		f.dirs[name] = nbdtest.CertDir(t, filepath.Join(base, name), f.ca, nil, &leaf)
	}
	other := nbdtest.NewCA(t, "other CA")
	stranger := other.Client(t, "alice")
	// The stranger trusts our CA for the server but holds another CA's
	// client certificate.
	f.dirs["stranger"] = nbdtest.CertDir(t, filepath.Join(base, "stranger"), f.ca, nil, &stranger)
	f.dirs["nocert"] = nbdtest.CertDir(t, filepath.Join(base, "nocert"), f.ca, nil, nil)

	var err error
	f.certs, err = LoadCerts(filepath.Join(f.dir, "server-cert.pem"), filepath.Join(f.dir, "server-key.pem"), filepath.Join(f.dir, "ca-cert.pem"))
	if err != nil {
		t.Fatal(err)
	}
	main := newExport(t, "main", seg{len: 1 << 20, dev: backing.NewMem("a", 1<<20)})
	secret := newExport(t, "secret", seg{len: 512 << 10, dev: backing.NewMem("b", 512<<10)})
	secret.Access = &Access{ReadWrite: []string{"alice"}, ReadOnly: []string{"DNS:reader.example"}}
	f.srv = &Server{Exports: []*Export{main, secret}, TLSConfig: f.certs.Config(), TLS: mode}
	f.sock = nbdtest.ServeUnix(t, f.srv, ErrServerClosed)
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	f.addr = l.Addr().String()
	done := make(chan error, 1)
	go func() { done <- f.srv.Serve(l) }()
	t.Cleanup(func() {
		f.srv.Shutdown(context.Background())
		if err := <-done; !errors.Is(err, ErrServerClosed) {
			t.Errorf("Serve(tcp) = %v", err)
		}
	})
	return f
}

// unixURI and tcpURI are libnbd URIs for an export as client who.
func (f *tlsFix) unixURI(export, who string) string {
	return "nbds+unix:///" + export + "?socket=" + f.sock + "&tls-certificates=" + f.dirs[who]
}

func (f *tlsFix) tcpURI(export, who string) string {
	return "nbds://" + f.addr + "/" + export + "?tls-certificates=" + f.dirs[who]
}

// goClient is a crypto/tls client config for client who.
func (f *tlsFix) goClient(t *testing.T, who string) *tls.Config {
	t.Helper()
	pool := x509.NewCertPool()
	pool.AddCert(f.ca.Cert)
	cfg := &tls.Config{RootCAs: pool, ServerName: "localhost"}
	if who != "nocert" {
		cert, err := tls.LoadX509KeyPair(filepath.Join(f.dirs[who], "client-cert.pem"), filepath.Join(f.dirs[who], "client-key.pem"))
		if err != nil {
			t.Fatal(err)
		}
		cfg.Certificates = []tls.Certificate{cert}
	}
	return cfg
}

// startTLS sends STARTTLS on a greeted raw connection and continues over
// TLS as client who.
func (c *rawClient) startTLS(cfg *tls.Config) *tls.Conn {
	c.t.Helper()
	c.option(5, nil)
	if r := c.reply(); r.typ != repACK {
		c.t.Fatalf("STARTTLS: reply %#x %q", r.typ, r.data)
	}
	tc := tls.Client(c.nc, cfg)
	if err := tc.Handshake(); err != nil {
		c.t.Fatalf("TLS handshake: %v", err)
	}
	c.nc = tc
	return tc
}

// exportNameCloses sends EXPORT_NAME, which has no error reply, and
// checks that the server closes the connection.
func (c *rawClient) exportNameCloses(name string) {
	c.t.Helper()
	c.option(1, []byte(name))
	if !c.closed() {
		c.t.Fatalf("EXPORT_NAME %q: connection still open", name)
	}
}

// listNames runs LIST and returns the names.
func (c *rawClient) listNames() []string {
	c.t.Helper()
	c.option(3, nil)
	var names []string
	for _, r := range c.replies() {
		switch r.typ {
		case repSERVER:
			n := binary.BigEndian.Uint32(r.data)
			names = append(names, string(r.data[4:4+n]))
		case repACK:
		default:
			c.t.Fatalf("LIST: reply %#x %q", r.typ, r.data)
		}
	}
	return names
}

func TestStartTLSHandshake(t *testing.T) {
	tests := []struct {
		name string
		mode TLSMode
		run  func(t *testing.T, f *tlsFix, c *rawClient)
	}{
		{"require: options before STARTTLS get ERR_TLS_REQD, in sync", TLSRequire, func(t *testing.T, f *tlsFix, c *rawClient) {
			c.greet(3)
			for _, o := range []struct {
				id   uint32
				data []byte
			}{{3, nil}, {6, infoData("main")}, {7, infoData("main")}, {8, nil}, {9, metaData("main")}, {99, []byte("x")}} {
				c.option(o.id, o.data)
				if r := c.reply(); r.typ != repTLSREQD || r.opt != o.id {
					t.Fatalf("option %d: reply %#x for %d, want ERR_TLS_REQD", o.id, r.typ, r.opt)
				}
			}
			c.startTLS(f.goClient(t, "alice"))
			if got := c.listNames(); strings.Join(got, ",") != "main,secret" {
				t.Fatalf("LIST over TLS: %v", got)
			}
		}},
		{"require: EXPORT_NAME before STARTTLS closes", TLSRequire, func(t *testing.T, f *tlsFix, c *rawClient) {
			c.greet(3)
			c.exportNameCloses("main")
		}},
		{"require: ABORT before STARTTLS is acknowledged", TLSRequire, func(t *testing.T, f *tlsFix, c *rawClient) {
			c.greet(3)
			c.option(2, nil)
			if r := c.reply(); r.typ != repACK {
				t.Fatalf("ABORT: reply %#x", r.typ)
			}
			if !c.closed() {
				t.Fatal("connection still open")
			}
		}},
		{"STARTTLS with data gets ERR_INVALID", TLSOn, func(t *testing.T, f *tlsFix, c *rawClient) {
			c.greet(3)
			c.option(5, []byte("x"))
			if r := c.reply(); r.typ != repINVALID {
				t.Fatalf("reply %#x", r.typ)
			}
			c.startTLS(f.goClient(t, "alice"))
		}},
		{"bytes pipelined after STARTTLS close the connection", TLSOn, func(t *testing.T, f *tlsFix, c *rawClient) {
			c.greet(3)
			// STARTTLS and a LIST in one write: the LIST must not be
			// taken as if it had come through TLS.
			b := binary.BigEndian.AppendUint64(nil, 0x49484156454F5054)
			b = binary.BigEndian.AppendUint32(b, 5)
			b = binary.BigEndian.AppendUint32(b, 0)
			b = binary.BigEndian.AppendUint64(b, 0x49484156454F5054)
			b = binary.BigEndian.AppendUint32(b, 3)
			b = binary.BigEndian.AppendUint32(b, 0)
			c.write(b)
			if !c.closed() {
				t.Fatal("connection still open")
			}
		}},
		{"second STARTTLS gets ERR_INVALID inside TLS", TLSOn, func(t *testing.T, f *tlsFix, c *rawClient) {
			c.greet(3)
			c.startTLS(f.goClient(t, "alice"))
			c.option(5, nil)
			if r := c.reply(); r.typ != repINVALID {
				t.Fatalf("reply %#x", r.typ)
			}
		}},
		{"STARTTLS resets structured replies", TLSOn, func(t *testing.T, f *tlsFix, c *rawClient) {
			c.greet(3)
			c.option(8, nil)
			if r := c.reply(); r.typ != repACK {
				t.Fatalf("STRUCTURED_REPLY: %#x", r.typ)
			}
			c.startTLS(f.goClient(t, "alice"))
			c.option(9, metaData("main"))
			if r := c.reply(); r.typ != repINVALID {
				t.Fatalf("LIST_META_CONTEXT without structured replies after STARTTLS: %#x", r.typ)
			}
		}},
		{"on: plaintext sees only exports without Access", TLSOn, func(t *testing.T, f *tlsFix, c *rawClient) {
			c.greet(3)
			if got := c.listNames(); strings.Join(got, ",") != "main" {
				t.Fatalf("plaintext LIST: %v", got)
			}
			c.option(7, infoData("secret"))
			if r := c.reply(); r.typ != repTLSREQD {
				t.Fatalf("GO secret in plaintext: %#x, want ERR_TLS_REQD", r.typ)
			}
			if f := c.connect2("main"); f&(1<<1) != 0 {
				t.Fatalf("main flags %#x", f)
			}
		}},
		{"on: EXPORT_NAME of a TLS-only export in plaintext closes", TLSOn, func(t *testing.T, f *tlsFix, c *rawClient) {
			c.greet(3)
			c.exportNameCloses("secret")
		}},
		{"policy: a client not named gets ERR_POLICY and no listing", TLSRequire, func(t *testing.T, f *tlsFix, c *rawClient) {
			c.greet(3)
			c.startTLS(f.goClient(t, "mallory"))
			if got := c.listNames(); strings.Join(got, ",") != "main" {
				t.Fatalf("LIST as mallory: %v", got)
			}
			for _, id := range []uint32{6, 7} {
				c.option(id, infoData("secret"))
				if r := c.reply(); r.typ != repPOLICY {
					t.Fatalf("option %d for secret as mallory: %#x, want ERR_POLICY", id, r.typ)
				}
			}
			c.connect2("main")
		}},
		{"policy: EXPORT_NAME by a client not named closes", TLSRequire, func(t *testing.T, f *tlsFix, c *rawClient) {
			c.greet(3)
			c.startTLS(f.goClient(t, "mallory"))
			c.exportNameCloses("secret")
		}},
		{"policy: a client named read-only gets a read-only export", TLSRequire, func(t *testing.T, f *tlsFix, c *rawClient) {
			c.greet(3)
			c.startTLS(f.goClient(t, "reader"))
			if fl := c.connect2("secret"); fl&(1<<1) == 0 || fl&(1<<5) != 0 {
				t.Fatalf("flags %#x: want READ_ONLY and no SEND_TRIM", fl)
			}
			c.request(1, 0, 1, 0, 512, make([]byte, 512)) // WRITE
			if h, e, _ := c.simple(0); h != 1 || e != 1 {
				t.Fatalf("write as reader: handle %d errno %d, want EPERM", h, e)
			}
		}},
		{"policy: a client named read-write writes", TLSRequire, func(t *testing.T, f *tlsFix, c *rawClient) {
			c.greet(3)
			c.startTLS(f.goClient(t, "alice"))
			if fl := c.connect2("secret"); fl&(1<<1) != 0 {
				t.Fatalf("flags %#x: READ_ONLY for alice", fl)
			}
			c.request(1, 0, 1, 0, 512, make([]byte, 512))
			if h, e, _ := c.simple(0); h != 1 || e != 0 {
				t.Fatalf("write as alice: handle %d errno %d", h, e)
			}
		}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			f := newTLSFix(t, tc.mode)
			c := dialRaw(t, f.sock)
			tc.run(t, f, c)
			// The server goes on serving the next good client.
			c = dialRaw(t, f.sock)
			c.greet(3)
			c.startTLS(f.goClient(t, "alice"))
			c.connect2("secret")
		})
	}
}

// TestStartTLSOff: without TLS configured STARTTLS is ERR_UNSUP, and in
// TLSRequire mode without a config nobody gets in (fail closed).
func TestStartTLSOff(t *testing.T) {
	srv := twoExports(t)
	srv.TLS = TLSRequire
	c := dialRaw(t, nbdtest.ServeUnix(t, srv, ErrServerClosed))
	c.greet(3)
	c.option(5, nil)
	if r := c.reply(); r.typ != repUNSUP {
		t.Fatalf("STARTTLS without a config: %#x", r.typ)
	}
	c.option(3, nil)
	if r := c.reply(); r.typ != repTLSREQD {
		t.Fatalf("LIST: %#x", r.typ)
	}
}

// nbdinfo runs nbdinfo with args and returns its output and error.
func nbdinfo(t *testing.T, args ...string) (string, error) {
	t.Helper()
	out, err := exec.Command(nbdtest.Tool(t, "nbdinfo"), args...).CombinedOutput()
	return string(out), err
}

// TestTLSClients drives the TLS server with libnbd (nbdinfo, nbdsh),
// qemu-img, qemu-io and fio, over the unix socket and loopback TCP, and
// checks every refusal is a refusal and leaves the server serving.
func TestTLSClients(t *testing.T) {
	nbdtest.Tool(t, "nbdinfo")
	f := newTLSFix(t, TLSRequire)

	good := func(t *testing.T) {
		t.Helper()
		out, err := nbdinfo(t, "--size", f.unixURI("secret", "alice"))
		if err != nil || strings.TrimSpace(out) != "524288" {
			t.Fatalf("good client after a refusal: %v\n%s", err, out)
		}
	}
	t.Run("nbdinfo over nbds+unix and nbds://127.0.0.1", func(t *testing.T) {
		for _, uri := range []string{f.unixURI("main", "alice"), f.tcpURI("main", "alice")} {
			out, err := nbdinfo(t, "--size", uri)
			if err != nil || strings.TrimSpace(out) != "1048576" {
				t.Fatalf("nbdinfo %s: %v\n%s", uri, err, out)
			}
		}
		out, err := nbdinfo(t, "--list", "--json", f.tcpURI("", "mallory"))
		if err != nil || !strings.Contains(out, `"main"`) || strings.Contains(out, `"secret"`) {
			t.Fatalf("nbdinfo --list as mallory: %v\n%s", err, out)
		}
		out, err = nbdinfo(t, "--is", "readonly", f.unixURI("secret", "reader"))
		if err != nil {
			t.Fatalf("secret is not read-only for reader: %v\n%s", err, out)
		}
	})
	refusals := []struct {
		name, uri, want string
	}{
		{"plaintext client against require", "nbd+unix:///main?socket=" + f.sock, "TLS"},
		{"no client certificate", f.unixURI("main", "nocert"), ""},
		{"certificate from another CA", f.tcpURI("main", "stranger"), ""},
		{"subject not allowed", f.unixURI("secret", "mallory"), "policy"},
	}
	for _, r := range refusals {
		t.Run("refuses "+r.name, func(t *testing.T) {
			out, err := nbdinfo(t, "--size", r.uri)
			if err == nil {
				t.Fatalf("nbdinfo got in:\n%s", out)
			}
			if !strings.Contains(out, r.want) {
				t.Errorf("nbdinfo's error does not mention %q:\n%s", r.want, out)
			}
			t.Logf("refused: %s", strings.TrimSpace(out))
			good(t)
		})
	}
	t.Run("nbdsh writes and reads back", func(t *testing.T) {
		// libnbd takes tls-certificates from a URI only when allowed to
		// read local files.
		script := `
h.set_uri_allow_local_file(True)
h.connect_uri(uri)
h.pwrite(b"tls!" * 128, 4096)
assert h.pread(512, 4096) == b"tls!" * 128
h.flush()
print("ok")`
		for _, uri := range []string{f.unixURI("secret", "alice"), f.tcpURI("secret", "alice")} {
			out, err := nbdtest.Nbdsh(t, "-c", "uri = "+strconv.Quote(uri), "-c", script).CombinedOutput()
			if err != nil || strings.TrimSpace(string(out)) != "ok" {
				t.Fatalf("nbdsh %s: %v\n%s", uri, err, out)
			}
		}
	})
	t.Run("qemu-img and qemu-io with tls-creds-x509", func(t *testing.T) {
		qemuImg := nbdtest.Tool(t, "qemu-img")
		qemuIO := nbdtest.Tool(t, "qemu-io")
		obj := "tls-creds-x509,id=tls0,endpoint=client,dir=" + f.dirs["alice"]
		img := "driver=nbd,host=127.0.0.1,port=" + strings.Split(f.addr, ":")[1] + ",export=secret,tls-creds=tls0"
		out, err := exec.Command(qemuImg, "info", "--object", obj, "--image-opts", img).CombinedOutput()
		if err != nil || !strings.Contains(string(out), "virtual size: 512 KiB") {
			t.Fatalf("qemu-img info: %v\n%s", err, out)
		}
		out, err = exec.Command(qemuIO, "--object", obj, "--image-opts", img,
			"-c", "write -P 0x5a 64k 64k", "-c", "read -P 0x5a 64k 64k").CombinedOutput()
		if err != nil || strings.Contains(string(out), "ailed") || strings.Count(string(out), "65536/65536") != 2 {
			t.Fatalf("qemu-io: %v\n%s", err, out)
		}
		// The same over the unix socket.
		unixImg := "driver=nbd,server.type=unix,server.path=" + f.sock + ",export=secret,tls-creds=tls0,tls-hostname=localhost"
		out, err = exec.Command(qemuIO, "--object", obj, "--image-opts", unixImg, "-r", "-c", "read -P 0x5a 64k 64k").CombinedOutput()
		if err != nil || strings.Contains(string(out), "ailed") {
			t.Fatalf("qemu-io over unix: %v\n%s", err, out)
		}
		// qemu as mallory is refused, and the server goes on.
		objM := "tls-creds-x509,id=tls0,endpoint=client,dir=" + f.dirs["mallory"]
		out, err = exec.Command(qemuImg, "info", "--object", objM, "--image-opts", img).CombinedOutput()
		if err == nil {
			t.Fatalf("qemu-img info as mallory got in:\n%s", out)
		}
		good(t)
	})
	t.Run("fio's nbd engine", func(t *testing.T) {
		uri := "nbds://" + f.addr + "/secret"
		out, err := fioTLS(t, f.dirs["alice"], "--name=tls", "--ioengine=nbd", "--uri="+uri,
			"--rw=randrw", "--bs=4k", "--size=512k", "--io_size=2m", "--iodepth=8", "--verify=crc32c",
			"--output-format=terse").CombinedOutput()
		if err != nil {
			t.Fatalf("fio: %v\n%s", err, out)
		}
		if st := f.srv.Stats().Exports[1].Ops["write"]; st.Requests == 0 {
			t.Fatalf("fio wrote nothing to secret: %+v\n%s", st, out)
		}
		// fio as the read-only client fails its writes.
		out, err = fioTLS(t, f.dirs["reader"], "--name=ro", "--ioengine=nbd", "--uri="+uri,
			"--rw=write", "--bs=4k", "--size=64k").CombinedOutput()
		if err == nil || !strings.Contains(string(out), "Operation not permitted") {
			t.Fatalf("fio as the read-only client: %v\n%s", err, out)
		}
		good(t)
	})
}

// TestCertsReload: after the files change, Reload makes new handshakes
// use the new certificate while a connection opened before keeps working.
func TestCertsReload(t *testing.T) {
	f := newTLSFix(t, TLSRequire)
	old := dialRaw(t, f.sock)
	old.greet(3)
	before := old.startTLS(f.goClient(t, "alice")).ConnectionState().PeerCertificates[0].SerialNumber

	leaf := f.ca.Server(t)
	nbdtest.CertDir(t, f.dir, f.ca, &leaf, nil)
	bad := filepath.Join(t.TempDir(), "garbage.pem")
	if err := os.WriteFile(bad, []byte("not PEM"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := LoadCerts(bad, bad, ""); err == nil {
		t.Fatal("LoadCerts took garbage")
	}
	if err := f.certs.Reload(); err != nil {
		t.Fatal(err)
	}
	c := dialRaw(t, f.sock)
	c.greet(3)
	after := c.startTLS(f.goClient(t, "alice")).ConnectionState().PeerCertificates[0].SerialNumber
	if after.Cmp(leaf.Serial) != 0 || after.Cmp(before) == 0 {
		t.Fatalf("after Reload the server presents serial %v; before %v, new %v", after, before, leaf.Serial)
	}
	if got := old.listNames(); len(got) != 2 {
		t.Fatalf("connection from before the reload: LIST %v", got)
	}
	old.connect2("secret")
}

func TestParseIdentity(t *testing.T) {
	for _, tc := range []struct{ in, want, err string }{
		{in: "alice", want: "CN=alice"},
		{in: "CN=alice", want: "CN=alice"},
		{in: "CN=web server", want: "CN=web server"},
		{in: "DNS:reader.example", want: "DNS:reader.example"},
		{in: "email:ops@example.com", want: "email:ops@example.com"},
		{in: "URI:spiffe://example/backup", want: "URI:spiffe://example/backup"},
		{in: "IP:::ffff:10.0.0.1", want: "IP:10.0.0.1"},
		{in: "", err: "empty"},
		{in: "CN=", err: "empty"},
		{in: "IP:nope", err: "bad IP"},
		{in: "DNS:", err: "empty DNS"},
		{in: "SSH:key", err: "want NAME"},
	} {
		got, err := ParseIdentity(tc.in)
		if tc.err != "" {
			if err == nil || !strings.Contains(err.Error(), tc.err) {
				t.Errorf("ParseIdentity(%q) = %q, %v; want error %q", tc.in, got, err, tc.err)
			}
			continue
		}
		if err != nil || got != tc.want {
			t.Errorf("ParseIdentity(%q) = %q, %v; want %q", tc.in, got, err, tc.want)
		}
	}
}

func TestParseTLSMode(t *testing.T) {
	for _, m := range []TLSMode{TLSOff, TLSOn, TLSRequire} {
		if got, err := ParseTLSMode(m.String()); err != nil || got != m {
			t.Errorf("ParseTLSMode(%q) = %v, %v", m, got, err)
		}
	}
	if _, err := ParseTLSMode("yes"); err == nil {
		t.Error("ParseTLSMode(yes) succeeded")
	}
}

// fioTLS runs fio with libnbd finding the client certificates in dir.
// fio 3.33's nbd engine passes its --uri to nbd_connect_uri without
// allowing local file access, so a tls-certificates parameter is refused;
// libnbd then reads its default directory, $HOME/.pki/libnbd, or
// /etc/pki/libnbd for root. As root, fio runs as nobody with a private
// HOME, so that the machine's /etc is left alone.
func fioTLS(t *testing.T, dir string, args ...string) *exec.Cmd {
	t.Helper()
	fio := nbdtest.Tool(t, "fio")
	home, err := os.MkdirTemp("", "fio-home")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(home) })
	pki := filepath.Join(home, ".pki", "libnbd")
	if err := os.MkdirAll(pki, 0o700); err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"ca-cert.pem", "client-cert.pem", "client-key.pem"} {
		b, err := os.ReadFile(filepath.Join(dir, name))
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(pki, name), b, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	cmd := exec.Command(fio, args...)
	cmd.Env = append(os.Environ(), "HOME="+home)
	cmd.Dir = home
	if os.Geteuid() == 0 {
		const nobody = 65534
		err := filepath.WalkDir(home, func(p string, _ fs.DirEntry, err error) error {
			if err != nil {
				return err
			}
			return os.Lchown(p, nobody, nobody)
		})
		if err != nil {
			t.Fatal(err)
		}
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: nobody, Gid: nobody}}
	}
	return cmd
}

// TestShutdownTLS: Shutdown ends a TLS connection in transmission as it
// ends a plaintext one: the request already answered stays answered, the
// client sees the connection close, Shutdown returns nil.
func TestShutdownTLS(t *testing.T) {
	f := newTLSFix(t, TLSRequire)
	c := dialRaw(t, f.sock)
	c.greet(3)
	c.startTLS(f.goClient(t, "alice"))
	c.connect2("main")
	c.request(0, 0, 9, 0, 4096, nil)
	if h, e, d := c.simple(4096); h != 9 || e != 0 || len(d) != 4096 {
		t.Fatalf("read over TLS: handle %d errno %d", h, e)
	}
	if err := f.srv.Shutdown(context.Background()); err != nil {
		t.Fatalf("Shutdown: %v", err)
	}
	if !c.closed() {
		t.Fatal("connection still open after Shutdown")
	}
}

// FuzzHandshakeTLS runs FuzzHandshake's sessions against a server in each
// TLS mode, with a TLS-only export, so that the STARTTLS gate and the access
// checks see arbitrary option streams (a STARTTLS that gets its ACK then
// meets arbitrary bytes as a TLS handshake).
func FuzzHandshakeTLS(f *testing.F) {
	f.Add(byte(1), clientStream(false))
	f.Add(byte(2), clientStream(true, seedRequests...))
	starttls := binary.BigEndian.AppendUint32(nil, 3)
	starttls = binary.BigEndian.AppendUint64(starttls, wire.MagicOpt)
	starttls = binary.BigEndian.AppendUint32(starttls, wire.OptStartTLS)
	starttls = binary.BigEndian.AppendUint32(starttls, 0)
	f.Add(byte(2), starttls)
	f.Add(byte(1), append(starttls, 0x16, 3, 1, 0, 4))
	ca := nbdtest.NewCA(f, "fuzz CA")
	dir := f.TempDir()
	leaf := ca.Server(f)
	nbdtest.CertDir(f, dir, ca, &leaf, nil)
	certs, err := LoadCerts(filepath.Join(dir, "server-cert.pem"), filepath.Join(dir, "server-key.pem"), filepath.Join(dir, "ca-cert.pem"))
	if err != nil {
		f.Fatal(err)
	}
	var srvs [3]*Server
	for m := range srvs {
		srv := fuzzServer(f)
		srv.Exports[0].Access = &Access{ReadWrite: []string{"alice"}}
		srv.TLS, srv.TLSConfig = TLSMode(m), certs.Config()
		srvs[m] = srv
	}
	f.Fuzz(func(t *testing.T, mode byte, data []byte) {
		srv := srvs[int(mode)%len(srvs)]
		c := srv.newConn(&fakeConn{r: bytes.NewReader(data)})
		c.serve()
	})
}

// fuzzServer serves "x" (data, zero, error, failing and no-zeroing lines)
// and a small read-only "ro", for FuzzHandshakeTLS.
func fuzzServer(t testing.TB) *Server {
	x := newExport(t, "x",
		seg{len: 64 * kb, dev: backing.NewMem("a", 64*kb)},
		seg{len: 64 * kb, kind: table.KindZero},
		seg{len: 64 * kb, kind: table.KindError},
		seg{len: 64 * kb, dev: &failDev{Device: backing.NewMem("f", 64*kb), from: 0, to: 4 * kb}},
		seg{len: 64 * kb, dev: noZeroDev{backing.NewMem("z", 64*kb)}},
	)
	ro := newExport(t, "ro", seg{len: 4 * kb, dev: backing.NewMem("r", 4*kb)})
	ro.ReadOnly = true
	srv := &Server{Exports: []*Export{x, ro}}
	srv.init()
	return srv
}

// TestShutdownTLSHeldRecords: a Shutdown that lands while tlsRecords is
// taking the records crypto/tls already holds still stops the reader.
// tlsRecords reads those records under a read deadline in the past and then
// clears it; here Shutdown's own deadline (stopReading) is set just before
// that clearing, so the clearing removes it, and only tlsRecords' check of
// stopped afterwards keeps the reader from waiting for the client forever.
func TestShutdownTLSHeldRecords(t *testing.T) {
	f := newTLSFix(t, TLSRequire)
	conns := make(chan *shutdownWhileClearing, 1)
	srv := &wrappingServer{Server: f.srv, wrap: func(nc net.Conn) net.Conn {
		s := &shutdownWhileClearing{Conn: nc, srv: f.srv, shut: make(chan error, 1), stopSet: make(chan struct{})}
		conns <- s
		return s
	}}
	c := dialRaw(t, nbdtest.ServeUnix(t, srv, ErrServerClosed))
	c.greet(3)
	c.startTLS(f.goClient(t, "alice"))
	c.connect2("main")
	spy := <-conns
	spy.armed.Store(true)
	c.request(0, 0, 9, 0, 4096, nil)
	if h, e, d := c.simple(4096); h != 9 || e != 0 || len(d) != 4096 {
		t.Fatalf("read over TLS: handle %d errno %d", h, e)
	}
	if spy.armed.Load() {
		t.Fatal("tlsRecords never cleared a read deadline it had set in the past")
	}
	if !c.closed() {
		t.Fatal("connection still open after Shutdown")
	}
	if err := <-spy.shut; err != nil {
		t.Fatalf("Shutdown: %v", err)
	}
}

// wrappingServer is a Server whose accepted connections go through wrap.
type wrappingServer struct {
	*Server
	wrap func(net.Conn) net.Conn
}

func (s *wrappingServer) Serve(l net.Listener) error {
	return s.Server.Serve(&wrappingListener{l, s.wrap})
}

// shutdownWhileClearing is a connection that, once armed, starts Shutdown
// when the server clears a read deadline that was in the past (tlsRecords
// ending its take of held records), and lets the clearing through only
// after Shutdown has set its own read deadline.
type shutdownWhileClearing struct {
	net.Conn
	srv   *Server
	armed atomic.Bool
	shut  chan error // Shutdown's result

	mu       sync.Mutex
	last     time.Time // the read deadline set last
	stopping bool      // Shutdown has been started
	once     sync.Once
	stopSet  chan struct{} // closed once a deadline is set after Shutdown started
}

func (s *shutdownWhileClearing) SetReadDeadline(t time.Time) error {
	s.mu.Lock()
	switch {
	case s.stopping && !t.IsZero():
		s.once.Do(func() { close(s.stopSet) })
	case t.IsZero() && s.last.Equal(longAgo) && s.armed.CompareAndSwap(true, false):
		s.stopping = true
		s.mu.Unlock()
		go func() { s.shut <- s.srv.Shutdown(context.Background()) }()
		<-s.stopSet
		s.mu.Lock()
	}
	s.last = t
	s.mu.Unlock()
	return s.Conn.SetReadDeadline(t)
}

// A TLS client that writes and flushes one request at a time, alone on the
// server, is served out of the poller (conn.followPoller) as a plaintext
// one is: its data reads back, and Shutdown stops its reader there (a read
// deadline that wakes the read waiting in poll(2)) and ends it cleanly.
func TestTLSOutOfPoller(t *testing.T) {
	f := newTLSFix(t, TLSRequire)
	c := dialRaw(t, f.sock)
	c.greet(3)
	c.startTLS(f.goClient(t, "alice"))
	c.connect2("main")
	sock := onlySocket(t, f.srv)
	data := bytes.Repeat([]byte("tls!"), 1024)
	h := uint64(0)
	for !sock.outside() {
		if h > 1000 {
			t.Fatalf("not out of the poller after %d requests one at a time", h)
		}
		for _, typ := range []uint16{wire.CmdWrite, wire.CmdFlush} {
			h++
			var payload []byte
			n := uint32(0)
			if typ == wire.CmdWrite {
				payload, n = data, uint32(len(data))
			}
			c.request(typ, 0, h, 0, n, payload)
			if got, e, _ := c.simple(0); got != h || e != 0 {
				t.Fatalf("request %d: reply %d, errno %d", h, got, e)
			}
		}
	}
	h++
	c.request(wire.CmdRead, 0, h, 0, uint32(len(data)), nil)
	if got, e, d := c.simple(len(data)); got != h || e != 0 || !bytes.Equal(d, data) {
		t.Fatalf("read out of the poller: handle %d errno %d, data as written %v", got, e, bytes.Equal(d, data))
	}
	if err := f.srv.Shutdown(context.Background()); err != nil {
		t.Fatalf("Shutdown: %v", err)
	}
	if !c.closed() {
		t.Fatal("connection still open after Shutdown")
	}
}
