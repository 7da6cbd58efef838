package table

import (
	"bytes"
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/nbdmapper/nbdmapper/backing"
	"github.com/nbdmapper/nbdmapper/snapshot"
)

func snapDevices() memOpener {
	return memOpener{
		"origin": backing.NewMem("origin", 1<<20),
		"cow":    backing.NewMem("cow", 1<<20),
		"tiny":   backing.NewMem("tiny", 2048),
	}
}

func TestSnapshotParseErrors(t *testing.T) {
	cases := []struct {
		name, line string
		want       error
	}{
		{"too few args", "0 2048 snapshot origin cow P", ErrArgCount},
		{"bad type", "0 2048 snapshot origin cow X 8", snapshot.ErrStoreType},
		{"chunk not power of 2", "0 2048 snapshot origin cow P 12", snapshot.ErrChunkSize},
		{"N needs a chunk", "0 2048 snapshot origin cow N 0", snapshot.ErrChunkSize},
		{"chunk not a number", "0 2048 snapshot origin cow P x", ErrNumber},
		{"3 features", "0 2048 snapshot origin cow P 8 3 a b c", ErrSnapshot},
		{"feature count mismatch", "0 2048 snapshot origin cow P 8 2 discard_zeroes_cow", ErrArgCount},
		{"unknown feature", "0 2048 snapshot origin cow P 8 1 frobnicate", ErrSnapshot},
		{"passdown without zeroes", "0 2048 snapshot origin cow P 8 1 discard_passdown_origin", ErrSnapshot},
		{"cow is origin", "0 2048 snapshot origin origin P 8", snapshot.ErrSameDevice},
		{"beyond origin", "0 4096 snapshot origin cow P 8", ErrBeyondDevice},
		{"cow too small", "0 2048 snapshot origin tiny P 8", snapshot.ErrCOWSize},
		{"missing cow", "0 2048 snapshot origin nope P 8", ErrDevice},
		{"origin: args", "0 2048 snapshot-origin origin extra", ErrArgCount},
		{"origin: beyond", "0 4096 snapshot-origin origin", ErrBeyondDevice},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			tb, err := Parse("t", strings.NewReader(tc.line), snapDevices())
			if err == nil {
				tb.Close()
				t.Fatalf("Parse(%q) succeeded", tc.line)
			}
			if !errors.Is(err, tc.want) {
				t.Fatalf("Parse(%q): %v, want %v", tc.line, err, tc.want)
			}
		})
	}
}

// TestSnapshotRoundTrip: canonical output parses back to the same table,
// with the type spelled as dm prints it and features counted.
func TestSnapshotRoundTrip(t *testing.T) {
	cases := []struct{ in, want string }{
		{"0 2048 snapshot origin cow p 8", "0 2048 snapshot origin cow P 8\n"},
		{"0 2048 snapshot origin cow Po 16 1 DISCARD_ZEROES_COW", "0 2048 snapshot origin cow PO 16 1 discard_zeroes_cow\n"},
		{"0 2048 snapshot origin cow N 4 2 discard_passdown_origin discard_zeroes_cow", "0 2048 snapshot origin cow N 4 2 discard_zeroes_cow discard_passdown_origin\n"},
		{"0 2048 snapshot origin cow P 0", "0 2048 snapshot origin cow P 32\n"}, // dm's default chunk
		{"0 2048 snapshot-origin origin", "0 2048 snapshot-origin origin\n"},
	}
	for _, tc := range cases {
		t.Run(tc.in, func(t *testing.T) {
			devs := snapDevices()
			a, err := Parse("a", strings.NewReader(tc.in), devs)
			if err != nil {
				t.Fatal(err)
			}
			if got := a.String(); got != tc.want {
				t.Fatalf("String() = %q, want %q", got, tc.want)
			}
			a.Close() // frees the COW for the second parse
			b, err := Parse("b", strings.NewReader(a.String()), devs)
			if err != nil {
				t.Fatal(err)
			}
			defer b.Close()
			if d := sameTable(a, b); d != "" {
				t.Fatal(d)
			}
		})
	}
}

// writeFiles creates files in dir and returns a Def for each "name=text".
func setDefs(t *testing.T, specs ...string) []Def {
	var defs []Def
	for _, s := range specs {
		name, text, _ := strings.Cut(s, "=")
		defs = append(defs, Def{Name: name, File: name + ".table", Text: strings.NewReader(text)})
	}
	return defs
}

// stackStub stands in for a mapped device in tests that only parse a set:
// it has a name and a size, which is all parsing asks of a device.
type stackStub struct {
	backing.Device
	name string
	size int64
}

func (s stackStub) Name() string { return s.name }
func (s stackStub) Size() int64  { return s.size }

func stub(name string, t *Table) backing.Device {
	return stackStub{name: MapperPrefix + name, size: t.Size()}
}

func names(ds []backing.Device) []string {
	var s []string
	for _, d := range ds {
		s = append(s, d.Name())
	}
	return s
}

