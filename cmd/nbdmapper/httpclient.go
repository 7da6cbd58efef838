package main

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"flag"
	"fmt"
	"net/http"
	"os"
	"strings"
)

// httpClientFlags let `nbdmapper status` reach a metrics listener that a
// --metrics-web-config protects: HTTPS with a private CA, a client
// certificate, basic auth.
type httpClientFlags struct {
	ca, cert, key      string
	user, passwordFile string
}

func (f *httpClientFlags) register(fs *flag.FlagSet) {
	fs.StringVar(&f.ca, "tls-ca", "", "CA (PEM) that signed the metrics listener's certificate; implies https")
	fs.StringVar(&f.cert, "tls-cert", "", "client certificate (PEM) for a listener that asks for one; implies https")
	fs.StringVar(&f.key, "tls-key", "", "the client certificate's key (PEM)")
	fs.StringVar(&f.user, "user", "", "basic auth user name")
	fs.StringVar(&f.passwordFile, "password-file", "", "file holding the basic auth password (trailing newline ignored)")
}

// client returns an HTTP client and the base URL for addr: addr itself if
// it is a URL, else http://addr, or https://addr when a TLS flag is given.
func (f *httpClientFlags) client(addr string) (*http.Client, string, error) {
	base := addr
	if !strings.Contains(addr, "://") {
		base = "http://" + addr
		if f.ca != "" || f.cert != "" {
			base = "https://" + addr
		}
	}
	if (f.cert == "") != (f.key == "") {
		return nil, "", errors.New("--tls-cert and --tls-key go together")
	}
	cfg := &tls.Config{MinVersion: tls.VersionTLS12}
	if f.ca != "" {
		pem, err := os.ReadFile(f.ca)
		if err != nil {
			return nil, "", err
		}
		cfg.RootCAs = x509.NewCertPool()
		if !cfg.RootCAs.AppendCertsFromPEM(pem) {
			return nil, "", fmt.Errorf("--tls-ca %s: no PEM certificates", f.ca)
		}
	}
	if f.cert != "" {
		cert, err := tls.LoadX509KeyPair(f.cert, f.key)
		if err != nil {
			return nil, "", err
		}
		cfg.Certificates = []tls.Certificate{cert}
	}
	tr := http.DefaultTransport.(*http.Transport).Clone()
	tr.TLSClientConfig = cfg
	return &http.Client{Transport: tr}, strings.TrimSuffix(base, "/"), nil
}

// auth adds basic auth to req if --user is set.
func (f *httpClientFlags) auth(req *http.Request) error {
	if f.user == "" {
		if f.passwordFile != "" {
			return errors.New("--password-file needs --user")
		}
		return nil
	}
	if f.passwordFile == "" {
		return errors.New("--user needs --password-file")
	}
	b, err := os.ReadFile(f.passwordFile)
	if err != nil {
		return err
	}
	req.SetBasicAuth(f.user, strings.TrimRight(string(b), "\r\n"))
	return nil
}
