package table_test

import (
	"fmt"
	"log"
	"os"
	"path/filepath"
	"strings"

	"github.com/nbdmapper/nbdmapper/backing"
	"github.com/nbdmapper/nbdmapper/table"
)

// exampleDisks creates sparse files of 1 MiB each in a new directory.
func exampleDisks(names ...string) (dir string) {
	dir, err := os.MkdirTemp("", "table-example")
	if err != nil {
		log.Fatal(err)
	}
	for _, n := range names {
		if err := os.WriteFile(filepath.Join(dir, n), nil, 0o644); err != nil {
			log.Fatal(err)
		}
		if err := os.Truncate(filepath.Join(dir, n), 1<<20); err != nil {
			log.Fatal(err)
		}
	}
	return dir
}

// Parse a table over two files and map a byte range that crosses from a
// linear line into a striped one.
func ExampleParse() {
	dir := exampleDisks("a.img", "b.img")
	defer os.RemoveAll(dir)
	text := fmt.Sprintf(`# start length target args (512-byte sectors)
0    1024 linear  %[1]s/a.img 1024
1024 1024 striped 2 8 %[1]s/a.img 0 %[1]s/b.img 0
2048 2048 zero
`, dir)

	pool := &backing.Pool{} // opens each file once, however many lines name it
	defer pool.Close()
	t, err := table.Parse("example.table", strings.NewReader(text), pool)
	if err != nil {
		log.Fatal(err)
	}
	defer t.Close()
	fmt.Print(strings.ReplaceAll(t.String(), dir+"/", ""))
	fmt.Println("size", t.Size(), "bytes on", len(t.Devices()), "devices")
	for _, e := range t.Extents(512*1024-1024, 8192) {
		name := "-"
		if e.Dev != nil {
			name = filepath.Base(e.Dev.Name())
		}
		fmt.Printf("virtual %d+%d: %s %s @%d\n", e.VOff, e.Len, e.Kind, name, e.Off)
	}
	// Output:
	// 0 1024 linear a.img 1024
	// 1024 1024 striped 2 8 a.img 0 b.img 0
	// 2048 2048 zero
	// size 2097152 bytes on 2 devices
	// virtual 523264+1024: mapped a.img @1047552
	// virtual 524288+4096: mapped a.img @0
	// virtual 528384+3072: mapped b.img @0
}