func TestParseSetErrors(t *testing.T) {
	cases := []struct {
		name  string
		specs []string
		want  error
		msg   string
	}{
		{"cycle", []string{
			"a=0 8 linear /dev/mapper/b 0",
			"b=0 8 linear /dev/mapper/c 0",
			"c=0 8 linear /dev/mapper/a 0",
		}, ErrCycle, "a -> b -> c -> a"},
		{"self", []string{"a=0 8 linear /dev/mapper/a 0"}, ErrCycle, "a -> a"},
		{"unknown", []string{"a=0 8 linear /dev/mapper/zz 0"}, ErrUnknownDevice, `"zz" (devices: a)`},
		{"duplicate", []string{"a=0 8 zero", "a=0 8 zero"}, ErrDuplicateName, ""},
		{"bad name", []string{"a/b=0 8 zero"}, ErrUnknownDevice, ""},
		{"error in dependency", []string{"a=0 8 linear /dev/mapper/b 0", "b=0 8 bogus"}, ErrUnknownTarget, "b.table:1"},
		{"beyond stacked device", []string{"a=0 16 linear /dev/mapper/b 0", "b=0 8 zero"}, ErrBeyondDevice, ""},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			_, err := ParseSet(setDefs(t, tc.specs...), memOpener{}, stub)
			if !errors.Is(err, tc.want) || !strings.Contains(fmt.Sprint(err), tc.msg) {
				t.Fatalf("ParseSet: %v, want %v containing %q", err, tc.want, tc.msg)
			}
		})
	}
}

// A table that fails on a later line, or a set that fails on a later
// table, releases the snapshots built before the failure: the COW device
// is free for the corrected table, and an origin write copies into no
// snapshot left behind (the kernel tears down a failed load the same way).
func TestFailedParseReleasesSnapshots(t *testing.T) {
	snap := "0 2048 snapshot origin cow P 8\n"
	cases := []struct{ name, bad string }{
		{"unknown target", snap + "2048 8 bogus\n"},
		{"bad device offset", snap + "2048 8 linear origin 99999999\n"},
		{"line too short", snap + "2048 8\n"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			devs := snapDevices()
			if tb, err := Parse("bad", strings.NewReader(tc.bad), devs); err == nil {
				tb.Close()
				t.Fatal("the bad table parsed")
			}
			checkSnapshotsReleased(t, devs, snap)
		})
	}
	t.Run("set", func(t *testing.T) {
		devs := snapDevices()
		defs := setDefs(t, "s="+snap, "z=0 8 linear /dev/mapper/s 4096")
		if _, err := ParseSet(defs, devs, stub); !errors.Is(err, ErrBeyondDevice) {
			t.Fatalf("ParseSet: %v, want %v", err, ErrBeyondDevice)
		}
		checkSnapshotsReleased(t, devs, snap)
	})
}

// checkSnapshotsReleased parses good (one snapshot of origin on cow) over
// devs, which must succeed and give a working snapshot, then closes it and
// checks that a write through a new origin target leaves cow's first
// metadata area empty: no snapshot is registered with the origin any more.
func checkSnapshotsReleased(t *testing.T, devs memOpener, good string) {
	t.Helper()
	tb, err := Parse("good", strings.NewReader(good), devs)
	if err != nil {
		t.Fatalf("the corrected table after the failed one: %v", err)
	}
	if _, err := tb.Lines[0].Target.(*snapshotTarget).s.ReadAt(make([]byte, 512), 0); err != nil {
		t.Fatalf("read through the corrected table's snapshot: %v", err)
	}
	if err := tb.Close(); err != nil {
		t.Fatal(err)
	}
	o, err := snapshot.NewOrigin("o", devs["origin"], 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := o.WriteAt(bytes.Repeat([]byte{0xaa}, 512), 0); err != nil {
		t.Fatal(err)
	}
	area := make([]byte, 16)
	if _, err := devs["cow"].ReadAt(area, 4096); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(area, make([]byte, 16)) {
		t.Fatalf("an origin write after every table was closed committed an exception to the COW: %x", area)
	}
}

// A snapshot or snapshot-origin line that does not start at 0 maps the
// origin's sectors unchanged, as dm does: virtual sector 8 of the table is
// the origin's sector 8, and a snapshot reads it there. The line must end
// inside the origin.
func TestSnapshotLinesKeepSectors(t *testing.T) {
	const sector8 = 8 * SectorSize
	for _, line := range []string{"8 2040 snapshot-origin origin", "8 2040 snapshot origin cow P 8"} {
		t.Run(strings.Fields(line)[2], func(t *testing.T) {
			devs := snapDevices()
			want := bytes.Repeat([]byte{0x5a}, SectorSize)
			mustWriteMem(t, devs["origin"], want, sector8)
			tb, err := Parse("t", strings.NewReader("0 8 zero\n"+line+"\n"), devs)
			if err != nil {
				t.Fatal(err)
			}
			defer tb.Close()
			es := tb.Extents(sector8, SectorSize)
			if len(es) != 1 || es[0].Off != sector8 || es[0].VOff != sector8 {
				t.Fatalf("virtual sector 8 maps to %+v, want the origin's sector 8", es)
			}
			got := make([]byte, SectorSize)
			if _, err := es[0].Dev.ReadAt(got, es[0].Off); err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(got, want) {
				t.Fatalf("virtual sector 8 reads %x..., want the origin's sector 8, %x...", got[:4], want[:4])
			}
		})
	}
	for _, line := range []string{"8 2048 snapshot-origin origin", "8 2048 snapshot origin cow P 8"} {
		if tb, err := Parse("t", strings.NewReader("0 8 zero\n"+line+"\n"), snapDevices()); !errors.Is(err, ErrBeyondDevice) {
			if err == nil {
				tb.Close()
			}
			t.Errorf("%q past the origin's end: %v, want %v", line, err, ErrBeyondDevice)
		}
	}
}

func mustWriteMem(t *testing.T, d backing.Device, p []byte, off int64) {
	t.Helper()
	if _, err := d.WriteAt(p, off); err != nil {
		t.Fatal(err)
	}
}
