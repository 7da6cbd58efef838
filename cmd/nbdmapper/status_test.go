package main

import (
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/nbdmapper/nbdmapper/backing"
	"github.com/nbdmapper/nbdmapper/discard"
	"github.com/nbdmapper/nbdmapper/flush"
	"github.com/nbdmapper/nbdmapper/internal/testing/sparse"
	"github.com/nbdmapper/nbdmapper/mapped"
	"github.com/nbdmapper/nbdmapper/nbdtarget"
	"github.com/nbdmapper/nbdmapper/table"
)

// `nbdmapper status` names a device whose sync failed, under every export
// that uses it, and nothing before the failure.
func TestStatusShowsFailedDevice(t *testing.T) {
	dir := t.TempDir()
	a := sparse.Create(t, filepath.Join(dir, "a.img"), 1<<20)
	b := sparse.Create(t, filepath.Join(dir, "b.img"), 1<<20)
	e := flush.New()
	faulty := make(map[string]*backing.Faulty)
	pool := &backing.Pool{Wrap: func(d backing.Device) backing.Device {
		faulty[d.Name()] = backing.NewFaulty(d)
		return e.Track(faulty[d.Name()])
	}}
	t.Cleanup(func() { pool.Close() })
	var exports []*nbdtarget.Export
	for _, x := range []struct{ name, text string }{
		{"both", "0 1024 linear " + a + " 0\n1024 1024 linear " + b + " 0\n"},
		{"good", "0 1024 linear " + a + " 1024\n"},
	} {
		tb, err := table.Parse(x.name+".table", strings.NewReader(x.text), pool)
		if err != nil {
			t.Fatal(err)
		}
		exports = append(exports, &nbdtarget.Export{Name: x.name, Dev: mapped.New(x.name, tb, e, discard.New())})
	}
	mux := http.NewServeMux()
	for path, h := range statusRoutes(func() []*nbdtarget.Export { return exports }, e, nil) {
		mux.Handle(path, h)
	}
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	addr := strings.TrimPrefix(srv.URL, "http://")
	status := func() string {
		t.Helper()
		out, err := cmd2(dir, "status", "--metrics", addr)
		if err != nil {
			t.Fatalf("nbdmapper status: %v", err)
		}
		return out
	}
	healthy := "both: 0 1024 linear \nboth: 1024 1024 linear \ngood: 0 1024 linear \n"
	if got := status(); got != healthy {
		t.Fatalf("before the failure:\n%q\nwant\n%q", got, healthy)
	}

	if err := exports[0].Dev.Write(make([]byte, 1<<20), 0, false); err != nil { // a and b
		t.Fatal(err)
	}
	faulty[b].FailSync(unix.EIO)
	if err := exports[0].Dev.Flush(); err == nil {
		t.Fatal("flush over a failing sync succeeded")
	}
	faulty[b].FailSync(nil)
	want := "both: 0 1024 linear \nboth: 1024 1024 linear \nboth: failed " + b + ": input/output error\ngood: 0 1024 linear \n"
	if got := status(); got != want {
		t.Fatalf("after the failure:\n%q\nwant\n%q", got, want)
	}
}
