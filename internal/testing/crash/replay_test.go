package crash_test

import (
	"bytes"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"testing"

	"github.com/nbdmapper/nbdmapper/backing"
	"github.com/nbdmapper/nbdmapper/internal/testing/crash"
)

func sectors(b ...byte) []byte {
	var out []byte
	for _, c := range b {
		out = append(out, bytes.Repeat([]byte{c}, crash.SectorSize)...)
	}
	return out
}

// TestReplayerImages replays a hand-written log onto two 4-sector files
// and checks the crash images sector by sector.
func TestReplayerImages(t *testing.T) {
	w := func(dev int, sector int64, fua bool, data ...byte) backing.LogEntry {
		d := sectors(data...)
		return backing.LogEntry{Dev: dev, Op: backing.OpWrite, Off: sector * crash.SectorSize, Len: int64(len(d)), Data: d, FUA: fua}
	}
	log := []backing.LogEntry{
		0: w(0, 0, false, 'A', 'A'),
		1: w(0, 2, false, 'B'),                     // completes while sync 3 runs
		2: w(1, 0, false, 'x'),                     // the other device: sync 3 does not cover it
		3: {Dev: 0, Op: backing.OpSync, Covers: 1}, // covers entry 0 only
		4: w(0, 0, false, 'C'),                     // volatile, older than the FUA write below
		5: w(0, 0, true, 'F'),                      // FUA: durable by itself
		6: w(0, 1, false, 'D', 'D', 'D'),           // volatile, three sectors: may tear
		7: {Dev: 0, Op: backing.OpZero, Off: 3 * crash.SectorSize, Len: crash.SectorSize},
		8: {Dev: 1, Op: backing.OpSync, Covers: 8}, // covers entry 2
	}
	dir := t.TempDir()
	files := []string{filepath.Join(dir, "a"), filepath.Join(dir, "b")}
	for _, f := range files {
		if err := os.WriteFile(f, sectors('.', '.', '.', '.'), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	r, err := crash.NewReplayer(log, files, rand.New(rand.NewPCG(1, 2)))
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	points := r.Points([]int{6})
	if want := []int{3, 6, 8, 9}; !slices.Equal(points, want) {
		t.Fatalf("points %v, want %v", points, want)
	}
	// The sectors each image may hold at each crash point, per device.
	allowed := map[int][2][]string{
		3: {{".A", ".A", ".B", "."}, {".x", ".", ".", "."}},
		6: {{"F", "A", ".B", "."}, {".x", ".", ".", "."}},
		8: {{"F", "AD", ".BD", ".D0"}, {".x", ".", ".", "."}},
		9: {{"F", "AD", ".BD", ".D0"}, {"x", ".", ".", "."}},
	}
	fixed := map[[2]any]string{ // (pos, kind) -> device 0's sectors
		{3, "durable"}: "....", {3, "all"}: "AAB.",
		{8, "durable"}: "FA..", {8, "all"}: "FDD0",
	}
	torn := 0
	n, err := r.Run(points, 30, func(im crash.Image) error {
		for dev, f := range files {
			b, err := os.ReadFile(f)
			if err != nil {
				return err
			}
			var got []byte
			for s := range 4 {
				c := b[s*crash.SectorSize]
				if c == 0 {
					c = '0'
				}
				if !bytes.Equal(b[s*crash.SectorSize:(s+1)*crash.SectorSize], bytes.Repeat(b[s*crash.SectorSize:][:1], crash.SectorSize)) {
					t.Errorf("%v: device %d sector %d is not one version", im, dev, s)
				}
				if !bytes.ContainsRune([]byte(allowed[im.Pos][dev][s]), rune(c)) {
					t.Errorf("%v: device %d sector %d holds %q, allowed %q", im, dev, s, c, allowed[im.Pos][dev][s])
				}
				got = append(got, c)
			}
			if want, ok := fixed[[2]any{im.Pos, im.Kind}]; ok && dev == 0 && string(got) != want {
				t.Errorf("%v: device 0 holds %s, want %s", im, got, want)
			}
		}
		torn += im.Torn
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if want := 4 * 32; n != want {
		t.Errorf("%d images, want %d", n, want)
	}
	if torn == 0 {
		t.Error("no random image tore a write")
	}
}
