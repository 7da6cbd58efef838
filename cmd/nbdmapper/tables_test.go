package main

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"

	"github.com/nbdmapper/nbdmapper/internal/testing/nbdtest"
	"github.com/nbdmapper/nbdmapper/internal/testing/sparse"
	"github.com/nbdmapper/nbdmapper/table"
)

func TestExportDefs(t *testing.T) {
	for _, tc := range []struct {
		name  string
		files []string // created in DIR; a trailing / makes a directory
		specs []string
		want  []table.Def // a relative File is in DIR
		err   error
	}{
		{
			name:  "sorted by export name, not file name",
			files: []string{"a.table", "a-b.table", "B.table"},
			want:  []table.Def{{Name: "B", File: "B.table"}, {Name: "a", File: "a.table"}, {Name: "a-b", File: "a-b.table"}},
		},
		{
			name:  "only regular NAME.table files",
			files: []string{"x.table", "README", "x.table.bak", ".table", "sub.table/", "sub.table/y.table"},
			want:  []table.Def{{Name: "x", File: "x.table"}},
		},
		{
			name:  "arguments first, then the directory",
			files: []string{"b.table"},
			specs: []string{"z=/srv/z.table"},
			want:  []table.Def{{Name: "z", File: "/srv/z.table"}, {Name: "b", File: "b.table"}},
		},
		{name: "no tables", files: []string{"README"}, err: errNoTables},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			for _, f := range tc.files {
				p := filepath.Join(dir, f)
				var err error
				if f[len(f)-1] == '/' {
					err = os.Mkdir(p, 0o755)
				} else {
					err = os.WriteFile(p, nil, 0o644)
				}
				if err != nil {
					t.Fatal(err)
				}
			}
			got, err := exportDefs(tc.specs, dir)
			if !errors.Is(err, tc.err) {
				t.Fatalf("err = %v, want %v", err, tc.err)
			}
			want := slices.Clone(tc.want)
			for i := range want {
				if want[i].File[0] != '/' {
					want[i].File = filepath.Join(dir, want[i].File)
				}
			}
			if !slices.Equal(got, want) {
				t.Fatalf("got %v\nwant %v", got, want)
			}
		})
	}
	if _, err := exportDefs([]string{"noequals"}, ""); err == nil {
		t.Error("a spec without NAME= was accepted")
	}
	if _, err := exportDefs(nil, filepath.Join(t.TempDir(), "missing")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("missing DIR: err = %v, want not exist", err)
	}
}

