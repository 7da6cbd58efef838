package rbd

import (
	"errors"
	"fmt"
	"slices"
	"strings"
)

// Prefix starts every device name this package opens.
const Prefix = "rbd:"

// ErrName is wrapped by every error about a malformed rbd: name.
var ErrName = errors.New("malformed rbd: device name")

// Name is a parsed rbd: device name:
//
//	rbd:POOL/IMAGE[@SNAP][:conf=FILE][:id=NAME][:keyring=FILE][:KEY=VALUE...]
//
// as qemu's rbd driver reads it: fields are separated by ':', and '\'
// makes the character after it literal (a ':' in a path is written '\:').
// Options other than conf, id and keyring are Ceph configuration
// settings, set on the connection as a conf file's would be
// (mon_host=127.0.0.1:6789, rbd_cache=false).
type Name struct {
	Pool, Image, Snap string
	Conf              string // ceph.conf to read; "" reads Ceph's default search path
	ID                string // the client's id, without "client."; "" is "admin"
	Keyring           string
	Options           [][2]string // other KEY=VALUE settings, in the order written
}

// IsName says whether name is one this package opens: it starts with
// "rbd:".
func IsName(name string) bool { return strings.HasPrefix(name, Prefix) }

// ParseName parses an rbd: device name.
func ParseName(name string) (Name, error) {
	var n Name
	if !IsName(name) {
		return n, fmt.Errorf("%q: %w: no %q prefix", name, ErrName, Prefix)
	}
	fields, err := split(name[len(Prefix):])
	if err != nil {
		return n, fmt.Errorf("%q: %w: %v", name, ErrName, err)
	}
	path := fields[0]
	if i := strings.IndexByte(path, '@'); i >= 0 {
		n.Snap = path[i+1:]
		path = path[:i]
		if n.Snap == "" {
			return n, fmt.Errorf("%q: %w: empty snapshot name after '@'", name, ErrName)
		}
	}
	pool, image, ok := strings.Cut(path, "/")
	if !ok || pool == "" || image == "" || strings.Contains(image, "/") {
		return n, fmt.Errorf("%q: %w: want rbd:POOL/IMAGE[@SNAP][:KEY=VALUE...]", name, ErrName)
	}
	n.Pool, n.Image = pool, image
	seen := make(map[string]bool)
	for _, f := range fields[1:] {
		k, v, ok := strings.Cut(f, "=")
		if !ok || k == "" || v == "" {
			return n, fmt.Errorf("%q: %w: option %q is not KEY=VALUE", name, ErrName, f)
		}
		if seen[k] {
			return n, fmt.Errorf("%q: %w: option %s given twice", name, ErrName, k)
		}
		seen[k] = true
		switch k {
		case "conf":
			n.Conf = v
		case "id":
			n.ID = v
		case "keyring":
			n.Keyring = v
		default:
			n.Options = append(n.Options, [2]string{k, v})
		}
	}
	return n, nil
}

// split cuts s at each ':' not escaped by '\', and drops the escapes.
func split(s string) ([]string, error) {
	var out []string
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		switch c := s[i]; c {
		case '\\':
			if i+1 == len(s) {
				return nil, errors.New(`'\' at the end`)
			}
			i++
			b.WriteByte(s[i])
		case ':':
			out = append(out, b.String())
			b.Reset()
		default:
			b.WriteByte(c)
		}
	}
	return append(out, b.String()), nil
}

// String is the name's normal form: the image, then its options sorted
// by key, each escaped. Two names that read the same conf as the same
// client name the same image, so the Pool opens it once.
func (n Name) String() string {
	var b strings.Builder
	b.WriteString(Prefix)
	b.WriteString(escape(n.Pool) + "/" + escape(n.Image))
	if n.Snap != "" {
		b.WriteString("@" + escape(n.Snap))
	}
	opts := slices.Clone(n.Options)
	for _, o := range [][2]string{{"conf", n.Conf}, {"id", n.ID}, {"keyring", n.Keyring}} {
		if o[1] != "" {
			opts = append(opts, o)
		}
	}
	slices.SortFunc(opts, func(a, b [2]string) int { return strings.Compare(a[0], b[0]) })
	for _, o := range opts {
		b.WriteString(":" + escape(o[0]) + "=" + escape(o[1]))
	}
	return b.String()
}

func escape(s string) string {
	return strings.NewReplacer(`\`, `\\`, `:`, `\:`).Replace(s)
}
