package main

import (
	"bufio"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/crypto/bcrypt"

	"github.com/nbdmapper/nbdmapper/internal/testing/nbdtest"
	"github.com/nbdmapper/nbdmapper/internal/testing/sparse"
)

// pki is a test CA with a server certificate in dir/server and client
// certificate directories (libnbd layout) per client name.
type pki struct {
	ca      *nbdtest.CA
	server  string // dir with ca-cert.pem, server-cert.pem, server-key.pem
	clients map[string]string
}

func newPKI(t *testing.T, clients ...string) *pki {
	t.Helper()
	base := t.TempDir()
	p := &pki{ca: nbdtest.NewCA(t, "test CA"), clients: map[string]string{}}
	leaf := p.ca.Server(t)
	p.server = nbdtest.CertDir(t, filepath.Join(base, "server"), p.ca, &leaf, nil)
	for _, c := range clients {
		leaf := p.ca.Client(t, c, c+".example")
		p.clients[c] = nbdtest.CertDir(t, filepath.Join(base, c), p.ca, nil, &leaf)
	}
	return p
}

func (p *pki) file(name string) string { return filepath.Join(p.server, name) }

func (p *pki) tlsArgs() []string {
	return []string{"--tls-cert", p.file("server-cert.pem"), "--tls-key", p.file("server-key.pem"), "--tls-ca", p.file("ca-cert.pem")}
}

// waitLog waits until the server has logged want, failing the test if it
// exits first or has not after 10000 polls (at least 100 s).
func waitLog(t *testing.T, s *nbdtest.Server, want string) {
	t.Helper()
	exited := make(chan struct{})
	go func() { s.Wait(); close(exited) }()
	for range 10000 {
		if strings.Contains(s.Stderr(), want) {
			return
		}
		select {
		case <-exited:
			t.Fatalf("server exited before logging %q:\n%s", want, s.Stderr())
		case <-time.After(10 * time.Millisecond):
		}
	}
	t.Fatalf("server did not log %q:\n%s", want, s.Stderr())
}

// TestServeTLS runs `serve --tls require` with client certificates and
// --allow/--allow-ro, drives it with nbdinfo and nbdsh, and reloads the
// certificates with SIGHUP under a connected client.
func TestServeTLS(t *testing.T) {
	nbdtest.Tool(t, "nbdinfo")
	dir := t.TempDir()
	sparse.Create(t, filepath.Join(dir, "d.img"), 1<<20)
	os.WriteFile(filepath.Join(dir, "d.table"), []byte("0 2048 linear d.img 0\n"), 0o644)
	p := newPKI(t, "alice", "reader", "mallory")
	args := append(append([]string{"--metrics", "off", "--tls", "require", "--socket-mode", "0600",
		"--allow", "d=alice", "--allow-ro", "d=DNS:reader.example"}, p.tlsArgs()...), "open=d.table", "d=d.table")
	s := nbdtest.Start(t, bin, dir, args...)

	st, err := os.Stat(s.Socket)
	if err != nil || st.Mode()&os.ModeSocket == 0 || st.Mode().Perm() != 0o600 {
		t.Fatalf("socket %s: %v %v, want a socket with mode 0600", s.Socket, st.Mode(), err)
	}
	uri := func(export, who string) string {
		return "nbds+unix:///" + export + "?socket=" + s.Socket + "&tls-certificates=" + p.clients[who]
	}
	nbdinfo := func(args ...string) (string, error) {
		out, err := exec.Command("nbdinfo", args...).CombinedOutput()
		return string(out), err
	}
	for _, tc := range []struct {
		name, uri, want string
		ok              bool
	}{
		{"alice reads d", uri("d", "alice"), "1048576", true},
		{"reader is read-only on d", uri("d", "reader"), "", true},
		{"mallory may use open", uri("open", "mallory"), "1048576", true},
		{"mallory may not use d", uri("d", "mallory"), "policy", false},
		{"plaintext is refused", s.URI("open"), "TLS", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a := []string{"--size", tc.uri}
			if tc.name == "reader is read-only on d" {
				a = []string{"--is", "readonly", tc.uri}
			}
			out, err := nbdinfo(a...)
			if (err == nil) != tc.ok || !strings.Contains(out, tc.want) {
				t.Fatalf("nbdinfo %v: %v\n%s", a, err, out)
			}
		})
	}

	// A client connected before a SIGHUP keeps its session; a client
	// after it sees the new certificate from a new CA.
	script := `
h.set_uri_allow_local_file(True)
h.connect_uri(uri)
h.pwrite(b"before" * 512, 0)
print("connected", flush=True)
sys.stdin.readline()
assert h.pread(3072, 0) == b"before" * 512
print("still connected", flush=True)`
	sh := nbdtest.Nbdsh(t, "-c", "import sys; uri = "+fmt.Sprintf("%q", uri("d", "alice")), "-c", script)
	stdin, err := sh.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := sh.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	var stderr strings.Builder
	sh.Stderr = &stderr
	if err := sh.Start(); err != nil {
		t.Fatal(err)
	}
	lines := bufio.NewScanner(stdout)
	if !lines.Scan() || lines.Text() != "connected" {
		sh.Wait()
		t.Fatalf("nbdsh: %q\n%s", lines.Text(), stderr.String())
	}

	q := newPKI(t, "alice")
	for _, f := range []string{"ca-cert.pem", "server-cert.pem", "server-key.pem"} {
		b, err := os.ReadFile(q.file(f))
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p.file(f), b, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	s.Signal(syscall.SIGHUP)
	waitLog(t, s, "certificates reloaded")

	io.WriteString(stdin, "\n")
	if !lines.Scan() || lines.Text() != "still connected" {
		sh.Wait()
		t.Fatalf("nbdsh after SIGHUP: %q\n%s", lines.Text(), stderr.String())
	}
	if err := sh.Wait(); err != nil {
		t.Fatalf("nbdsh: %v\n%s", err, stderr.String())
	}
	if out, err := nbdinfo("--size", uri("d", "alice")); err == nil {
		t.Fatalf("a client of the old CA got in after the reload:\n%s", out)
	}
	newURI := "nbds+unix:///d?socket=" + s.Socket + "&tls-certificates=" + q.clients["alice"]
	if out, err := nbdinfo("--size", newURI); err != nil {
		t.Fatalf("a client of the new CA after the reload: %v\n%s", err, out)
	}
	s.Stop(t)
}

