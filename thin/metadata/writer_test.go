package metadata

import (
	"bytes"
	"errors"
	"maps"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"testing"
)

// memPool is the in-memory model the writer is checked against.
type memPool struct {
	time    uint32
	trans   uint64
	devices map[uint64]*memDevice
}

type memDevice struct {
	d        Device
	mappings map[uint64]Mapping
}

// insertNew maps vblock v of device id (d in the model) to a newly
// allocated data block, in w and in the model alike.
func (m *memPool) insertNew(t *testing.T, w *Writer, d *memDevice, id, v uint64) {
	t.Helper()
	db, err := w.AllocData()
	if err != nil {
		t.Fatal(err)
	}
	if err := w.Insert(id, v, db); err != nil {
		t.Fatal(err)
	}
	if _, ok := d.mappings[v]; !ok {
		d.d.MappedBlocks++
	}
	d.mappings[v] = Mapping{VBlock: v, DBlock: db, Time: m.time}
}

func (m *memPool) clone() *memPool {
	c := &memPool{time: m.time, trans: m.trans, devices: map[uint64]*memDevice{}}
	for id, d := range m.devices {
		c.devices[id] = &memDevice{d: d.d, mappings: maps.Clone(d.mappings)}
	}
	return c
}

// model converts to the form the reader tests compare.
func (m *memPool) model(nrData uint64) *model {
	out := &model{Time: m.time, TransactionID: m.trans, DataBlockSize: 128, NrDataBlocks: nrData}
	for _, id := range slices.Sorted(maps.Keys(m.devices)) {
		d := m.devices[id]
		md := modelDevice{Device: d.d}
		for _, v := range slices.Sorted(maps.Keys(d.mappings)) {
			md.Mappings = append(md.Mappings, d.mappings[v])
		}
		out.Devices = append(out.Devices, md)
	}
	return out
}

// crashAtSuperblock is the metadata file of a machine that loses power
// just before the commit's superblock reaches the disk.
type crashAtSuperblock struct{ *os.File }

var errCrash = errors.New("power cut")

func (f crashAtSuperblock) WriteAt(p []byte, off int64) (int, error) {
	if off == 0 {
		return 0, errCrash
	}
	return f.File.WriteAt(p, off)
}

// checkFile checks the metadata file with thin_check, thin_dump and the
// reader against the model.
func checkFile(t *testing.T, path string, want *model) treeStats {
	t.Helper()
	run(t, tool(t, "thin_check"), path)
	dumped, err := parseXML(bytes.NewReader(run(t, tool(t, "thin_dump"), path)))
	if err != nil {
		t.Fatal(err)
	}
	if d := diffModels(want, dumped); d != "" {
		t.Fatalf("thin_dump differs from the model:\n%s", d)
	}
	p := openFile(t, path)
	got, err := readModel(p)
	if err != nil {
		t.Fatal(err)
	}
	if d := diffModels(want, got); d != "" {
		t.Fatalf("reader differs from the model:\n%s", d)
	}
	return checkTrees(t, p)
}

// TestFormat formats pools whose metadata space map has one bitmap and
// several (one bitmap covers 16320 blocks, 63.75 MiB).
func TestFormat(t *testing.T) {
	for _, size := range []int64{4 << 20, 200 << 20} {
		path := filepath.Join(t.TempDir(), "meta")
		f, err := os.Create(path)
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		if err := f.Truncate(size); err != nil {
			t.Fatal(err)
		}
		w, err := Format(f, size, 128, 100_000)
		if err != nil {
			t.Fatal(err)
		}
		checkFile(t, path, &model{DataBlockSize: 128, NrDataBlocks: 100_000})
		if sb := w.Pool().Superblock(); sb.MetadataNrBlocks != uint64(size/BlockSize) || sb.Version != 2 {
			t.Errorf("superblock %+v", sb)
		}
	}
}

// TestWriterRandom runs random operation sequences against the writer
// and an in-memory model; after every commit thin_check must pass and
// thin_dump, the reader and the space maps must agree with the model.
// Some commits lose power before the superblock is written: the file
// must then hold the previous commit, intact.
func TestWriterRandom(t *testing.T) {
	for _, seed := range []uint64{1, 2, 3} {
		t.Run("seed", func(t *testing.T) { writerRandom(t, seed) })
	}
}

