package remote

import (
	"errors"
	"fmt"
	"net"
	"net/url"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
)

// ErrURI is wrapped by every error about the form of an NBD URI.
var ErrURI = errors.New("bad NBD URI")

// DefaultPort is the NBD port an nbd:// URI without one means.
const DefaultPort = "10809"

// URI is a parsed NBD URI, as libnbd and qemu write them
// (https://github.com/NetworkBlockDevice/nbd/blob/master/doc/uri.md):
//
//	nbd://HOST[:PORT]/EXPORT                  TCP, plaintext
//	nbds://HOST[:PORT]/EXPORT                 TCP, TLS required
//	nbd+unix:///EXPORT?socket=PATH            unix socket, plaintext
//	nbds+unix:///EXPORT?socket=PATH           unix socket, TLS required
//
// EXPORT is the path without its leading "/", percent-decoded; empty is
// the server's default export. Query parameters, as libnbd's:
//
//	socket=PATH             the unix socket (nbd+unix, nbds+unix only)
//	tls-certificates=DIR    ca-cert.pem, client-cert.pem, client-key.pem
//	                        (nbds only; default: libnbd's directories, see
//	                        CertDir)
//	tls-verify-peer=BOOL    check the server's certificate (default true)
//	tls-hostname=NAME       the name the server certificate must carry
//	                        (default: HOST; over a unix socket, none)
//
// Anything else (user names, TLS-PSK files, vsock, fragments, unknown
// parameters) is refused, so that a typo cannot silently mean another
// export.
type URI struct {
	TLS    bool
	Unix   bool
	Host   string // TCP: lowercased host or IP address, "localhost" if empty
	Port   string // TCP: decimal port
	Export string
	Socket string // unix: the socket's path, as written

	TLSCertificates string // as written; "" means libnbd's default directories
	TLSVerifyPeer   bool
	TLSHostname     string
}

// IsURI says whether name is written as an NBD URI (an nbd... scheme
// followed by "://"), and so is not a path. It does not check the rest.
func IsURI(name string) bool {
	scheme, _, ok := strings.Cut(name, "://")
	return ok && strings.HasPrefix(strings.ToLower(scheme), "nbd") && !strings.ContainsAny(scheme, "/")
}

