package remote

import (
	"errors"
	"path/filepath"
	"strings"
	"testing"
)

func TestParseURI(t *testing.T) {
	abs, _ := filepath.Abs("rel.sock")
	certs, _ := filepath.Abs("certs")
	for _, tc := range []struct {
		name, in string
		want     URI    // fields checked: all
		norm     string // String()
	}{
		{"tcp default port and export", "nbd://example.com",
			URI{Host: "example.com", Port: "10809", TLSVerifyPeer: true}, "nbd://example.com:10809/"},
		{"tcp port and export", "nbd://Host.Example:2000/disk1",
			URI{Host: "host.example", Port: "2000", Export: "disk1", TLSVerifyPeer: true}, "nbd://host.example:2000/disk1"},
		{"upper-case scheme", "NBD://h/e", URI{Host: "h", Port: "10809", Export: "e", TLSVerifyPeer: true}, "nbd://h:10809/e"},
		{"empty host is localhost", "nbd:///e", URI{Host: "localhost", Port: "10809", Export: "e", TLSVerifyPeer: true}, "nbd://localhost:10809/e"},
		{"ipv6", "nbd://[::1]:10810/e", URI{Host: "::1", Port: "10810", Export: "e", TLSVerifyPeer: true}, "nbd://[::1]:10810/e"},
		{"leading zeros in port", "nbd://h:010809/e", URI{Host: "h", Port: "10809", Export: "e", TLSVerifyPeer: true}, "nbd://h:10809/e"},
		{"escaped export", "nbd://h/a%20b%2Fc", URI{Host: "h", Port: "10809", Export: "a b/c", TLSVerifyPeer: true}, "nbd://h:10809/a%20b/c"},
		{"export with slashes", "nbd://h/a/b", URI{Host: "h", Port: "10809", Export: "a/b", TLSVerifyPeer: true}, "nbd://h:10809/a/b"},
		{"unix", "nbd+unix:///e?socket=/run/nbd.sock",
			URI{Unix: true, Export: "e", Socket: "/run/nbd.sock", TLSVerifyPeer: true}, "nbd+unix:///e?socket=/run/nbd.sock"},
		{"unix default export", "nbd+unix:///?socket=/s",
			URI{Unix: true, Socket: "/s", TLSVerifyPeer: true}, "nbd+unix:///?socket=/s"},
		{"unix relative socket", "nbd+unix:///e?socket=rel.sock",
			URI{Unix: true, Export: "e", Socket: "rel.sock", TLSVerifyPeer: true}, "nbd+unix:///e?socket=" + abs},
		{"tls", "nbds://h/e?tls-certificates=certs",
			URI{TLS: true, Host: "h", Port: "10809", Export: "e", TLSCertificates: "certs", TLSVerifyPeer: true},
			"nbds://h:10809/e?tls-certificates=" + certs},
		{"tls unix, sorted query", "nbds+unix:///e?tls-verify-peer=false&socket=/s&tls-hostname=srv",
			URI{TLS: true, Unix: true, Export: "e", Socket: "/s", TLSHostname: "srv"},
			"nbds+unix:///e?socket=/s&tls-hostname=srv&tls-verify-peer=false"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if !IsURI(tc.in) {
				t.Fatalf("IsURI(%q) = false", tc.in)
			}
			u, err := ParseURI(tc.in)
			if err != nil {
				t.Fatal(err)
			}
			if u != tc.want {
				t.Errorf("ParseURI(%q) = %+v, want %+v", tc.in, u, tc.want)
			}
			if got := u.String(); got != tc.norm {
				t.Errorf("String() = %q, want %q", got, tc.norm)
			}
			// The normal form parses to the same export, and is its own
			// normal form.
			again, err := ParseURI(u.String())
			if err != nil {
				t.Fatal(err)
			}
			if again.String() != u.String() || again.Export != u.Export || again.Addr() != absOr(u) {
				t.Errorf("round trip: %+v from %q", again, u.String())
			}
		})
	}
}

func absOr(u URI) string {
	if u.Unix {
		return absPath(u.Socket)
	}
	return u.Addr()
}

func TestParseURIErrors(t *testing.T) {
	for _, tc := range []struct{ in, why string }{
		{"nbd+vsock:///", "vsock"},
		{"nbd+tcp://h/e", "unknown scheme"},
		{"nbd://alice@h/e", "TLS-PSK"},
		{"nbd://h/e#frag", "fragment"},
		{"nbd://h:0/e", "port"},
		{"nbd://h:70000/e", "port"},
		{"nbd://h:x/e", "port"},
		{"nbd://h:/e", "port"},
		{"nbd://h/e?socket=/s", "socket= is for"},
		{"nbd+unix:///e", "no socket"},
		{"nbd+unix:///e?socket=", "empty socket"},
		{"nbd+unix://host/e?socket=/s", "no host"},
		{"nbd://h/e?tls-certificates=/c", "needs nbds"},
		{"nbds://h/e?tls-psk-file=/k", "TLS-PSK"},
		{"nbds://h/e?tls-verify-peer=maybe", "tls-verify-peer"},
		{"nbd://h/e?frobnicate=1", "unknown parameter"},
		{"nbd+unix:///e?socket=/a&socket=/b", "2 times"},
		{"nbd://h/" + strings.Repeat("x", 4097), "4096"},
	} {
		t.Run(tc.in[:min(len(tc.in), 40)], func(t *testing.T) {
			_, err := ParseURI(tc.in)
			if !errors.Is(err, ErrURI) || !strings.Contains(err.Error(), tc.why) {
				t.Fatalf("ParseURI(%q) = %v, want ErrURI about %q", tc.in, err, tc.why)
			}
		})
	}
	for _, path := range []string{"disk.img", "/dev/sda", "7:0", "/dev/mapper/x", "dir/nbd://x", "nbdx/y"} {
		if IsURI(path) {
			t.Errorf("IsURI(%q) = true", path)
		}
	}
}
