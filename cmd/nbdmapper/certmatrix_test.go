package main

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/nbdmapper/nbdmapper/internal/testing/nbdtest"
	"github.com/nbdmapper/nbdmapper/internal/testing/sparse"
)

// The certificate matrix: certificates as users make them, with openssl
// and with GnuTLS's certtool, of every key type TLS clients use, under
// TLS 1.2 and 1.3, between nbdmapper and the GnuTLS clients (nbdinfo,
// qemu-img), and between nbdmapper's remote client and GnuTLS servers
// (nbdkit, qemu-nbd). Each pair works, or is refused with a log line that
// says why (docs/security.md).

// keyKind is a key type, as each tool is asked for it.
type keyKind struct {
	name     string
	openssl  []string // openssl req's -newkey and -pkeyopt
	certtool []string // certtool --generate-privkey's options
}

var (
	rsa2048 = keyKind{"rsa2048", []string{"-newkey", "rsa:2048"}, []string{"--key-type", "rsa", "--bits", "2048"}}
	rsa4096 = keyKind{"rsa4096", []string{"-newkey", "rsa:4096"}, []string{"--key-type", "rsa", "--bits", "4096"}}
	p256    = keyKind{"p256", []string{"-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256"}, []string{"--key-type", "ecdsa", "--curve", "secp256r1"}}
	p384    = keyKind{"p384", []string{"-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-384"}, []string{"--key-type", "ecdsa", "--curve", "secp384r1"}}
	ed25519 = keyKind{"ed25519", []string{"-newkey", "ed25519"}, []string{"--key-type", "ed25519"}}
	rsaPSS  = keyKind{"rsa-pss", []string{"-newkey", "rsa-pss", "-pkeyopt", "rsa_keygen_bits:2048"}, []string{"--key-type", "rsa-pss", "--bits", "2048"}}
)

// certSet is a CA, a server certificate (CN and DNS name localhost) and a
// client certificate (CN alice) in the directory layouts libnbd, qemu and
// nbdkit read: server (ca-cert.pem, server-cert.pem, server-key.pem) and
// client (ca-cert.pem, client-cert.pem, client-key.pem).
type certSet struct {
	server, client string
}

// issuer makes keys and certificates with one tool.
type issuer interface {
	ca(t *testing.T, dir string, k keyKind)
	leaf(t *testing.T, dir, name string, k keyKind, server bool)
}

func run(t *testing.T, dir, name string, args ...string) {
	t.Helper()
	cmd := exec.Command(name, args...)
	cmd.Dir = dir
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("%s %s: %v\n%s", name, strings.Join(args, " "), err, out)
	}
}

// openssl makes certificates as `openssl req` and `openssl x509 -req`
// recipes do; a client certificate gets no extensions at all (an X.509
// v1 certificate), as the shortest recipe makes it.
type openssl struct{}

func (openssl) ca(t *testing.T, dir string, k keyKind) {
	run(t, dir, "openssl", append(append([]string{"req", "-x509", "-nodes"}, k.openssl...),
		"-keyout", "ca-key.pem", "-out", "ca-cert.pem", "-days", "30", "-subj", "/CN=matrix CA")...)
}

func (openssl) leaf(t *testing.T, dir, name string, k keyKind, server bool) {
	cn := "alice"
	if server {
		cn = "localhost"
	}
	run(t, dir, "openssl", append(append([]string{"req", "-nodes"}, k.openssl...),
		"-keyout", name+"-key.pem", "-out", name+".csr", "-subj", "/CN="+cn)...)
	args := []string{"x509", "-req", "-in", name + ".csr", "-CA", "ca-cert.pem", "-CAkey", "ca-key.pem",
		"-set_serial", fmt.Sprint(len(name)), "-days", "30", "-out", name + "-cert.pem"}
	if server {
		os.WriteFile(filepath.Join(dir, "server.ext"), []byte("subjectAltName=DNS:localhost\n"), 0o600)
		args = append(args, "-extfile", "server.ext")
	}
	run(t, dir, "openssl", args...)
}

// certtool makes certificates with the templates the nbdkit, qemu and
// libnbd docs show.
type certtool struct{}

func (certtool) ca(t *testing.T, dir string, k keyKind) {
	os.WriteFile(filepath.Join(dir, "ca.info"), []byte("cn = matrix CA\nca\ncert_signing_key\nexpiration_days = 30\n"), 0o600)
	run(t, dir, "certtool", append([]string{"--generate-privkey", "--outfile", "ca-key.pem"}, k.certtool...)...)
	run(t, dir, "certtool", "--generate-self-signed", "--load-privkey", "ca-key.pem", "--template", "ca.info", "--outfile", "ca-cert.pem")
}

