package remote

import (
	"context"
	"errors"
	"net"
	"path/filepath"
	"strings"
	"testing"

	"github.com/nbdmapper/nbdmapper/backing"
	"github.com/nbdmapper/nbdmapper/discard"
	"github.com/nbdmapper/nbdmapper/flush"
	"github.com/nbdmapper/nbdmapper/internal/testing/nbdtest"
	"github.com/nbdmapper/nbdmapper/mapped"
	"github.com/nbdmapper/nbdmapper/nbdtarget"
	"github.com/nbdmapper/nbdmapper/table"
)

// TestTLS connects over nbds+unix:// and nbds:// to nbdmapper's own server
// with --tls require, a CA and an allow list: the client's certificate
// directory (libnbd's tls-certificates=DIR layout) is what gets it in.
func TestTLS(t *testing.T) {
	ca := nbdtest.NewCA(t, "test CA")
	srvLeaf, alice, mallory := ca.Server(t), ca.Client(t, "alice"), ca.Client(t, "mallory")
	base := t.TempDir()
	srvDir := nbdtest.CertDir(t, filepath.Join(base, "server"), ca, &srvLeaf, nil)
	aliceDir := nbdtest.CertDir(t, filepath.Join(base, "alice"), ca, nil, &alice)
	malloryDir := nbdtest.CertDir(t, filepath.Join(base, "mallory"), ca, nil, &mallory)
	other := nbdtest.NewCA(t, "other CA")
	otherDir := nbdtest.CertDir(t, filepath.Join(base, "other"), other, nil, &alice)
	certs, err := nbdtarget.LoadCerts(filepath.Join(srvDir, "server-cert.pem"), filepath.Join(srvDir, "server-key.pem"), filepath.Join(srvDir, "ca-cert.pem"))
	if err != nil {
		t.Fatal(err)
	}
	f := flush.New()
	pool := &backing.Pool{Wrap: f.Track}
	defer pool.Close()
	pool.Add("m", backing.NewMem("m", 4*mib))
	tb, err := table.Parse("e.table", strings.NewReader("0 8192 linear m 0\n"), pool)
	if err != nil {
		t.Fatal(err)
	}
	x := &nbdtarget.Export{Name: "e", Dev: mapped.New("e", tb, f, discard.New()), Access: &nbdtarget.Access{ReadWrite: []string{"alice"}}}
	srv := &nbdtarget.Server{Exports: []*nbdtarget.Export{x}, TLSConfig: certs.Config(), TLS: nbdtarget.TLSRequire}
	sock := nbdtest.ServeUnix(t, srv, nbdtarget.ErrServerClosed)
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go srv.Serve(l)
	defer srv.Shutdown(context.Background())

	for _, uri := range []string{
		"nbds+unix:///e?socket=" + sock + "&tls-certificates=" + aliceDir + "&tls-hostname=localhost",
		"nbds+unix:///e?socket=" + sock + "&tls-certificates=" + aliceDir, // chain checked, no name
		"nbds://" + l.Addr().String() + "/e?tls-certificates=" + aliceDir, // 127.0.0.1 is in the certificate
	} {
		d := openURI(t, uri, testOptions(t))
		if _, err := d.WriteAt(pattern(8192, 3), 4096); err != nil {
			t.Fatal(err)
		}
		if err := d.Sync(); err != nil {
			t.Fatal(err)
		}
		back := make([]byte, 8192)
		if _, err := d.ReadAt(back, 4096); err != nil {
			t.Fatal(err)
		}
		mustEqual(t, uri, back, pattern(8192, 3))
		d.Close()
	}
	for _, tc := range []struct{ uri, why string }{
		{"nbd+unix:///e?socket=" + sock, "requires TLS"},
		{"nbds+unix:///e?socket=" + sock + "&tls-certificates=" + malloryDir, "refused"},
		{"nbds+unix:///e?socket=" + sock + "&tls-certificates=" + otherDir, "TLS handshake"},
		{"nbds+unix:///e?socket=" + sock + "&tls-certificates=" + aliceDir + "&tls-hostname=elsewhere", "TLS handshake"},
		{"nbds+unix:///e?socket=" + sock + "&tls-certificates=" + filepath.Join(base, "missing"), "not a directory"},
	} {
		u, err := ParseURI(tc.uri)
		if err != nil {
			t.Fatal(err)
		}
		d, err := Open(tc.uri, u, false, testOptions(t))
		if err == nil {
			d.Close()
			t.Errorf("%s: connected, want a refusal (%s)", tc.uri, tc.why)
			continue
		}
		if !strings.Contains(err.Error(), tc.why) {
			t.Errorf("%s: %v, want %q", tc.uri, err, tc.why)
		}
	}
	if _, err := (URI{TLS: true, TLSCertificates: filepath.Join(base, "missing")}).tlsConfig(); !errors.Is(err, ErrTLS) {
		t.Errorf("missing directory: %v, want ErrTLS", err)
	}
}