// TestTablesDirSIGHUP edits a served --tables directory and sends SIGHUP:
// added tables become exports (one stacking on another added with it, in
// either name order), removed ones stop being served unless a client still
// has them open or a remaining device stacks on them, devices made any
// other way are left alone, a bad new table is logged and the rest go on,
// and /status follows every change.
func TestTablesDirSIGHUP(t *testing.T) {
	nbdinfo := nbdtest.Tool(t, "nbdinfo")
	dir := t.TempDir()
	tables := filepath.Join(dir, "tables")
	if err := os.Mkdir(tables, 0o755); err != nil {
		t.Fatal(err)
	}
	for _, f := range []string{"a.img", "b.img", "c.img"} {
		sparse.Create(t, filepath.Join(dir, f), 1<<20)
	}
	writeFile(t, filepath.Join(tables, "a.table"), "0 2048 linear a.img 0\n")
	writeFile(t, filepath.Join(dir, "arg.table"), "0 2048 linear c.img 0\n")
	ctl := filepath.Join(dir, "control")
	s := serve(t, dir, "--control", ctl, "--tables", "tables", "arg=arg.table")
	lifecycle(t, ctl, "create", "made", filepath.Join(dir, "arg.table"))

	status := func() string {
		t.Helper()
		out, err := cmd2(dir, "status", "--metrics", s.metrics)
		if err != nil {
			t.Fatalf("nbdmapper status: %v", err)
		}
		return out
	}
	// hup sends SIGHUP and waits for the rescan's last log line.
	hup := func(last string) {
		t.Helper()
		before := strings.Count(s.Stderr(), last)
		s.Signal(syscall.SIGHUP)
		nbdtest.Until(t, "the rescan to log "+last, func() bool { return strings.Count(s.Stderr(), last) > before })
	}

	// "b" stacks on "z", which sorts after it; "bad" has a gap.
	writeFile(t, filepath.Join(tables, "b.table"), "0 2048 snapshot-origin /dev/mapper/z\n")
	writeFile(t, filepath.Join(tables, "z.table"), "0 2048 linear b.img 0\n")
	writeFile(t, filepath.Join(tables, "bad.table"), "0 8 zero\n16 8 zero\n")
	hup(`msg="SIGHUP: created" name=b`)
	if !strings.Contains(s.Stderr(), `msg="SIGHUP: not creating" name=bad`) {
		t.Errorf("the bad table's error was not logged:\n%s", s.Stderr())
	}
	if got, want := lifecycle(t, ctl, "ls"), "a\t(1048576 bytes)\narg\t(1048576 bytes)\nb\t(1048576 bytes)\nmade\t(1048576 bytes)\nz\t(1048576 bytes)\n"; got != want {
		t.Fatalf("ls after adding b and z:\n%s\nwant\n%s", got, want)
	}
	if out, err := exec.Command(nbdinfo, "--size", s.URI("b")).CombinedOutput(); err != nil || strings.TrimSpace(string(out)) != "1048576" {
		t.Fatalf("nbdinfo of the added export: %v %s", err, out)
	}
	if got := status(); !strings.Contains(got, "b: 0 2048 snapshot-origin") || !strings.Contains(got, "made: 0 2048 linear") {
		t.Errorf("status after adding b and z:\n%s", got)
	}

	// z cannot go while b stacks on it, nor a while a client has it open.
	os.Remove(filepath.Join(tables, "z.table"))
	os.Remove(filepath.Join(tables, "bad.table"))
	os.Remove(filepath.Join(tables, "a.table"))
	client := nbdtest.Nbdsh(t, "-u", s.URI("a"), "-c", "import sys; sys.stdin.read()")
	stdin, err := client.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := client.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { stdin.Close(); client.Wait() })
	nbdtest.Until(t, "the client to connect", func() bool { return strings.Contains(lifecycle(t, ctl, "info", "a"), "Open count:        1") })
	hup(`msg="SIGHUP: keeping" name=z`)
	if !strings.Contains(s.Stderr(), `msg="SIGHUP: keeping" name=a`) {
		t.Errorf("removing a, which a client has open, was not refused:\n%s", s.Stderr())
	}

	// Once b's file is gone too and the client has left, all three go;
	// arg and made stay.
	os.Remove(filepath.Join(tables, "b.table"))
	stdin.Close()
	client.Wait()
	hup(`msg="SIGHUP: removed" name=z`)
	if got, want := lifecycle(t, ctl, "ls"), "arg\t(1048576 bytes)\nmade\t(1048576 bytes)\n"; got != want {
		t.Fatalf("ls after removing a, b and z:\n%s\nwant\n%s", got, want)
	}
	if got, want := status(), "arg: 0 2048 linear \nmade: 0 2048 linear \n"; got != want {
		t.Errorf("status after removing a, b and z:\n%q\nwant\n%q", got, want)
	}
}

// A device of the tables directory that the operator removed and made
// again by hand under the same name is no longer the directory's: a rescan
// after its file is gone leaves it.
func TestTablesDirLeavesDeviceMadeByHand(t *testing.T) {
	dir := t.TempDir()
	tables := filepath.Join(dir, "tables")
	if err := os.Mkdir(tables, 0o755); err != nil {
		t.Fatal(err)
	}
	sparse.Create(t, filepath.Join(dir, "a.img"), 1<<20)
	writeFile(t, filepath.Join(tables, "a.table"), "0 2048 linear a.img 0\n")
	writeFile(t, filepath.Join(dir, "hand.table"), "0 1024 linear a.img 0\n")
	ctl := filepath.Join(dir, "control")
	s := serve(t, dir, "--control", ctl, "--tables", "tables")
	lifecycle(t, ctl, "remove", "a")
	lifecycle(t, ctl, "create", "a", filepath.Join(dir, "hand.table"))
	os.Remove(filepath.Join(tables, "a.table"))
	s.Signal(syscall.SIGHUP)
	nbdtest.Until(t, "the rescan to leave a", func() bool {
		return strings.Contains(s.Stderr(), `msg="SIGHUP: left alone, made by hand since" name=a`)
	})
	if got, want := lifecycle(t, ctl, "ls"), "a\t(524288 bytes)\n"; got != want {
		t.Fatalf("ls after the rescan: %q, want %q", got, want)
	}
}
