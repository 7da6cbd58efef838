package nbdtarget

// TLS for NBD: NBD_OPT_STARTTLS (proto.md "TLS support"), certificates that
// can be re-read while connections stay up, and per-export access by client
// certificate.
//
//	C: option STARTTLS (no data)     S: ACK
//	C/S: TLS handshake on the same stream
//	C: option ...                    negotiation restarts inside TLS, with
//	                                 STRUCTURED_REPLY and meta contexts unset
//
// Go's crypto/tls has no TLS-PSK (RFC 4279), which nbdkit and qemu-nbd also
// offer; only X.509 certificates are supported.

import (
	"bufio"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"net"
	"os"
	"slices"
	"strings"
	"sync/atomic"
	"time"

	"github.com/nbdmapper/nbdmapper/wire"
)

// TLSMode says what the server asks of clients when Server.TLSConfig is set.
type TLSMode int

const (
	// TLSOff refuses STARTTLS (ERR_UNSUP): everything is plaintext.
	TLSOff TLSMode = iota
	// TLSOn offers STARTTLS and lets the client choose. Exports with an
	// Access list are TLS-only: a plaintext client gets ERR_TLS_REQD for
	// them and does not see them in LIST (the spec's selective TLS).
	TLSOn
	// TLSRequire answers every option before STARTTLS, except ABORT, with
	// ERR_TLS_REQD, and closes on EXPORT_NAME (the spec's forced TLS).
	TLSRequire
)

var tlsModes = []string{TLSOff: "off", TLSOn: "on", TLSRequire: "require"}

func (m TLSMode) String() string {
	if int(m) < len(tlsModes) {
		return tlsModes[m]
	}
	return fmt.Sprintf("TLSMode(%d)", int(m))
}

// ParseTLSMode parses "off", "on" or "require".
func ParseTLSMode(s string) (TLSMode, error) {
	if i := slices.Index(tlsModes, s); i >= 0 {
		return TLSMode(i), nil
	}
	return 0, fmt.Errorf("TLS mode %q: want off, on or require", s)
}

var (
	errStartTLSPipelined = errors.New("client sent data after STARTTLS before its reply")
	errTLSRequired       = errors.New("EXPORT_NAME before STARTTLS on a server that requires TLS")
	errNotAllowed        = errors.New("EXPORT_NAME for an export the client may not use")
	// errNoClientCert is what a client that sent no certificate is told
	// in the log. GnuTLS clients send none when their key suits no
	// signature scheme the server offers (an RSA-PSS key, say).
	errNoClientCert = errors.New("client sent no certificate: it has none, or none with a key the server can use " +
		"(RSA, ECDSA P-256/P-384/P-521 or Ed25519; not RSA-PSS)")
)

// Certs holds a server certificate and key, and optionally a CA that client
// certificates must chain to, read from PEM files. Reload re-reads them;
// Config's handshakes use whatever was loaded last, so connections already
// up keep going and new ones get the new certificates.
type Certs struct {
	certFile, keyFile, caFile string
	cur                       atomic.Pointer[tls.Config]
}

// LoadCerts reads the server certificate (chain) and key and, if caFile is
// not empty, the CA bundle that verifies client certificates: with it every
// client must present a certificate that chains to it.
func LoadCerts(certFile, keyFile, caFile string) (*Certs, error) {
	c := &Certs{certFile: certFile, keyFile: keyFile, caFile: caFile}
	if err := c.Reload(); err != nil {
		return nil, err
	}
	return c, nil
}

// Reload re-reads the files. On error the certificates loaded before stay
// in use.
func (c *Certs) Reload() error {
	cert, err := tls.LoadX509KeyPair(c.certFile, c.keyFile)
	if err != nil {
		return fmt.Errorf("TLS certificate: %w", err)
	}
	cfg := &tls.Config{
		Certificates: []tls.Certificate{cert},
		MinVersion:   tls.VersionTLS12,
	}
	if c.caFile != "" {
		pem, err := os.ReadFile(c.caFile)
		if err != nil {
			return fmt.Errorf("TLS CA: %w", err)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return fmt.Errorf("TLS CA %s: no PEM certificates", c.caFile)
		}
		// The chain is verified here rather than by crypto/tls
		// (ClientCAs), which would also name the CA's subject in the
		// CertificateRequest's certificate_authorities. A GnuTLS client
		// (libnbd, qemu) that gets CA names picks a certificate only if
		// its key type is among those of the request's
		// signature_algorithms, and reads rsa_pss_rsae_* (the only RSA
		// schemes TLS 1.3 allows, RFC 8446 4.2.3) as the RSA-PSS key
		// type: it then sends no RSA certificate at all. Without CA
		// names, a client holding one certificate sends it, and signs
		// with rsa_pss_rsae_* as usual.
		// Requested, not required, so that verifyClient says why a
		// client that sent none is refused.
		cfg.ClientAuth = tls.RequestClientCert
		cfg.VerifyConnection = func(cs tls.ConnectionState) error {
			return verifyClient(pool, cs.PeerCertificates)
		}
	}
	c.cur.Store(cfg)
	return nil
}

