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
	"github.com/nbdmapper/nbdmapper/internal/sparse"
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
