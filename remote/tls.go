package remote

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"os"
	"path/filepath"
)

// ErrTLS is wrapped by errors loading a TLS client's certificates.
var ErrTLS = errors.New("TLS client set-up")

// The file names libnbd, qemu and nbdkit look for in a certificates
// directory.
const (
	caFile   = "ca-cert.pem"
	certFile = "client-cert.pem"
	keyFile  = "client-key.pem"
)

// CertDir is the certificates directory an nbds URI without
// tls-certificates= uses, as libnbd chooses it: /etc/pki/libnbd for root,
// else $HOME/.pki/libnbd or $HOME/.config/pki/libnbd, whichever exists
// first. "" means none exists: the server is then checked against the
// system's trusted CAs and no client certificate is offered.
func CertDir() string {
	var dirs []string
	if os.Geteuid() == 0 {
		dirs = []string{"/etc/pki/libnbd"}
	} else if home, err := os.UserHomeDir(); err == nil {
		dirs = []string{filepath.Join(home, ".pki/libnbd"), filepath.Join(home, ".config/pki/libnbd")}
	}
	for _, d := range dirs {
		if st, err := os.Stat(d); err == nil && st.IsDir() {
			return d
		}
	}
	return ""
}

// tlsConfig reads the URI's certificates directory (on every connection,
// so that replaced certificates are picked up by the next reconnection):
// ca-cert.pem, if present, is the only CA the server's certificate may
// chain to (else the system's CAs); client-cert.pem and client-key.pem,
// if present, are offered to the server.
//
// The server's name is checked against tls-hostname, or the URI's host
// over TCP. Over a unix socket without tls-hostname only the chain is
// checked, as there is no name to check. tls-verify-peer=false checks
// nothing (libnbd's meaning): the connection is encrypted but the server
// is not authenticated.
func (u URI) tlsConfig() (*tls.Config, error) {
	dir := u.TLSCertificates
	if dir == "" {
		dir = CertDir()
	}
	cfg := &tls.Config{MinVersion: tls.VersionTLS12}
	if dir != "" {
		if st, err := os.Stat(dir); err != nil || !st.IsDir() {
			return nil, fmt.Errorf("%w: tls-certificates %s: not a directory", ErrTLS, dir)
		}
		if pem, err := os.ReadFile(filepath.Join(dir, caFile)); err == nil {
			pool := x509.NewCertPool()
			if !pool.AppendCertsFromPEM(pem) {
				return nil, fmt.Errorf("%w: %s: no certificates", ErrTLS, filepath.Join(dir, caFile))
			}
			cfg.RootCAs = pool
		} else if !os.IsNotExist(err) {
			return nil, fmt.Errorf("%w: %v", ErrTLS, err)
		}
		cert, key := filepath.Join(dir, certFile), filepath.Join(dir, keyFile)
		_, errc := os.Stat(cert)
		_, errk := os.Stat(key)
		switch {
		case errc == nil && errk == nil:
			pair, err := tls.LoadX509KeyPair(cert, key)
			if err != nil {
				return nil, fmt.Errorf("%w: %v", ErrTLS, err)
			}
			cfg.Certificates = []tls.Certificate{pair}
		case errc == nil || errk == nil:
			return nil, fmt.Errorf("%w: %s needs both %s and %s", ErrTLS, dir, certFile, keyFile)
		}
	}
	switch {
	case !u.TLSVerifyPeer:
		cfg.InsecureSkipVerify = true
	case u.TLSHostname != "":
		cfg.ServerName = u.TLSHostname
	case !u.Unix:
		cfg.ServerName = u.Host
	default:
		// No name to check: verify the chain alone.
		roots := cfg.RootCAs
		cfg.InsecureSkipVerify = true
		cfg.VerifyConnection = func(cs tls.ConnectionState) error {
			if len(cs.PeerCertificates) == 0 {
				return errors.New("the server sent no certificate")
			}
			opts := x509.VerifyOptions{Roots: roots, Intermediates: x509.NewCertPool(), KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}
			for _, c := range cs.PeerCertificates[1:] {
				opts.Intermediates.AddCert(c)
			}
			_, err := cs.PeerCertificates[0].Verify(opts)
			return err
		}
	}
	return cfg, nil
}