func TestServeFlagErrors(t *testing.T) {
	dir := t.TempDir()
	sparse.Create(t, filepath.Join(dir, "d.img"), 1<<20)
	os.WriteFile(filepath.Join(dir, "d.table"), []byte("0 2048 linear d.img 0\n"), 0o644)
	p := newPKI(t)
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--tls", "maybe"}, "want off, on or require"},
		{[]string{"--tls", "on"}, "needs --tls-cert and --tls-key"},
		{[]string{"--tls-cert", p.file("server-cert.pem")}, "need --tls on"},
		{append([]string{"--tls", "on", "--allow", "d=alice"}, p.tlsArgs()[:4]...), "need --tls-ca"},
		{append([]string{"--tls", "on", "--allow", "nope=alice"}, p.tlsArgs()...), "no export named nope"},
		{[]string{"--allow", "d=SSH:x"}, "want NAME"},
		{[]string{"--socket-mode", "999"}, "octal"},
		{append([]string{"--tls", "on", "--tls-key", p.file("ca-cert.pem")}, p.tlsArgs()[:2]...), "TLS certificate"},
	} {
		cmd := exec.Command(bin, append(append([]string{"serve", "--socket", filepath.Join(dir, "s"), "--metrics", "off"}, tc.args...), "d=d.table")...)
		cmd.Dir = dir
		out, err := cmd.CombinedOutput()
		if err == nil || !strings.Contains(string(out), tc.want) {
			t.Errorf("serve %v: %v, want an error with %q\n%s", tc.args, err, tc.want, out)
		}
	}
}

func TestServeSocketModeDefault(t *testing.T) {
	s := nbdtest.Start(t, bin, t.TempDir(), "--metrics", "off")
	st, err := os.Stat(s.Socket)
	if err != nil || st.Mode().Perm() != 0o660 {
		t.Fatalf("socket mode %v, %v; want 0660", st.Mode(), err)
	}
	s.Stop(t)
}

