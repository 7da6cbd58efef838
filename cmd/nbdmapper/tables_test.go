package main

import (
	"errors"
	"os"
	"path/filepath"
	"slices"
	"testing"

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
