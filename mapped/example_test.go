package mapped_test

import (
	"fmt"
	"log"
	"os"
	"path/filepath"
	"strings"

	"github.com/nbdmapper/nbdmapper/backing"
	"github.com/nbdmapper/nbdmapper/discard"
	"github.com/nbdmapper/nbdmapper/flush"
	"github.com/nbdmapper/nbdmapper/mapped"
	"github.com/nbdmapper/nbdmapper/table"
)

// exampleDisk creates a sparse file of 1 MiB in a new directory.
func exampleDisk(name string) (dir string) {
	dir, err := os.MkdirTemp("", "mapped-example")
	if err != nil {
		log.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, name), nil, 0o644); err != nil {
		log.Fatal(err)
	}
	if err := os.Truncate(filepath.Join(dir, name), 1<<20); err != nil {
		log.Fatal(err)
	}
	return dir
}

// Stack one device on another through /dev/mapper/NAME, and write through
// the top device: the bytes land in the file under the bottom table, through
// the same mapping code a client's write takes.
func Example_stacking() {
	dir := exampleDisk("disk.img")
	defer os.RemoveAll(dir)
	pool := &backing.Pool{}
	defer pool.Close()
	flusher, discarder := flush.New(), discard.New()
	devs, err := table.ParseSet([]table.Def{
		{Name: "top", File: "top.table", Text: strings.NewReader("0 8 linear /dev/mapper/base 16\n")},
		{Name: "base", File: "base.table", Text: strings.NewReader("0 1024 linear " + dir + "/disk.img 100\n")},
	}, pool, func(name string, t *table.Table) *mapped.Device {
		return mapped.New(name, t, flusher, discarder)
	})
	if err != nil {
		log.Fatal(err)
	}
	top := devs[0]
	if err := top.Write([]byte("stacked"), 0, false); err != nil {
		log.Fatal(err)
	}
	for _, d := range devs {
		d.Close()
	}
	b, err := os.ReadFile(filepath.Join(dir, "disk.img"))
	if err != nil {
		log.Fatal(err)
	}
	off := (100 + 16) * table.SectorSize // base's offset plus top's
	fmt.Printf("top is %d bytes; disk.img at %d: %q\n", top.Size(), off, b[off:off+7])
	// Output:
	// top is 4096 bytes; disk.img at 59392: "stacked"
}