func writerRandom(t *testing.T, seed uint64) {
	const (
		size   = 32 << 20
		nrData = 300_000
	)
	rng := rand.New(rand.NewPCG(seed, 99))
	path := filepath.Join(t.TempDir(), "meta")
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := f.Truncate(size); err != nil {
		t.Fatal(err)
	}
	w, err := Format(f, size, 128, nrData)
	if err != nil {
		t.Fatal(err)
	}
	m := &memPool{devices: map[uint64]*memDevice{}}
	committed := m.clone()

	randDev := func() (uint64, *memDevice) {
		ids := slices.Sorted(maps.Keys(m.devices))
		id := ids[rng.IntN(len(ids))]
		return id, m.devices[id]
	}
	ops := map[string]int{}
	var most treeStats
	for round := 0; round < 25; round++ {
		for op := 0; op < 50+rng.IntN(1000); op++ {
			r := rng.IntN(100)
			switch {
			case len(m.devices) == 0 || r < 3 && len(m.devices) < 12:
				id := uint64(rng.IntN(40))
				if m.devices[id] != nil {
					continue
				}
				if err := w.CreateThin(id); err != nil {
					t.Fatal(err)
				}
				m.devices[id] = &memDevice{d: Device{ID: id, TransactionID: m.trans, CreationTime: m.time, SnapshottedTime: m.time}, mappings: map[uint64]Mapping{}}
				ops["create"]++
			case r < 5 && len(m.devices) < 12:
				// One or two snapshots of one origin: its root gains
				// up to 3 references.
				oid, o := randDev()
				for k := 1 + rng.IntN(2); k > 0; k-- {
					id := uint64(rng.IntN(40))
					if m.devices[id] != nil {
						continue
					}
					if err := w.CreateSnap(id, oid); err != nil {
						t.Fatal(err)
					}
					m.time++
					o.d.SnapshottedTime = m.time
					m.devices[id] = &memDevice{d: Device{ID: id, MappedBlocks: o.d.MappedBlocks, TransactionID: m.trans, CreationTime: m.time, SnapshottedTime: m.time}, mappings: maps.Clone(o.mappings)}
					ops["snap"]++
				}
			case r < 6 && len(m.devices) > 6:
				id, _ := randDev()
				if err := w.DeleteDevice(id); err != nil {
					t.Fatal(err)
				}
				delete(m.devices, id)
				ops["delete"]++
			case r < 7:
				m.trans = rng.Uint64N(1000)
				w.SetTransactionID(m.trans)
				if got := w.Superblock().TransactionID; got != m.trans {
					t.Fatalf("transaction id %d after setting %d", got, m.trans)
				}
			case r < 8:
				// Unmap a whole device in random order, as a
				// blkdiscard does: the btree shrinks to its root.
				id, d := randDev()
				vs := slices.Collect(maps.Keys(d.mappings))
				rng.Shuffle(len(vs), func(i, j int) { vs[i], vs[j] = vs[j], vs[i] })
				for _, v := range vs {
					if ok, err := w.Remove(id, v); err != nil || !ok {
						t.Fatalf("Remove(%d, %d) = %v, %v", id, v, ok, err)
					}
					delete(d.mappings, v)
					d.d.MappedBlocks--
					ops["remove"]++
				}
			case r < 20:
				// Unmap a run, as a discard does.
				id, d := randDev()
				start, n := uint64(rng.IntN(60000)), uint64(1+rng.IntN(400))
				for v := start; v < start+n; v++ {
					ok, err := w.Remove(id, v)
					if err != nil {
						t.Fatal(err)
					}
					if _, want := d.mappings[v]; ok != want {
						t.Fatalf("Remove(%d, %d) = %v, want %v", id, v, ok, want)
					}
					if ok {
						delete(d.mappings, v)
						d.d.MappedBlocks--
						ops["remove"]++
					}
				}
			default:
				// Write a run.
				id, d := randDev()
				start, n := uint64(rng.IntN(60000)), uint64(1+rng.IntN(100))
				for v := start; v < start+n; v++ {
					m.insertNew(t, w, d, id, v)
					ops["insert"]++
				}
			}
		}
		if rng.IntN(4) == 0 {
			// Power cut before the superblock: the old commit survives,
			// and a new writer carries on from it.
			w.dev = crashAtSuperblock{f}
			if err := w.Commit(); !errors.Is(err, errCrash) {
				t.Fatalf("commit with power cut: %v", err)
			}
			checkFile(t, path, committed.model(nrData))
			if w, err = OpenWriter(f, size); err != nil {
				t.Fatal(err)
			}
			m = committed.clone()
			ops["crash"]++
			continue
		}
		if err := w.Commit(); err != nil {
			t.Fatal(err)
		}
		committed = m.clone()
		s := checkFile(t, path, m.model(nrData))
		most.mappingDepth = max(most.mappingDepth, s.mappingDepth)
		most.shared = max(most.shared, s.shared)
		most.overflow = max(most.overflow, s.overflow)
		most.dataOverflow = max(most.dataOverflow, s.dataOverflow)
		ops["commit"]++
	}
	p := w.Pool()
	t.Logf("seed %d: %v; %d metadata blocks used, %d data blocks; at most: mapping depth %d, %d shared references, %d metadata and %d data blocks with 3+ references",
		seed, ops, p.sb.MetadataSpaceMap.NrAllocated, p.sb.DataSpaceMap.NrAllocated, most.mappingDepth, most.shared, most.overflow, most.dataOverflow)
	if most.mappingDepth < 3 || most.shared == 0 || most.overflow == 0 || most.dataOverflow == 0 {
		t.Errorf("the workload did not reach multi-level trees, shared nodes and overflowing counts")
	}
}

