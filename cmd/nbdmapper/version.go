package main

import (
	"errors"
	"fmt"
	"io"
	"os"
	"runtime/debug"
)

// runVersion prints what the binary was built from, as the Go toolchain
// stamped it: the module's version, the VCS revision, its commit time and
// whether the tree had changes, and the Go version. A bug report with
// this output names the exact source.
func runVersion(args []string) error {
	fs := newFlagSet("version")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() != 0 {
		return errors.New("version takes no arguments")
	}
	bi, ok := debug.ReadBuildInfo()
	if !ok {
		return errors.New("no build information in this binary")
	}
	printVersion(os.Stdout, bi)
	return nil
}

// printVersion writes `nbdmapper VERSION`, then one `key: value` line per
// VCS setting the build recorded, then the Go version.
func printVersion(w io.Writer, bi *debug.BuildInfo) {
	fmt.Fprintf(w, "nbdmapper %s\n", bi.Main.Version)
	for _, key := range []string{"vcs.revision", "vcs.time", "vcs.modified"} {
		for _, s := range bi.Settings {
			if s.Key == key {
				fmt.Fprintf(w, "%s: %s\n", key[len("vcs."):], s.Value)
			}
		}
	}
	fmt.Fprintf(w, "go: %s\n", bi.GoVersion)
}
