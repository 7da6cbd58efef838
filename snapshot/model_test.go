package snapshot

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"testing"

	"github.com/nbdmapper/nbdmapper/backing"
)

// TestModel drives an origin and its snapshots with random reads and writes
// and checks every read against a plain in-memory model: the origin is what
// was written to it, a snapshot is the origin as it was when the snapshot
// was loaded plus what was written to the snapshot. Persistent snapshots
// are closed and reopened from their COW devices at random points.
func TestModel(t *testing.T) {
	type snapSpec struct {
		typ   Type
		chunk uint32
	}
	cases := []struct {
		name  string
		snaps []snapSpec
		ops   int
	}{
		{"P chunk 1 sector (many metadata areas)", []snapSpec{{Persistent, 1}}, 1500},
		{"P chunk 8", []snapSpec{{Persistent, 8}}, 800},
		{"PO chunk 2", []snapSpec{{PersistentOverflow, 2}}, 800},
		{"N chunk 4", []snapSpec{{Transient, 4}}, 800},
		{"P 1 + N 8 + PO 16 on one origin", []snapSpec{{Persistent, 1}, {Transient, 8}, {PersistentOverflow, 16}}, 1500},
	}
	const originSize = 64 << 10
	for i, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			rng := rand.New(rand.NewPCG(uint64(i), 42))
			originDev := backing.NewMem("origin", originSize)
			model := make([]byte, originSize)
			fill(rng, model)
			mustWrite(t, originDev, model, 0)
			origin, err := NewOrigin("origin", originDev, 0)
			if err != nil {
				t.Fatal(err)
			}

			type snapState struct {
				spec  snapSpec
				cow   *backing.Mem
				dev   *Snapshot
				model []byte
			}
			var snaps []*snapState
			for j, sp := range tc.snaps {
				// Big enough never to fill: every chunk copied plus metadata.
				cow := backing.NewMem(fmt.Sprintf("cow%d", j), 2*originSize+64<<10)
				s, err := Open(fmt.Sprintf("snap%d", j), originDev, cow, Options{Type: sp.typ, ChunkSectors: sp.chunk})
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { s.Close() })
				snaps = append(snaps, &snapState{spec: sp, cow: cow, dev: s, model: bytes.Clone(model)})
			}

			randRange := func() (int64, int64) {
				if rng.IntN(10) == 0 { // unaligned bytes
					off := rng.Int64N(originSize - 1)
					return off, 1 + rng.Int64N(min(originSize-off, 5000))
				}
				off := rng.Int64N(originSize/512) * 512
				return off, 512 * (1 + rng.Int64N(min((originSize-off)/512, 24)))
			}
			restarts := 0
			for op := 0; op < tc.ops; op++ {
				off, n := randRange()
				switch k := rng.IntN(10); {
				case k < 3: // origin write
					p := make([]byte, n)
					fill(rng, p)
					mustWrite(t, origin, p, off)
					copy(model[off:], p)
				case k < 6: // snapshot write
					s := snaps[rng.IntN(len(snaps))]
					p := make([]byte, n)
					fill(rng, p)
					mustWrite(t, s.dev, p, off)
					copy(s.model[off:], p)
				case k < 7:
					checkRead(t, op, origin, model, off, n)
				case k < 9:
					s := snaps[rng.IntN(len(snaps))]
					checkRead(t, op, s.dev, s.model, off, n)
				default: // restart the persistent snapshots
					for j, s := range snaps {
						if s.spec.typ == Transient {
							continue
						}
						before := s.dev.Status()
						s.dev.Close()
						s.dev, err = Open(fmt.Sprintf("snap%d", j), originDev, s.cow, Options{Type: s.spec.typ, ChunkSectors: s.spec.chunk})
						if err != nil {
							t.Fatalf("op %d: reopen: %v", op, err)
						}
						if after := s.dev.Status(); after != before {
							t.Fatalf("op %d: status %q before restart, %q after", op, before, after)
						}
						restarts++
					}
				}
			}
			checkRead(t, -1, origin, model, 0, originSize)
			for _, s := range snaps {
				checkRead(t, -1, s.dev, s.model, 0, originSize)
				if st := s.dev.Status(); st == "Invalid" || st == "Overflow" {
					t.Fatalf("%s: status %s", s.dev.Name(), st)
				}
			}
			t.Logf("%d restarts; status %s", restarts, snaps[0].dev.Status())
		})
	}
}

func fill(rng *rand.Rand, p []byte) {
	for i := range p {
		p[i] = byte(rng.Uint32())
	}
}

func mustWrite(t *testing.T, d backing.Device, p []byte, off int64) {
	t.Helper()
	if _, err := d.WriteAt(p, off); err != nil {
		t.Fatalf("write %s [%d, %d): %v", d.Name(), off, off+int64(len(p)), err)
	}
}

func checkRead(t *testing.T, op int, d backing.Device, model []byte, off, n int64) {
	t.Helper()
	got := make([]byte, n)
	if _, err := d.ReadAt(got, off); err != nil {
		t.Fatalf("op %d: read %s [%d, %d): %v", op, d.Name(), off, off+n, err)
	}
	if want := model[off : off+n]; !bytes.Equal(got, want) {
		i := 0
		for got[i] == want[i] {
			i++
		}
		t.Fatalf("op %d: read %s [%d, %d): first difference at byte %d: got %#02x, want %#02x",
			op, d.Name(), off, off+n, off+int64(i), got[i], want[i])
	}
}