// newFormatted formats a metadata file of size bytes.
func newFormatted(t *testing.T, size int64, nrData uint64) (*Writer, *os.File, string) {
	t.Helper()
	path := filepath.Join(t.TempDir(), "meta")
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	if err := f.Truncate(size); err != nil {
		t.Fatal(err)
	}
	w, err := Format(f, size, 128, nrData)
	if err != nil {
		t.Fatal(err)
	}
	return w, f, path
}

// TestWriterErrors checks the errors that change nothing leave the
// transaction usable, and that running out of space does not.
func TestWriterErrors(t *testing.T) {
	t.Run("refused", func(t *testing.T) {
		w, _, path := newFormatted(t, 4<<20, 1000)
		if err := w.CreateThin(1); err != nil {
			t.Fatal(err)
		}
		for _, c := range []struct {
			name string
			err  error
			want error
		}{
			{"create existing", w.CreateThin(1), ErrExists},
			{"snapshot onto existing", w.CreateSnap(1, 1), ErrExists},
			{"snapshot of unknown", w.CreateSnap(2, 9), ErrUnknownDevice},
			{"id above 24 bits", w.CreateThin(MaxDevID + 1), ErrOutOfRange},
			{"insert past the data device", w.Insert(1, 0, 1000), ErrOutOfRange},
			{"insert into unknown", w.Insert(7, 0, 1), ErrUnknownDevice},
			{"delete unknown", w.DeleteDevice(7), ErrUnknownDevice},
		} {
			if !errors.Is(c.err, c.want) {
				t.Errorf("%s: %v, want %v", c.name, c.err, c.want)
			}
		}
		if _, err := w.Remove(7, 0); !errors.Is(err, ErrUnknownDevice) {
			t.Errorf("remove from unknown: %v", err)
		}
		if err := w.Insert(1, 5, 999); err != nil {
			t.Fatal(err)
		}
		if err := w.Commit(); err != nil {
			t.Fatal(err)
		}
		checkFile(t, path, &model{DataBlockSize: 128, NrDataBlocks: 1000, Devices: []modelDevice{{
			Device:   Device{ID: 1, MappedBlocks: 1},
			Mappings: []Mapping{{VBlock: 5, DBlock: 999}},
		}}})
	})

	t.Run("data full", func(t *testing.T) {
		w, _, _ := newFormatted(t, 4<<20, 10)
		if err := w.CreateThin(1); err != nil {
			t.Fatal(err)
		}
		for v := uint64(0); v < 10; v++ {
			b, err := w.AllocData()
			if err != nil {
				t.Fatal(err)
			}
			if err := w.Insert(1, v, b); err != nil {
				t.Fatal(err)
			}
		}
		if _, err := w.AllocData(); !errors.Is(err, ErrNoSpace) {
			t.Fatalf("11th block of 10: %v, want ErrNoSpace", err)
		}
		if err := w.Commit(); err != nil {
			t.Fatal(err)
		}
	})

	t.Run("metadata full", func(t *testing.T) {
		w, _, path := newFormatted(t, 32*BlockSize, 100_000)
		if err := w.CreateThin(1); err != nil {
			t.Fatal(err)
		}
		if err := w.Commit(); err != nil {
			t.Fatal(err)
		}
		var err error
		for v := uint64(0); err == nil; v += 2 {
			err = w.Insert(1, v, v)
		}
		if !errors.Is(err, ErrNoSpace) {
			t.Fatalf("filling the metadata: %v, want ErrNoSpace", err)
		}
		if err := w.Commit(); !errors.Is(err, ErrNoSpace) {
			t.Fatalf("commit after running out: %v, want the same error", err)
		}
		checkFile(t, path, &model{DataBlockSize: 128, NrDataBlocks: 100_000, Devices: []modelDevice{{Device: Device{ID: 1}}}})
	})
}

