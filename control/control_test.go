package control_test

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/nbdmapper/nbdmapper/backing"
	"github.com/nbdmapper/nbdmapper/control"
	"github.com/nbdmapper/nbdmapper/discard"
	"github.com/nbdmapper/nbdmapper/flush"
	"github.com/nbdmapper/nbdmapper/internal/testing/sparse"
	"github.com/nbdmapper/nbdmapper/mapped"
	"github.com/nbdmapper/nbdmapper/table"
)

// rig serves base and top (stacked on base) over a real file through a
// control socket.
func rig(t *testing.T) (sock, dir string, devs map[string]*mapped.Device) {
	dir = t.TempDir()
	disk := sparse.Create(t, filepath.Join(dir, "disk.img"), 1<<20)
	pool := &backing.Pool{}
	t.Cleanup(func() { pool.Close() })
	f, d := flush.New(), discard.New()
	mds, err := table.ParseSet([]table.Def{
		{Name: "base", File: "base.table", Text: strings.NewReader("0 2048 linear " + disk + " 0\n")},
		{Name: "top", File: "top.table", Text: strings.NewReader("0 1024 linear /dev/mapper/base 0\n")},
	}, pool, func(name string, t *table.Table) *mapped.Device { return mapped.New(name, t, f, d) })
	if err != nil {
		t.Fatal(err)
	}
	devs = map[string]*mapped.Device{"base": mds[0], "top": mds[1]}
	sock = filepath.Join(dir, "control")
	l, err := control.Listen(sock)
	if err != nil {
		t.Fatal(err)
	}
	if fi, err := os.Stat(sock); err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("control socket mode %v, %v; want 0600", fi.Mode().Perm(), err)
	}
	srv := &control.Server{Devices: devs, Open: pool}
	done := make(chan error, 1)
	go func() { done <- srv.Serve(l) }()
	t.Cleanup(func() {
		l.Close()
		if err := <-done; err != nil {
			t.Errorf("Serve: %v", err)
		}
	})
	return sock, dir, devs
}

func TestRefusals(t *testing.T) {
	sock, dir, devs := rig(t)
	write := func(name, text string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(text), 0o644); err != nil {
			t.Fatal(err)
		}
		return p
	}
	for _, tc := range []struct {
		name string
		req  control.Request
		want string
	}{
		{"unknown device", control.Request{Op: "suspend", Name: "nope"}, control.ErrNoDevice.Error()},
		{"unknown command", control.Request{Op: "frobnicate", Name: "base"}, control.ErrUnknownOp.Error()},
		{"no messages", control.Request{Op: "message", Name: "base", Args: []string{"0", "hello"}}, control.ErrNoMessages.Error()},
		{"self", control.Request{Op: "reload", Name: "base", File: write("self.table", "0 8 linear /dev/mapper/base 0\n")}, control.ErrStacked.Error()},
		{"through a device above", control.Request{Op: "reload", Name: "base", File: write("loop.table", "0 8 linear /dev/mapper/top 0\n")}, control.ErrStacked.Error()},
		{"bad table names file and line", control.Request{Op: "reload", Name: "base", File: write("bad.table", "0 8 zero\n16 8 zero\n")}, "bad.table:2"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := control.Call(sock, tc.req)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("%+v: %v, want an error containing %q", tc.req, err, tc.want)
			}
		})
	}
	// Nothing was loaded by the refused reloads.
	if devs["base"].InactiveTable() != nil {
		t.Fatal("a refused reload left an inactive table")
	}
	out, err := control.Call(sock, control.Request{Op: "ls"})
	if err != nil || out != "base\t(1048576 bytes)\ntop\t(524288 bytes)\n" {
		t.Fatalf("ls: %q %v", out, err)
	}
	if _, err := control.Call(filepath.Join(dir, "none"), control.Request{Op: "ls"}); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("no socket: %v", err)
	}
}
