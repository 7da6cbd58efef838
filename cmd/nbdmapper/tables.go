package main

import (
	"cmp"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/nbdmapper/nbdmapper/table"
)

// tableExt is the suffix that makes a file in --tables DIR an export.
const tableExt = ".table"

// exportDefs lists the exports serve was asked for: the NAME=TABLE_FILE
// arguments in their order, then, when dir is not "", every NAME.table in
// dir as export NAME, sorted by name. Other files and directories in dir
// are ignored. Stacked tables may name each other as /dev/mapper/NAME in
// either form; table.ParseSet loads them in dependency order, and rejects
// a name given twice.
//
// The set is read once at start-up: picking up added and removed files on
// SIGHUP needs a way to add and remove exports from a running server,
// which does not exist yet (see docs/systemd.md).
func exportDefs(specs []string, dir string) ([]table.Def, error) {
	defs := make([]table.Def, 0, len(specs))
	for _, spec := range specs {
		name, file, ok := strings.Cut(spec, "=")
		if !ok || name == "" || file == "" {
			return nil, fmt.Errorf("export %q: want NAME=TABLE_FILE", spec)
		}
		defs = append(defs, table.Def{Name: name, File: file})
	}
	if dir == "" {
		return defs, nil
	}
	found, err := dirDefs(dir)
	if err != nil {
		return nil, err
	}
	return append(defs, found...), nil
}

// dirDefs finds the NAME.table files in dir, sorted by NAME (not by file
// name: "a-b.table" sorts before "a.table", but "a" before "a-b").
func dirDefs(dir string) ([]table.Def, error) {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return nil, fmt.Errorf("--tables: %w", err)
	}
	var defs []table.Def
	for _, e := range entries {
		name, ok := strings.CutSuffix(e.Name(), tableExt)
		if !ok || name == "" {
			continue
		}
		file := filepath.Join(dir, e.Name())
		st, err := os.Stat(file) // follows symlinks, as Parse will
		if err != nil {
			return nil, fmt.Errorf("--tables: %w", err)
		}
		if !st.Mode().IsRegular() {
			continue
		}
		defs = append(defs, table.Def{Name: name, File: file})
	}
	if len(defs) == 0 {
		return nil, fmt.Errorf("--tables %s: %w", dir, errNoTables)
	}
	slices.SortFunc(defs, func(a, b table.Def) int { return cmp.Compare(a.Name, b.Name) })
	return defs, nil
}

var errNoTables = errors.New("no NAME" + tableExt + " files")