// ParseURI parses an NBD URI. Errors wrap ErrURI.
func ParseURI(s string) (URI, error) {
	fail := func(format string, args ...any) (URI, error) {
		return URI{}, fmt.Errorf("%w %q: %s", ErrURI, s, fmt.Sprintf(format, args...))
	}
	if !IsURI(s) {
		return fail("want nbd://, nbds://, nbd+unix:// or nbds+unix://")
	}
	pu, err := url.Parse(s)
	if err != nil {
		return fail("%v", errors.Unwrap(err))
	}
	u := URI{TLSVerifyPeer: true}
	switch strings.ToLower(pu.Scheme) {
	case "nbd":
	case "nbds":
		u.TLS = true
	case "nbd+unix":
		u.Unix = true
	case "nbds+unix":
		u.TLS, u.Unix = true, true
	case "nbd+vsock", "nbds+vsock":
		return fail("vsock is not supported")
	default:
		return fail("unknown scheme %q", pu.Scheme)
	}
	if pu.User != nil {
		return fail("user names are for TLS-PSK, which is not supported")
	}
	if pu.Fragment != "" || strings.Contains(s, "#") {
		return fail("a fragment (#...) is not allowed")
	}
	if pu.Opaque != "" {
		return fail("want %s://...", pu.Scheme)
	}
	u.Export = strings.TrimPrefix(pu.Path, "/")
	if len(u.Export) > 4096 {
		return fail("export name longer than 4096 bytes")
	}

	q, err := url.ParseQuery(pu.RawQuery)
	if err != nil {
		return fail("query: %v", err)
	}
	for key, vals := range q {
		if len(vals) != 1 {
			return fail("%s given %d times", key, len(vals))
		}
		v := vals[0]
		switch key {
		case "socket":
			if !u.Unix {
				return fail("socket= is for nbd+unix:// and nbds+unix://")
			}
			if v == "" {
				return fail("empty socket=")
			}
			u.Socket = v
		case "tls-certificates", "tls-verify-peer", "tls-hostname":
			if !u.TLS {
				return fail("%s= needs nbds:// or nbds+unix://", key)
			}
			switch key {
			case "tls-certificates":
				if v == "" {
					return fail("empty tls-certificates=")
				}
				u.TLSCertificates = v
			case "tls-verify-peer":
				b, ok := parseBool(v)
				if !ok {
					return fail("tls-verify-peer=%q: want true or false", v)
				}
				u.TLSVerifyPeer = b
			case "tls-hostname":
				u.TLSHostname = v
			}
		case "tls-psk-file", "tls-username":
			return fail("%s: TLS-PSK is not supported (Go's TLS has no PSK); use certificates", key)
		default:
			return fail("unknown parameter %q", key)
		}
	}

	if u.Unix {
		if pu.Host != "" {
			return fail("a unix socket URI has no host (want %s:///EXPORT?socket=PATH)", pu.Scheme)
		}
		if u.Socket == "" {
			return fail("no socket=PATH")
		}
		return u, nil
	}
	u.Host, u.Port = strings.ToLower(pu.Hostname()), pu.Port()
	if u.Host == "" {
		u.Host = "localhost"
	}
	if u.Port == "" {
		if strings.HasSuffix(pu.Host, ":") {
			return fail("empty port")
		}
		u.Port = DefaultPort
	}
	if p, err := strconv.ParseUint(u.Port, 10, 16); err != nil || p == 0 {
		return fail("port %q: want 1 to 65535", u.Port)
	}
	u.Port = strings.TrimLeft(u.Port, "0")
	return u, nil
}

func parseBool(s string) (v, ok bool) {
	switch strings.ToLower(s) {
	case "1", "true", "yes", "on":
		return true, true
	case "0", "false", "no", "off":
		return false, true
	}
	return false, false
}

// Scheme is the URI's scheme: nbd, nbds, nbd+unix or nbds+unix.
func (u URI) Scheme() string {
	s := "nbd"
	if u.TLS {
		s = "nbds"
	}
	if u.Unix {
		s += "+unix"
	}
	return s
}

// Network and Addr are what to dial: "tcp" and HOST:PORT, or "unix" and
// the socket's path.
func (u URI) Network() string {
	if u.Unix {
		return "unix"
	}
	return "tcp"
}

func (u URI) Addr() string {
	if u.Unix {
		return u.Socket
	}
	return net.JoinHostPort(u.Host, u.Port)
}

// String writes the URI in its normal form: lowercase scheme and host, the
// port always, the export percent-encoded where it must be, and the query
// parameters sorted, with relative paths (socket, certificate directory)
// made absolute against the current directory. Two URIs that reach the
// same export the same way have the same normal form, which is what makes
// it the export's identity (backing.ID).
func (u URI) String() string {
	v := url.URL{Scheme: u.Scheme(), Path: "/" + u.Export}
	if !u.Unix {
		v.Host = u.Addr()
	}
	var q []string
	add := func(k, val string) {
		q = append(q, k+"="+strings.ReplaceAll(url.QueryEscape(val), "%2F", "/"))
	}
	if u.Unix {
		add("socket", absPath(u.Socket))
	}
	if u.TLSCertificates != "" {
		add("tls-certificates", absPath(u.TLSCertificates))
	}
	if u.TLSHostname != "" {
		add("tls-hostname", u.TLSHostname)
	}
	if u.TLS && !u.TLSVerifyPeer {
		add("tls-verify-peer", "false")
	}
	slices.Sort(q)
	v.RawQuery = strings.Join(q, "&")
	return v.String()
}

func absPath(p string) string {
	if a, err := filepath.Abs(p); err == nil {
		return a
	}
	return filepath.Clean(p)
}
