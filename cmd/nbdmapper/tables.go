package main

import (
	"cmp"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/nbdmapper/nbdmapper/control"
	"github.com/nbdmapper/nbdmapper/mapped"
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
// SIGHUP rescans dir (tablesDir.rescan).
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
// name: "a-b.table" sorts before "a.table", but "a" before "a-b"); a
// directory without any is an error at start-up.
func dirDefs(dir string) ([]table.Def, error) {
	defs, err := listDefs(dir)
	if err == nil && len(defs) == 0 {
		err = fmt.Errorf("--tables %s: %w", dir, errNoTables)
	}
	return defs, err
}

// listDefs is dirDefs without the error for an empty directory.
func listDefs(dir string) ([]table.Def, error) {
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
	slices.SortFunc(defs, func(a, b table.Def) int { return cmp.Compare(a.Name, b.Name) })
	return defs, nil
}

var errNoTables = errors.New("no NAME" + tableExt + " files")

// tablesDir is a --tables directory being served. It remembers which of
// the server's devices came from the directory, so that a rescan creates
// a device for each NAME.table that appeared and removes the devices whose
// file is gone, and leaves alone the devices made any other way (NAME=FILE
// arguments, nbdmapper create). A file that changed is not reloaded: that
// is `nbdmapper reload` and `resume`, which suspend the device.
type tablesDir struct {
	dir  string
	ctl  *control.Server
	log  *slog.Logger
	mine map[string]made // by device name
}

// made is a device the directory made, and the file it came from. The
// device is kept, not only its name: one removed and made again under the
// same name by hand is no longer the directory's.
type made struct {
	file string
	dev  *mapped.Device
}

func newTablesDir(dir string, defs []table.Def, ctl *control.Server, log *slog.Logger) *tablesDir {
	td := &tablesDir{dir: dir, ctl: ctl, log: log, mine: make(map[string]made)}
	for _, d := range defs {
		if filepath.Dir(d.File) == filepath.Clean(dir) {
			td.mine[d.Name] = made{d.File, ctl.Device(d.Name)}
		}
	}
	return td
}

// rescan brings the devices from the directory in line with its files:
// new ones are created in the order their stacking needs, gone ones are
// removed unless clients still use them or other devices stack on them
// (they stay, and a later rescan tries again). Every outcome is logged.
func (td *tablesDir) rescan() {
	defs, err := listDefs(td.dir)
	if err != nil {
		td.log.Error("SIGHUP: not rescanning the tables directory", "err", err)
		return
	}
	want := make(map[string]bool, len(defs))
	var added []table.Def
	for _, d := range defs {
		want[d.Name] = true
		if _, ok := td.mine[d.Name]; !ok {
			added = append(added, d)
		}
	}
	var gone []table.Def
	for name, m := range td.mine {
		if !want[name] {
			gone = append(gone, table.Def{Name: name, File: m.file})
		}
	}
	slices.SortFunc(gone, func(a, b table.Def) int { return cmp.Compare(a.Name, b.Name) })

	// A new table may stack on another new one, and a gone device may be
	// stacked on by another gone one: go round until nothing more can be
	// done, so that the order of names does not matter.
	td.passes(added, control.ErrNoDevice, func(d table.Def) error {
		_, err := td.ctl.Do(control.Request{Op: "create", Name: d.Name, File: d.File})
		if err == nil {
			td.mine[d.Name] = made{d.File, td.ctl.Device(d.Name)}
			td.log.Info("SIGHUP: created", "name", d.Name, "table", d.File)
		}
		return err
	}, "SIGHUP: not creating")
	td.passes(gone, control.ErrInUse, func(d table.Def) error {
		if now := td.ctl.Device(d.Name); now != td.mine[d.Name].dev {
			// Removed by hand (nbdmapper remove), and maybe made again
			// the same way: not the directory's to remove.
			delete(td.mine, d.Name)
			if now != nil {
				td.log.Info("SIGHUP: left alone, made by hand since", "name", d.Name, "table", d.File)
			}
			return nil
		}
		_, err := td.ctl.Do(control.Request{Op: "remove", Name: d.Name})
		if err == nil || errors.Is(err, control.ErrNoDevice) {
			delete(td.mine, d.Name) // removed, or by nbdmapper remove already
			td.log.Info("SIGHUP: removed", "name", d.Name, "table", d.File)
			return nil
		}
		return err
	}, "SIGHUP: keeping")
}

// passes applies fn to every def, again and again while some succeed, to
// those that failed with retry (waiting on another def); then it logs the
// defs that still fail, with their last error.
func (td *tablesDir) passes(defs []table.Def, retry error, fn func(table.Def) error, failMsg string) {
	errs := make(map[string]error)
	for len(defs) > 0 {
		var again []table.Def
		for _, d := range defs {
			err := fn(d)
			errs[d.Name] = err
			if err != nil && errors.Is(err, retry) {
				again = append(again, d)
			} else if err != nil {
				td.log.Error(failMsg, "name", d.Name, "table", d.File, "err", err)
			}
		}
		if len(again) == len(defs) {
			break // no progress
		}
		defs = again
	}
	for _, d := range defs {
		if err := errs[d.Name]; err != nil && errors.Is(err, retry) {
			td.log.Error(failMsg, "name", d.Name, "table", d.File, "err", err)
		}
	}
}