// verifyClient checks that a client's certificate chains to a CA of
// pool and may be used for client authentication, as crypto/tls does
// for RequireAndVerifyClientCert.
func verifyClient(pool *x509.CertPool, certs []*x509.Certificate) error {
	if len(certs) == 0 {
		return errNoClientCert
	}
	opts := x509.VerifyOptions{
		Roots:         pool,
		Intermediates: x509.NewCertPool(),
		KeyUsages:     []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	}
	for _, c := range certs[1:] {
		opts.Intermediates.AddCert(c)
	}
	if _, err := certs[0].Verify(opts); err != nil {
		return fmt.Errorf("client certificate %q: %w", certs[0].Subject.CommonName, err)
	}
	return nil
}

// verifiedClient returns the client's certificate, which the handshake
// verified (verifyClient) if there is one: a server without a CA asks for
// none.
func verifiedClient(cs tls.ConnectionState) *x509.Certificate {
	if len(cs.PeerCertificates) == 0 {
		return nil
	}
	return cs.PeerCertificates[0]
}

// Config is the tls.Config for Server.TLSConfig: each handshake takes the
// certificates last loaded.
func (c *Certs) Config() *tls.Config {
	return &tls.Config{
		MinVersion: tls.VersionTLS12,
		GetConfigForClient: func(*tls.ClientHelloInfo) (*tls.Config, error) {
			return c.cur.Load(), nil
		},
	}
}

// Access limits an export to TLS clients whose certificate was verified
// against Certs' CA and names one of its identities. An identity is
//
//	NAME or CN=NAME    the certificate subject's common name (CN= if it has a ':')
//	DNS:NAME           a DNS subject alternative name
//	email:ADDRESS      an email SAN
//	URI:URI            a URI SAN (a SPIFFE ID, say)
//	IP:ADDRESS         an IP address SAN
//
// Clients named in ReadOnly see the export read-only; a client named in
// both lists gets read-write access.
type Access struct {
	ReadWrite []string
	ReadOnly  []string
}

// ParseIdentity checks an identity and returns it in canonical form
// (a bare name becomes CN=NAME; IP addresses are normalised).
func ParseIdentity(s string) (string, error) {
	kind, val, ok := strings.Cut(s, ":")
	if cn, isCN := strings.CutPrefix(s, "CN="); isCN || !ok {
		if !isCN {
			cn = s
		}
		if cn == "" {
			return "", errors.New("empty identity")
		}
		return "CN=" + cn, nil
	}
	switch kind {
	case "DNS", "email", "URI":
		if val == "" {
			return "", fmt.Errorf("identity %q: empty %s", s, kind)
		}
		return s, nil
	case "IP":
		ip := net.ParseIP(val)
		if ip == nil {
			return "", fmt.Errorf("identity %q: bad IP address", s)
		}
		return "IP:" + ip.String(), nil
	}
	return "", fmt.Errorf("identity %q: want NAME, CN=NAME, DNS:, email:, URI: or IP:", s)
}

// identities lists what a verified client certificate says about its
// holder, in ParseIdentity's canonical forms.
func identities(cert *x509.Certificate) []string {
	var ids []string
	if cert.Subject.CommonName != "" {
		ids = append(ids, "CN="+cert.Subject.CommonName)
	}
	for _, n := range cert.DNSNames {
		ids = append(ids, "DNS:"+n)
	}
	for _, n := range cert.EmailAddresses {
		ids = append(ids, "email:"+n)
	}
	for _, u := range cert.URIs {
		ids = append(ids, "URI:"+u.String())
	}
	for _, ip := range cert.IPAddresses {
		ids = append(ids, "IP:"+ip.String())
	}
	return ids
}

// access is what a connection may do with an export.
type access int

const (
	accessNone access = iota
	accessTLSReqd
	accessReadOnly
	accessReadWrite
)

// access says what this connection may do with x: everything if x has no
// Access list; otherwise only with a verified client certificate it names.
func (c *conn) access(x *Export) access {
	if x.Access == nil {
		return accessReadWrite
	}
	if c.tls == nil {
		return accessTLSReqd
	}
	cert := verifiedClient(c.tls.ConnectionState())
	if cert == nil {
		return accessNone
	}
	ids := identities(cert)
	named := func(list []string) bool {
		return slices.ContainsFunc(list, func(s string) bool {
			id, err := ParseIdentity(s)
			return err == nil && slices.Contains(ids, id)
		})
	}
	switch {
	case named(x.Access.ReadWrite):
		return accessReadWrite
	case named(x.Access.ReadOnly):
		return accessReadOnly
	}
	return accessNone
}

