package rbd

import (
	"errors"
	"testing"
)

func TestParseName(t *testing.T) {
	for _, tc := range []struct {
		name, in string
		want     string // normal form, or "" for an error
	}{
		{name: "image", in: "rbd:p/i", want: "rbd:p/i"},
		{name: "snapshot", in: "rbd:p/i@s1", want: "rbd:p/i@s1"},
		{name: "options sorted", in: "rbd:p/i:keyring=k:id=u:conf=c.conf:rbd_cache=false", want: "rbd:p/i:conf=c.conf:id=u:keyring=k:rbd_cache=false"},
		{name: "escaped colon", in: `rbd:p/i:conf=a\:b.conf`, want: `rbd:p/i:conf=a\:b.conf`},
		{name: "mon_host", in: `rbd:p/i:mon_host=127.0.0.1\:6789`, want: `rbd:p/i:mon_host=127.0.0.1\:6789`},
		{name: "no image", in: "rbd:p", want: ""},
		{name: "empty pool", in: "rbd:/i", want: ""},
		{name: "namespace not taken", in: "rbd:p/n/i", want: ""},
		{name: "empty snapshot", in: "rbd:p/i@", want: ""},
		{name: "option without value", in: "rbd:p/i:conf", want: ""},
		{name: "option twice", in: "rbd:p/i:id=a:id=b", want: ""},
		{name: "trailing escape", in: `rbd:p/i:conf=a\`, want: ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			n, err := ParseName(tc.in)
			if tc.want == "" {
				if !errors.Is(err, ErrName) {
					t.Fatalf("ParseName(%q) = %v, %v; want an ErrName", tc.in, n, err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if got := n.String(); got != tc.want {
				t.Fatalf("normal form %q, want %q", got, tc.want)
			}
			again, err := ParseName(n.String())
			if err != nil || again.String() != tc.want {
				t.Fatalf("normal form does not parse to itself: %v, %v", again, err)
			}
		})
	}
}

// TestIdentify: two spellings of one image are one device to a Pool;
// other names are not the scheme's.
func TestIdentify(t *testing.T) {
	var s Scheme
	a, ok, err := s.Identify("rbd:p/i:id=u:conf=c")
	if err != nil || !ok {
		t.Fatal(ok, err)
	}
	b, _, _ := s.Identify("rbd:p/i:conf=c:id=u")
	if a != b {
		t.Fatalf("IDs %v and %v differ", a, b)
	}
	if _, ok, err := s.Identify("disk.img"); ok || err != nil {
		t.Fatalf("a path: claimed %v, %v", ok, err)
	}
	if _, ok, err := s.Identify("rbd:nopool"); !ok || !errors.Is(err, ErrName) {
		t.Fatalf("malformed: claimed %v, %v", ok, err)
	}
}