// memFromModel is the writer tests' model of a pool read from XML.
func memFromModel(m *model) *memPool {
	mp := &memPool{time: m.Time, trans: m.TransactionID, devices: map[uint64]*memDevice{}}
	for _, d := range m.Devices {
		md := &memDevice{d: d.Device, mappings: map[uint64]Mapping{}}
		for _, x := range d.Mappings {
			md.mappings[x.VBlock] = x
		}
		mp.devices[d.ID] = md
	}
	return mp
}

// TestWriterOnRestoredPool changes a pool thin_restore wrote, whose
// space maps and trees another implementation laid out: snapshots,
// writes, discards and a delete, then checks it as the other tests do.
func TestWriterOnRestoredPool(t *testing.T) {
	want := genModel(7, 20_000)
	path := restore(t, want, 16<<20)
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	w, err := OpenWriter(f, 16<<20)
	if err != nil {
		t.Fatal(err)
	}
	m := memFromModel(want)
	rng := rand.New(rand.NewPCG(7, 7))

	// Snapshot device 4, then overwrite and discard parts of both.
	if err := w.CreateSnap(20, 4); err != nil {
		t.Fatal(err)
	}
	m.time++
	m.devices[4].d.SnapshottedTime = m.time
	o := m.devices[4]
	m.devices[20] = &memDevice{d: Device{ID: 20, MappedBlocks: o.d.MappedBlocks, TransactionID: m.trans, CreationTime: m.time, SnapshottedTime: m.time}, mappings: maps.Clone(o.mappings)}
	for _, id := range []uint64{4, 20, 1} {
		d := m.devices[id]
		vs := slices.Sorted(maps.Keys(d.mappings))
		for i := 0; i < 2000; i++ {
			v := vs[rng.IntN(len(vs))]
			if rng.IntN(2) == 0 {
				m.insertNew(t, w, d, id, v)
			} else {
				ok, err := w.Remove(id, v)
				if err != nil {
					t.Fatal(err)
				}
				if _, want := d.mappings[v]; ok != want {
					t.Fatalf("Remove(%d, %d) = %v, want %v", id, v, ok, want)
				}
				if ok {
					delete(d.mappings, v)
					d.d.MappedBlocks--
				}
			}
		}
	}
	if err := w.DeleteDevice(2); err != nil {
		t.Fatal(err)
	}
	delete(m.devices, 2)
	w.SetTransactionID(43)
	m.trans = 43
	if err := w.Commit(); err != nil {
		t.Fatal(err)
	}
	checkFile(t, path, m.model(want.NrDataBlocks))
}

// TestWriterNeedsCheck: a pool the kernel flagged is not written.
func TestWriterNeedsCheck(t *testing.T) {
	w, f, _ := newFormatted(t, 4<<20, 1000)
	w.sb.Flags |= FlagNeedsCheck
	if err := w.Commit(); err != nil {
		t.Fatal(err)
	}
	if _, err := OpenWriter(f, 4<<20); !errors.Is(err, ErrNeedsCheck) {
		t.Fatalf("OpenWriter of a flagged pool: %v, want ErrNeedsCheck", err)
	}
}
