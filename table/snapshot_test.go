package table

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
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

// TestParseSet stacks a snapshot and a snapshot-origin on a striped-and-
// linear base device of the same set, listed in the "wrong" order, and
// checks copy-on-write through the stack, the status lines, and that the
// flush devices are the real ones.
func TestParseSet(t *testing.T) {
	disk := backing.NewMem("disk", 4<<20)
	cow := backing.NewMem("cow", 4<<20)
	devs := memOpener{"disk": disk, "cow": cow}
	var base strings.Builder
	for i := 0; i < 64; i++ { // 64 segments of 32 sectors, reversed on disk
		fmt.Fprintf(&base, "%d 32 linear disk %d\n", i*32, (63-i)*32)
	}
	tables, err := ParseSet(setDefs(t,
		"snap=0 2048 snapshot /dev/mapper/base cow P 8",
		"orig=0 2048 snapshot-origin /dev/mapper/base",
		"base="+base.String(),
	), devs)
	if err != nil {
		t.Fatal(err)
	}
	snap, orig, baseT := tables[0], tables[1], tables[2]
	defer snap.Close()
	if len(baseT.Lines) != 64 {
		t.Fatalf("base has %d lines", len(baseT.Lines))
	}
	snapDev := NewDevice("snap", snap)
	origDev := NewDevice("orig", orig)
	before := make([]byte, 1<<20)
	for i := range before {
		before[i] = byte(i * 7)
	}
	if _, err := origDev.WriteAt(before, 0); err != nil {
		t.Fatal(err)
	}
	// That write copied every chunk out: the snapshot still reads zeros.
	got := make([]byte, 1<<20)
	snapDev.ReadAt(got, 0)
	if !bytes.Equal(got, make([]byte, 1<<20)) {
		t.Fatal("snapshot changed by an origin write")
	}
	if _, err := snapDev.WriteAt([]byte("snapshot only"), 4096*3+1); err != nil {
		t.Fatal(err)
	}
	origDev.ReadAt(got, 0)
	if !bytes.Equal(got, before) {
		t.Fatal("origin changed by a snapshot write")
	}
	// 256 chunks copied out: next free 2+256 = 258, 8 sectors each; area 0
	// (256 entries) is full, so area 1 is current.
	if got, want := snap.Status(), "0 2048 snapshot 2072/8192 24\n"; got != want {
		t.Fatalf("status %q, want %q", got, want)
	}
	if got, want := orig.Status(), "0 2048 snapshot-origin \n"; got != want {
		t.Fatalf("origin status %q, want %q", got, want)
	}
	if got, want := snap.String(), "0 2048 snapshot /dev/mapper/base cow P 8\n"; got != want {
		t.Fatalf("table %q, want %q", got, want)
	}
	// Flushes go to the real devices, each once.
	if d := snap.Devices(); len(d) != 2 || d[0] != cow || d[1] != disk {
		t.Fatalf("snapshot devices %v", names(d))
	}
	if d := orig.Devices(); len(d) != 1 || d[0] != disk {
		t.Fatalf("origin devices %v", names(d))
	}
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
			_, err := ParseSet(setDefs(t, tc.specs...), memOpener{})
			if !errors.Is(err, tc.want) || !strings.Contains(fmt.Sprint(err), tc.msg) {
				t.Fatalf("ParseSet: %v, want %v containing %q", err, tc.want, tc.msg)
			}
		})
	}
}

// TestParseSetFiles reads the tables from files through a real
// backing.Pool, as the serve command does.
func TestParseSetFiles(t *testing.T) {
	dir := t.TempDir()
	write := func(name, text string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(text), 0o644); err != nil {
			t.Fatal(err)
		}
		return p
	}
	disk := write("disk.img", strings.Repeat("d", 1<<20))
	cow := write("cow.img", string(make([]byte, 1<<20)))
	pool := &backing.Pool{}
	defer pool.Close()
	tables, err := ParseSet([]Def{
		{Name: "snap", File: write("snap.table", "0 2048 snapshot /dev/mapper/base "+cow+" N 8\n")},
		{Name: "base", File: write("base.table", "0 1024 linear "+disk+" 1024\n1024 1024 linear "+disk+" 0\n")},
	}, pool)
	if err != nil {
		t.Fatal(err)
	}
	defer tables[0].Close()
	d := NewDevice("snap", tables[0])
	if _, err := d.WriteAt([]byte("x"), 0); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 2)
	d.ReadAt(buf, 0)
	if string(buf) != "xd" {
		t.Fatalf("read %q", buf)
	}
	if n := len(pool.Devices()); n != 2 {
		t.Fatalf("pool opened %d devices, want 2 (disk once, cow)", n)
	}
}
