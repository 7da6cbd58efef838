package table

import (
	"errors"
	"fmt"
	"io/fs"
	"slices"
	"strings"
	"testing"

	"github.com/nbdmapper/nbdmapper/backing"
)

// memOpener is the tests' Opener: a fixed set of in-memory devices by name,
// and fs.ErrNotExist for anything else, as a *backing.Pool would say for a
// missing path.
type memOpener map[string]backing.Device

func (o memOpener) Open(name string) (backing.Device, error) {
	if d, ok := o[name]; ok {
		return d, nil
	}
	return nil, fmt.Errorf("open %s: %w", name, fs.ErrNotExist)
}

// testDevices returns the devices the test tables use. Sizes are in bytes;
// "odd" is not a whole number of sectors (8 sectors and one byte).
func testDevices() memOpener {
	o := memOpener{}
	for _, d := range []struct {
		name string
		size int64
	}{
		{"a", 1 << 20},    // 2048 sectors
		{"b", 1 << 20},    // 2048 sectors
		{"8:16", 2 << 20}, // 4096 sectors
		{"/dev/vg/disk#2", 64 * SectorSize},
		{"odd", 8*SectorSize + 1},
	} {
		o[d.name] = backing.NewMem(d.name, d.size)
	}
	return o
}

// devName names a device for golden output.
func devName(d backing.Device) string {
	if d == nil {
		return "-"
	}
	return d.Name()
}

// sameTable reports how two tables differ, or "" if they are equal: same
// lines, target types, canonical arguments, status and devices.
func sameTable(a, b *Table) string {
	if a.Size() != b.Size() {
		return fmt.Sprintf("size %d != %d", a.Size(), b.Size())
	}
	if len(a.Lines) != len(b.Lines) {
		return fmt.Sprintf("%d lines != %d", len(a.Lines), len(b.Lines))
	}
	for i := range a.Lines {
		x, y := a.Lines[i], b.Lines[i]
		switch {
		case x.Start != y.Start || x.Length != y.Length:
			return fmt.Sprintf("line %d: %d+%d != %d+%d", i+1, x.Start, x.Length, y.Start, y.Length)
		case x.Target.Type() != y.Target.Type():
			return fmt.Sprintf("line %d: type %s != %s", i+1, x.Target.Type(), y.Target.Type())
		case !slices.Equal(x.Target.Args(), y.Target.Args()):
			return fmt.Sprintf("line %d: args %q != %q", i+1, x.Target.Args(), y.Target.Args())
		case x.Target.Status() != y.Target.Status():
			return fmt.Sprintf("line %d: status %q != %q", i+1, x.Target.Status(), y.Target.Status())
		case !slices.Equal(x.Target.Devices(), y.Target.Devices()):
			return fmt.Sprintf("line %d: devices differ", i+1)
		}
	}
	return ""
}

// mustParse parses text or fails the test.
func mustParse(t testing.TB, text string, o Opener) *Table {
	t.Helper()
	tb, err := Parse("test.table", strings.NewReader(text), o)
	if err != nil {
		t.Fatal(err)
	}
	return tb
}

// asError checks that err is a *Error and returns it.
func asError(t *testing.T, err error) *Error {
	t.Helper()
	var e *Error
	if !errors.As(err, &e) {
		t.Fatalf("error %v (%T) is not a *table.Error", err, err)
	}
	return e
}
