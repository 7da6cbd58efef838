package table

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/nbdmapper/nbdmapper/backing"
	"github.com/nbdmapper/nbdmapper/internal/testing/sparse"
)

// TestParseWithPool parses a table over real sparse files through a
// *backing.Pool: two paths to one file (a symlink) become one device, and a
// missing path is an ErrDevice that wraps the pool's fs.ErrNotExist.
func TestParseWithPool(t *testing.T) {
	dir := t.TempDir()
	for _, name := range []string{"d0", "d1"} {
		sparse.Create(t, filepath.Join(dir, name), 1<<20)
	}
	d0, d1, link := filepath.Join(dir, "d0"), filepath.Join(dir, "d1"), filepath.Join(dir, "link")
	if err := os.Symlink(d0, link); err != nil {
		t.Fatal(err)
	}
	pool := &backing.Pool{}
	defer pool.Close()
	text := fmt.Sprintf("0 8 linear %s 0\n8 8 linear %s 8\n16 32 striped 2 8 %s 16 %s 16\n", d0, link, d0, d1)
	tb := mustParse(t, text, pool)
	if got := len(tb.Devices()); got != 2 {
		t.Errorf("Devices: %d, want 2 (d0 through two paths, d1)", got)
	}
	if got := strings.Fields(tb.String())[8]; got != link {
		t.Errorf("String keeps the path as given: got %q, want %q", got, link)
	}
	if d := sameTable(tb, mustParse(t, tb.String(), pool)); d != "" {
		t.Errorf("round trip: %s", d)
	}

	_, err := Parse("p.table", strings.NewReader(text+"48 8 linear "+filepath.Join(dir, "missing")+" 0\n"), pool)
	if e := asError(t, err); e.Line != 4 || !errors.Is(err, ErrDevice) || !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("missing file: %v, want p.table:4, ErrDevice wrapping fs.ErrNotExist", err)
	}
	_, err = Parse("p.table", strings.NewReader(fmt.Sprintf("0 2042 linear %s 7\n", d1)), pool)
	if e := asError(t, err); e.Line != 1 || !errors.Is(err, ErrBeyondDevice) {
		t.Errorf("past the end of a file: %v, want p.table:1 and ErrBeyondDevice", err)
	}
}

// TestTablesReleaseDevices: a table holds the devices it names while it is
// open, through the pool; closing it, or failing to parse it, releases
// them, and the pool closes a device once no table holds it. Stacked
// devices of a set are the set's, not the pool's.
func TestTablesReleaseDevices(t *testing.T) {
	dir := t.TempDir()
	for _, name := range []string{"d0", "d1", "d2"} {
		sparse.Create(t, filepath.Join(dir, name), 1<<20)
	}
	d0, d1, d2 := filepath.Join(dir, "d0"), filepath.Join(dir, "d1"), filepath.Join(dir, "d2")
	pool := &backing.Pool{}
	defer pool.Close()
	open := func() []string {
		var names []string
		for _, d := range pool.Devices() {
			names = append(names, filepath.Base(d.Name()))
		}
		return names
	}
	a := mustParse(t, fmt.Sprintf("0 8 linear %s 0\n8 16 striped 2 8 %s 0 %s 8\n", d0, d0, d1), pool)
	b := mustParse(t, fmt.Sprintf("0 8 linear %s 0\n", d1), pool)
	if _, err := Parse("bad.table", strings.NewReader(fmt.Sprintf("0 8 linear %s 0\n8 8 bogus\n", d2)), pool); err == nil {
		t.Fatal("a bad table parsed")
	}
	if got := strings.Join(open(), " "); got != "d0 d1" {
		t.Fatalf("open with a and b, after a failed parse that named d2: %s, want d0 d1", got)
	}
	if err := a.Close(); err != nil {
		t.Fatal(err)
	}
	if got := strings.Join(open(), " "); got != "d1" {
		t.Fatalf("open after closing a: %s, want d1 (b holds it)", got)
	}
	if err := b.Close(); err != nil {
		t.Fatal(err)
	}
	if got := open(); len(got) != 0 {
		t.Fatalf("open after closing both: %v, want none", got)
	}

	// A set: "top" stacks on "base"; both tables name d2.
	defs := []Def{
		{Name: "top", File: "top.table", Text: strings.NewReader(fmt.Sprintf("0 8 linear /dev/mapper/base 0\n8 8 linear %s 0\n", d2))},
		{Name: "base", File: "base.table", Text: strings.NewReader(fmt.Sprintf("0 8 linear %s 8\n", d2))},
	}
	tables := map[string]*Table{}
	devs, err := ParseSet(defs, pool, func(name string, t *Table) backing.Device {
		tables[name] = t
		return backing.NewMem("/dev/mapper/"+name, t.Size())
	})
	if err != nil || len(devs) != 2 {
		t.Fatalf("ParseSet: %v", err)
	}
	if err := tables["top"].Close(); err != nil {
		t.Fatalf("closing the stacked table: %v", err)
	}
	if got := strings.Join(open(), " "); got != "d2" {
		t.Fatalf("open after closing top: %s, want d2 (base holds it)", got)
	}
	tables["base"].Close()
	if got := open(); len(got) != 0 {
		t.Fatalf("open after closing both of the set: %v, want none", got)
	}
}