func (certtool) leaf(t *testing.T, dir, name string, k keyKind, server bool) {
	tmpl := "cn = alice\ntls_www_client\n"
	if server {
		tmpl = "cn = localhost\ndns_name = localhost\ntls_www_server\n"
	}
	os.WriteFile(filepath.Join(dir, name+".info"), []byte(tmpl+"signing_key\nencryption_key\nexpiration_days = 30\n"), 0o600)
	run(t, dir, "certtool", append([]string{"--generate-privkey", "--outfile", name + "-key.pem"}, k.certtool...)...)
	run(t, dir, "certtool", "--generate-certificate", "--load-privkey", name+"-key.pem", "--load-ca-certificate", "ca-cert.pem",
		"--load-ca-privkey", "ca-key.pem", "--template", name+".info", "--outfile", name+"-cert.pem")
}

// makeCerts makes a certSet in dir: the CA's key of kind ca, the server's
// of kind server, the client's of kind client.
func makeCerts(t *testing.T, dir string, iss issuer, ca, server, client keyKind) certSet {
	t.Helper()
	if err := os.MkdirAll(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	iss.ca(t, dir, ca)
	iss.leaf(t, dir, "server", server, true)
	iss.leaf(t, dir, "client", client, false)
	set := certSet{server: filepath.Join(dir, "s"), client: filepath.Join(dir, "c")}
	for d, files := range map[string][]string{set.server: {"ca-cert.pem", "server-cert.pem", "server-key.pem"}, set.client: {"ca-cert.pem", "client-cert.pem", "client-key.pem"}} {
		os.Mkdir(d, 0o700)
		for _, f := range files {
			if err := os.Link(filepath.Join(dir, f), filepath.Join(d, f)); err != nil {
				t.Fatal(err)
			}
		}
	}
	return set
}

// gnutlsVersions sets the TLS versions of a GnuTLS program through its
// system priority file (GNUTLS_SYSTEM_PRIORITY_FILE): the environment
// variable to add for each version. TLS 1.2 is had by disabling 1.3;
// TLS 1.3 by an empty file, as a GnuTLS client and crypto/tls choose it
// when both have it (GnuTLS 3.7 cannot be limited to 1.3 alone: disabling
// 1.2 takes 1.3 too).
func gnutlsVersions(t *testing.T, dir string) map[string]string {
	t.Helper()
	env := map[string]string{}
	for name, config := range map[string]string{"TLS1.2": "[overrides]\ndisabled-version = tls1.3\n", "TLS1.3": ""} {
		f := filepath.Join(dir, "gnutls-"+name)
		if err := os.WriteFile(f, []byte(config), 0o600); err != nil {
			t.Fatal(err)
		}
		env[name] = "GNUTLS_SYSTEM_PRIORITY_FILE=" + f
	}
	return env
}

// matrixRow is one certSet: made by iss with these key kinds, and
// whether every connection with it works, or else what the log says.
type matrixRow struct {
	iss                issuer
	ca, server, client keyKind
	refused            string // "" if it works; else the server log's reason
}

func (r matrixRow) name() string {
	return fmt.Sprintf("%T/ca=%s,server=%s,client=%s", r.iss, r.ca.name, r.server.name, r.client.name)
}

var matrixRows = func() []matrixRow {
	var rows []matrixRow
	for _, iss := range []issuer{openssl{}, certtool{}} {
		for _, k := range []keyKind{rsa2048, rsa4096, p256, p384, ed25519} {
			rows = append(rows, matrixRow{iss: iss, ca: k, server: k, client: k})
		}
	}
	return append(rows,
		matrixRow{iss: openssl{}, ca: rsa2048, server: rsa2048, client: p256},
		matrixRow{iss: openssl{}, ca: p256, server: p256, client: rsa2048},
		matrixRow{iss: certtool{}, ca: ed25519, server: p384, client: rsa4096},
		// Go's crypto/tls has no RSA-PSS keys (id-RSASSA-PSS), and offers
		// only rsa_pss_rsae_* schemes, so a GnuTLS client with such a
		// key sends no certificate.
		matrixRow{iss: openssl{}, ca: rsa2048, server: rsa2048, client: rsaPSS, refused: errNoClientCertText},
	)
}()

// errNoClientCertText is how the server's log begins its reason when a
// client sends no certificate (nbdtarget's errNoClientCert).
const errNoClientCertText = "client sent no certificate"

// TestCertificateMatrixServer serves an export under --tls require with
// --allow, and connects nbdinfo and qemu-img with each row's client
// certificate under TLS 1.2 and TLS 1.3.
func TestCertificateMatrixServer(t *testing.T) {
	for _, tool := range []string{"openssl", "certtool", "nbdinfo", "qemu-img"} {
		nbdtest.Tool(t, tool)
	}
	dir := t.TempDir()
	sparse.Create(t, filepath.Join(dir, "d.img"), 1<<20)
	os.WriteFile(filepath.Join(dir, "d.table"), []byte("0 2048 linear d.img 0\n"), 0o644)
	versions := gnutlsVersions(t, dir)
	for i, row := range matrixRows {
		t.Run(row.name(), func(t *testing.T) {
			set := makeCerts(t, filepath.Join(dir, fmt.Sprint(i)), row.iss, row.ca, row.server, row.client)
			s := nbdtest.Start(t, bin, dir, "--metrics", "off", "--tls", "require", "--allow", "d=alice",
				"--tls-cert", filepath.Join(set.server, "server-cert.pem"), "--tls-key", filepath.Join(set.server, "server-key.pem"),
				"--tls-ca", filepath.Join(set.server, "ca-cert.pem"), "d=d.table")
			clients := map[string][]string{
				"nbdinfo": {"nbdinfo", "--size", "nbds+unix:///d?socket=" + s.Socket + "&tls-certificates=" + set.client},
				"qemu-img": {"qemu-img", "info", "--output=json", "--object", "tls-creds-x509,id=tls0,endpoint=client,dir=" + set.client,
					"--image-opts", "driver=nbd,server.type=unix,server.path=" + s.Socket + ",export=d,tls-creds=tls0,tls-hostname=localhost"},
			}
			for version, env := range versions {
				for name, argv := range clients {
					cmd := exec.Command(argv[0], argv[1:]...)
					cmd.Env = append(os.Environ(), env)
					out, err := cmd.CombinedOutput()
					switch {
					case row.refused == "" && err != nil:
						t.Errorf("%s over %s: %v\n%s\nserver log:\n%s", name, version, err, out, s.Stderr())
					case row.refused == "" && !strings.Contains(string(out), "1048576"):
						t.Errorf("%s over %s: no size 1048576 in its output:\n%s", name, version, out)
					case row.refused != "" && err == nil:
						t.Errorf("%s over %s connected, want it refused (%s)", name, version, row.refused)
					}
				}
			}
			if row.refused != "" {
				waitLog(t, s, row.refused)
			}
		})
	}
}

// TestCertificateMatrixRemote reads, through nbdmapper's remote client,
// exports that nbdkit and qemu-nbd serve with TLS and verify the client
// (--tls-verify-peer, verify-peer=on), with each row's certificates,
// under TLS 1.2 and TLS 1.3.
func TestCertificateMatrixRemote(t *testing.T) {
	for _, tool := range []string{"openssl", "certtool", "nbdkit", "qemu-nbd"} {
		nbdtest.Tool(t, tool)
	}
	dir := nbdtest.ShortDir(t)
	img := filepath.Join(dir, "d.img")
	sparse.Create(t, img, 1<<20)
	versions := gnutlsVersions(t, dir)
	for i, row := range matrixRows {
		if row.refused != "" {
			continue // the Go client sends any key it can parse
		}
		t.Run(row.name(), func(t *testing.T) {
			sub := filepath.Join(dir, fmt.Sprint(i))
			set := makeCerts(t, sub, row.iss, row.ca, row.server, row.client)
			for version, env := range versions {
				peers := map[string]*nbdtest.Peer{
					"nbdkit": nbdtest.StartNbdkit(t, sub, "kit"+version[3:], nbdtest.PeerOptions{Env: []string{env}},
						"--tls=require", "--tls-certificates="+set.server, "--tls-verify-peer", "memory", "1M"),
					"qemu-nbd": nbdtest.StartQemuNbd(t, sub, "qemu"+version[3:], img, nbdtest.PeerOptions{Env: []string{env}, Args: []string{
						"--object", "tls-creds-x509,id=tls0,endpoint=server,verify-peer=on,dir=" + set.server, "--tls-creds", "tls0"}}),
				}
				for name, p := range peers {
					export := ""
					if name == "qemu-nbd" {
						export = "e"
					}
					table := filepath.Join(sub, name+version+".table")
					line := fmt.Sprintf("0 2048 linear nbds+unix:///%s?socket=%s&tls-certificates=%s 0\n", export, p.Sock, set.client)
					if err := os.WriteFile(table, []byte(line), 0o644); err != nil {
						t.Fatal(err)
					}
					if out, err := cmd2(sub, "check", "--connect", table); err != nil {
						t.Errorf("%s over %s: check --connect: %v\n%s", name, version, err, out)
					}
				}
			}
		})
	}
}
