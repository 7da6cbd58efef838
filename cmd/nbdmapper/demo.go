package main

import (
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"syscall"

	"github.com/nbdmapper/nbdmapper/nbdtarget"
)

// Demo geometry: 64 linear segments of 1 MiB (2048 sectors), alternating
// between two sparse 128 MiB backing files and spaced 2 MiB apart on each, so
// the virtual device is 64 MiB scattered over two disks.
const (
	demoSegments   = 64
	demoSegSectors = 2048
	demoFileBytes  = 128 << 20
)

// makeDemo creates dir with two sparse backing files and a table over them
// (keeping any existing files and their data), and returns NAME=TABLE_FILE.
// A file that is there already is used as it is, grown to the demo's size
// if it is smaller, never shrunk; one that is not a regular file (a
// symlink, a device) is refused, so that the demo writes nothing outside
// dir.
func makeDemo(dir string) (string, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", err
	}
	disks := []string{filepath.Join(dir, "disk0.img"), filepath.Join(dir, "disk1.img")}
	for _, d := range disks {
		f, err := openDemoFile(d, os.O_RDWR)
		if err != nil {
			return "", err
		}
		fi, err := f.Stat()
		if err == nil && fi.Size() < demoFileBytes {
			err = f.Truncate(demoFileBytes)
		}
		f.Close()
		if err != nil {
			return "", err
		}
	}
	var b strings.Builder
	fmt.Fprintf(&b, "# nbdmapper demo: %d linear segments over two sparse files\n", demoSegments)
	for i := range demoSegments {
		start := i * demoSegSectors
		offset := (i / 2) * 2 * demoSegSectors
		fmt.Fprintf(&b, "%d %d linear %s %d\n", start, demoSegSectors, disks[i%2], offset)
	}
	path := filepath.Join(dir, "demo.table")
	f, err := openDemoFile(path, os.O_WRONLY|os.O_TRUNC)
	if err != nil {
		return "", err
	}
	_, err = f.WriteString(b.String())
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return "", err
	}
	return "demo=" + path, nil
}

// openDemoFile opens or creates the regular file path with flag, without
// following a symlink there.
func openDemoFile(path string, flag int) (*os.File, error) {
	f, err := os.OpenFile(path, flag|os.O_CREATE|syscall.O_NOFOLLOW, 0o644)
	if err != nil {
		if errors.Is(err, syscall.ELOOP) {
			return nil, fmt.Errorf("%s is a symlink: not following it (remove it, or give a table)", path)
		}
		return nil, err
	}
	if fi, err := f.Stat(); err != nil || !fi.Mode().IsRegular() {
		f.Close()
		return nil, fmt.Errorf("%s is not a regular file (remove it, or give a table)", path)
	}
	return f, nil
}

func printDemoHelp(w io.Writer, addr net.Addr, x *nbdtarget.Export, tableFile string) {
	uri := "nbd://" + addr.String() + "/" + x.Name
	host, port, _ := net.SplitHostPort(addr.String())
	if addr.Network() == "unix" {
		uri = "nbd+unix:///" + x.Name + "?socket=" + addr.String()
	}
	fmt.Fprintf(w, `
nbdmapper demo: export %q, %d MiB, %d segments over two sparse files (table: %s)

  nbdinfo %s
  fio --name=demo --ioengine=nbd --uri=%s --rw=randwrite --bs=4k --fsync=1 --size=16m
  nbd-client %s %s /dev/nbd0 -N %s      (as root, with the nbd module loaded)

Ctrl-C stops the server (in-flight requests finish, every backing file is synced).
`, x.Name, x.Size()>>20, len(x.Dev.Table().Lines), tableFile, uri, uri, host, port, x.Name)
}