// export finds the export an option names and checks that this connection
// may use it. If not, x is nil and rep and msg are the error reply.
func (c *conn) export(name string) (x *Export, rep uint32, msg string) {
	x = c.srv.lookup(name)
	if x == nil {
		return nil, wire.RepErrUnknown, "no export named " + name
	}
	switch c.access(x) {
	case accessTLSReqd:
		return nil, wire.RepErrTLSReqd, "export " + name + " needs TLS"
	case accessNone:
		return nil, wire.RepErrPolicy, "client certificate not allowed for export " + name
	}
	return x, 0, ""
}

// readOnly reports whether this connection sees x read-only.
func (c *conn) readOnly(x *Export) bool {
	return x.ReadOnly || c.access(x) == accessReadOnly
}

// tlsGate applies TLSRequire before STARTTLS: it returns ok to let the
// option through, or the error that ends its handling.
func (c *conn) tlsGate(id uint32) (ok bool, err error) {
	if c.srv.TLS != TLSRequire || c.tls != nil {
		return true, nil
	}
	switch id {
	case wire.OptStartTLS, wire.OptAbort:
		return true, nil
	case wire.OptExportName:
		return false, errTLSRequired
	}
	return false, c.optReply(id, wire.RepErrTLSReqd, []byte("TLS required: send STARTTLS first"))
}

// startTLS handles NBD_OPT_STARTTLS: ACK, then a TLS handshake on the same
// stream, then negotiation starts over inside it.
func (c *conn) startTLS(data []byte) error {
	switch {
	case c.srv.TLSConfig == nil || c.srv.TLS == TLSOff:
		return c.optReply(wire.OptStartTLS, wire.RepErrUnsup, []byte("TLS not configured"))
	case c.tls != nil:
		return c.optReply(wire.OptStartTLS, wire.RepErrInvalid, []byte("TLS already negotiated"))
	case len(data) != 0:
		return c.optReply(wire.OptStartTLS, wire.RepErrInvalid, []byte("STARTTLS takes no data"))
	case c.br.Buffered() != 0:
		// Bytes sent before our ACK would be read as if they had come
		// through TLS: plaintext injection (CVE-2021-3716 in nbdkit).
		return errStartTLSPipelined
	}
	if err := c.optReply(wire.OptStartTLS, wire.RepAck, nil); err != nil {
		return err
	}
	c.sealed = bufio.NewReaderSize(c.sock, 64<<10)
	tc := tls.Server(sealedConn{c.sock, c.sealed}, c.srv.TLSConfig)
	if err := tc.Handshake(); err != nil {
		return fmt.Errorf("TLS handshake: %w", err)
	}
	c.tls = tc
	c.br.Reset(tlsRecords{c})
	c.bw.Reset(tc)
	c.structured, c.meta, c.metaExport = false, false, nil
	cs := tc.ConnectionState()
	var who []string
	if cert := verifiedClient(cs); cert != nil {
		who = identities(cert)
	}
	c.log = c.log.With("tls", tls.VersionName(cs.Version), "client", strings.Join(who, ","))
	c.log.Debug("nbd STARTTLS")
	return nil
}

// close closes the connection, telling a TLS peer first (close_notify).
func (c *conn) close() {
	c.stop()
	if c.tls != nil {
		c.tls.Close()
		return
	}
	c.nc.Close()
}

// sealedConn is the socket as crypto/tls reads it: through a buffer of
// its own (conn.sealed), so that one read of the socket takes every record
// that has come. crypto/tls asks the socket for little more than the record
// it is decrypting, so without the buffer each record cost a system call
// of its own, and the records that had come behind it stayed in the
// socket, where tlsRecords does not look.
type sealedConn struct {
	net.Conn
	r *bufio.Reader
}

func (s sealedConn) Read(p []byte) (int, error) { return s.r.Read(p) }

// tlsRecords reads a TLS connection for the read buffer. crypto/tls
// decrypts one record per Read, and a client such as libnbd sends each
// request as a record of its own, so a buffer filled by one Read would hold
// one request where the client sent several: the reader would then see no
// request waiting and flush each reply on its own, one record and one
// write each (see unlockSend). In the transmission phase, after a Read that
// returned data, it also takes the records crypto/tls already holds, which
// needs no system call, under a read deadline in the past so that it stops
// at the first record that would need the socket.
type tlsRecords struct{ c *conn }

// longAgo is a deadline that has passed.
var longAgo = time.Unix(1, 0)

func (r tlsRecords) Read(p []byte) (int, error) {
	c := r.c
	n, err := c.tls.Read(p)
	if err != nil || n == 0 || n == len(p) || !c.transmitting {
		return n, err
	}
	c.nc.SetReadDeadline(longAgo)
	for n < len(p) {
		k, err := c.tls.Read(p[n:])
		n += k
		if err != nil || k == 0 {
			// A deadline error says no whole record is held; any other
			// error is kept by crypto/tls and returned by the next Read.
			break
		}
	}
	c.nc.SetReadDeadline(time.Time{})
	if c.stopped.Load() {
		// Shutdown's deadline (stopReading) may have been the one just
		// cleared: set it again. stopped is set before that deadline, so
		// one of the two is seen.
		c.nc.SetReadDeadline(time.Now())
	}
	return n, nil
}