// TestMetricsWebConfig protects the metrics listener with a web config
// file (TLS with required client certificates, and basic auth) and checks
// each missing credential is refused, the next good client is served, and
// `nbdmapper status` gets through with the flags.
func TestMetricsWebConfig(t *testing.T) {
	dir := t.TempDir()
	sparse.Create(t, filepath.Join(dir, "d.img"), 1<<20)
	os.WriteFile(filepath.Join(dir, "d.table"), []byte("0 2048 linear d.img 0\n"), 0o644)
	p := newPKI(t, "prometheus")
	hash, err := bcrypt.GenerateFromPassword([]byte("s3cret"), bcrypt.MinCost)
	if err != nil {
		t.Fatal(err)
	}
	web := filepath.Join(dir, "web.yml")
	os.WriteFile(web, fmt.Appendf(nil, `tls_server_config:
  cert_file: %s
  key_file: %s
  client_auth_type: RequireAndVerifyClientCert
  client_ca_file: %s
basic_auth_users:
  prom: %s
`, p.file("server-cert.pem"), p.file("server-key.pem"), p.file("ca-cert.pem"), hash), 0o600)
	pw := filepath.Join(dir, "pw")
	os.WriteFile(pw, []byte("s3cret\n"), 0o600)
	bad := filepath.Join(dir, "bad")
	os.WriteFile(bad, []byte("wrong\n"), 0o600)

	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	s := nbdtest.Start(t, bin, dir, "--metrics", addr, "--metrics-web-config", web, "d=d.table")
	s.WaitListening(t, "tcp", addr)

	pool := x509.NewCertPool()
	pool.AddCert(p.ca.Cert)
	cert, err := tls.LoadX509KeyPair(filepath.Join(p.clients["prometheus"], "client-cert.pem"), filepath.Join(p.clients["prometheus"], "client-key.pem"))
	if err != nil {
		t.Fatal(err)
	}
	get := func(scheme string, certs []tls.Certificate, user, pass string) (int, error) {
		c := &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool, Certificates: certs}}}
		defer c.CloseIdleConnections()
		req, _ := http.NewRequest("GET", scheme+"://"+addr+"/metrics", nil)
		if user != "" {
			req.SetBasicAuth(user, pass)
		}
		resp, err := c.Do(req)
		if err != nil {
			return 0, err
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		return resp.StatusCode, nil
	}
	good := func() {
		t.Helper()
		if code, err := get("https", []tls.Certificate{cert}, "prom", "s3cret"); err != nil || code != 200 {
			t.Fatalf("good scrape: %d %v", code, err)
		}
	}
	good()
	for _, tc := range []struct {
		name, scheme string
		certs        []tls.Certificate
		user, pass   string
		code         int // 0: the request fails
	}{
		{"plain http", "http", nil, "prom", "s3cret", 400},
		{"no client certificate", "https", nil, "prom", "s3cret", 0},
		{"no credentials", "https", []tls.Certificate{cert}, "", "", 401},
		{"wrong password", "https", []tls.Certificate{cert}, "prom", "wrong", 401},
	} {
		code, err := get(tc.scheme, tc.certs, tc.user, tc.pass)
		if code != tc.code || (tc.code == 0) != (err != nil) {
			t.Errorf("%s: status %d, err %v; want status %d", tc.name, code, err, tc.code)
		}
		good()
	}

	clientArgs := []string{"--metrics", addr, "--tls-ca", p.file("ca-cert.pem"),
		"--tls-cert", filepath.Join(p.clients["prometheus"], "client-cert.pem"),
		"--tls-key", filepath.Join(p.clients["prometheus"], "client-key.pem")}
	out, err := cmd2(dir, append(append([]string{"status", "--table"}, clientArgs...), "--user", "prom", "--password-file", pw)...)
	if err != nil || out != "d: 0 2048 linear d.img 0\n" {
		t.Fatalf("status --table over TLS with auth: %v\n%q", err, out)
	}
	cmd := exec.Command(bin, append(append([]string{"status"}, clientArgs...), "--user", "prom", "--password-file", bad)...)
	if out, err := cmd.CombinedOutput(); err == nil || !strings.Contains(string(out), "401") {
		t.Fatalf("status with a wrong password: %v\n%s", err, out)
	}
	s.Stop(t)
}

// TestAccessOutlivesRecreate removes an export restricted by --allow and
// creates it again through the control socket: the new device is the same
// export name, and --allow applies to it as it did at start-up, both to
// plaintext clients (--tls on) and to other certificates of the CA.
func TestAccessOutlivesRecreate(t *testing.T) {
	nbdtest.Tool(t, "nbdinfo")
	dir := t.TempDir()
	sparse.Create(t, filepath.Join(dir, "d.img"), 1<<20)
	table := filepath.Join(dir, "d.table")
	os.WriteFile(table, []byte("0 2048 linear d.img 0\n"), 0o644)
	p := newPKI(t, "alice", "mallory")
	ctl := filepath.Join(dir, "control")
	args := append(append([]string{"--metrics", "off", "--control", ctl, "--tls", "on", "--allow", "d=alice"}, p.tlsArgs()...), "d=d.table")
	s := nbdtest.Start(t, bin, dir, args...)
	uri := func(who string) string {
		return "nbds+unix:///d?socket=" + s.Socket + "&tls-certificates=" + p.clients[who]
	}
	check := func(when string) {
		t.Helper()
		for _, tc := range []struct {
			who, uri string
			ok       bool
		}{
			{"alice", uri("alice"), true},
			{"mallory", uri("mallory"), false},
			{"a plaintext client", s.URI("d"), false},
		} {
			out, err := exec.Command("nbdinfo", "--size", tc.uri).CombinedOutput()
			if (err == nil) != tc.ok {
				t.Errorf("%s: %s may use d: %v, want %v\n%s", when, tc.who, err == nil, tc.ok, out)
			}
		}
	}
	check("at start-up")
	lifecycle(t, ctl, "remove", "d")
	lifecycle(t, ctl, "create", "d", table)
	check("created again")
	s.Stop(t)
}
