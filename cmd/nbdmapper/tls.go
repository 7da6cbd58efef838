package main

import (
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"slices"
	"strings"

	"github.com/nbdmapper/nbdmapper/nbdtarget"
)

// tlsFlags are serve's NBD TLS flags:
//
//	--tls off|on|require  --tls-cert FILE --tls-key FILE [--tls-ca FILE]
//	--allow EXPORT=ID[,ID...]     (repeated) who may use EXPORT, read-write
//	--allow-ro EXPORT=ID[,ID...]  (repeated) who may use EXPORT, read-only
//
// An ID names a client certificate: NAME or CN=NAME (its subject's common
// name), or one of its subject alternative names as DNS:NAME, email:ADDR,
// URI:URI or IP:ADDR.
type tlsFlags struct {
	mode           string
	cert, key, ca  string
	allow, allowRO accessFlag
}

func (f *tlsFlags) register(fs *flag.FlagSet) {
	fs.StringVar(&f.mode, "tls", "off", "NBD over TLS: off, on (client chooses) or require")
	fs.StringVar(&f.cert, "tls-cert", "", "server certificate (PEM, chain allowed); re-read on SIGHUP")
	fs.StringVar(&f.key, "tls-key", "", "server private key (PEM); re-read on SIGHUP")
	fs.StringVar(&f.ca, "tls-ca", "", "CA bundle (PEM): clients must present a certificate it signed")
	f.allow.m, f.allowRO.m = map[string][]string{}, map[string][]string{}
	fs.Var(&f.allow, "allow", "EXPORT=ID[,ID...]: only these client certificates may use EXPORT (repeatable; ID is NAME, CN=NAME, DNS:, email:, URI: or IP:)")
	fs.Var(&f.allowRO, "allow-ro", "EXPORT=ID[,ID...]: these client certificates may read EXPORT (repeatable)")
}

// apply checks the flags against each other and the exports, loads the
// certificates and configures srv and the exports. certs is nil when TLS is
// off.
func (f *tlsFlags) apply(srv *nbdtarget.Server, exports []*nbdtarget.Export) (certs *nbdtarget.Certs, err error) {
	mode, err := nbdtarget.ParseTLSMode(f.mode)
	if err != nil {
		return nil, fmt.Errorf("--tls: %w", err)
	}
	restricted := len(f.allow.m) > 0 || len(f.allowRO.m) > 0
	switch {
	case mode == nbdtarget.TLSOff && (f.cert != "" || f.key != "" || f.ca != ""):
		return nil, errors.New("--tls-cert, --tls-key and --tls-ca need --tls on or --tls require")
	case mode == nbdtarget.TLSOff && restricted:
		return nil, errors.New("--allow and --allow-ro need --tls on or require, and --tls-ca")
	case mode != nbdtarget.TLSOff && (f.cert == "" || f.key == ""):
		return nil, fmt.Errorf("--tls %s needs --tls-cert and --tls-key", mode)
	case restricted && f.ca == "":
		return nil, errors.New("--allow and --allow-ro need --tls-ca: without it client certificates are not verified")
	}
	for _, fl := range []*accessFlag{&f.allow, &f.allowRO} {
		for name := range fl.m {
			if !slices.ContainsFunc(exports, func(x *nbdtarget.Export) bool { return x.Name == name }) {
				return nil, fmt.Errorf("--allow %s=...: no export named %s", name, name)
			}
		}
	}
	for _, x := range exports {
		x.Access = f.access(x.Name)
	}
	srv.TLS = mode
	if mode == nbdtarget.TLSOff {
		return nil, nil
	}
	certs, err = nbdtarget.LoadCerts(f.cert, f.key, f.ca)
	if err != nil {
		return nil, err
	}
	srv.TLSConfig = certs.Config()
	return certs, nil
}

// access is who --allow and --allow-ro let use the export name, or nil
// (anyone). Every export gets it when it is made: at start-up, by
// `nbdmapper create` and by a rescan of --tables.
func (f *tlsFlags) access(name string) *nbdtarget.Access {
	rw, ro := f.allow.m[name], f.allowRO.m[name]
	if rw == nil && ro == nil {
		return nil
	}
	return &nbdtarget.Access{ReadWrite: rw, ReadOnly: ro}
}

// accessFlag collects repeated EXPORT=ID[,ID...] values.
type accessFlag struct{ m map[string][]string }

func (a *accessFlag) String() string {
	if a == nil || a.m == nil {
		return ""
	}
	var parts []string
	for name, ids := range a.m {
		parts = append(parts, name+"="+strings.Join(ids, ","))
	}
	slices.Sort(parts)
	return strings.Join(parts, " ")
}

func (a *accessFlag) Set(s string) error {
	name, list, ok := strings.Cut(s, "=")
	if !ok || name == "" || list == "" {
		return fmt.Errorf("%q: want EXPORT=ID[,ID...]", s)
	}
	for id := range strings.SplitSeq(list, ",") {
		canon, err := nbdtarget.ParseIdentity(strings.TrimSpace(id))
		if err != nil {
			return err
		}
		a.m[name] = append(a.m[name], canon)
	}
	return nil
}

// reloadCerts re-reads the certificates (on SIGHUP). Connections already
// up keep their TLS sessions.
func reloadCerts(certs *nbdtarget.Certs, log *slog.Logger) {
	if err := certs.Reload(); err != nil {
		log.Error("SIGHUP: keeping the certificates loaded before", "err", err)
		return
	}
	log.Info("SIGHUP: certificates reloaded")
}
