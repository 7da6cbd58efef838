package metadata

import (
	"bytes"
	"errors"
	"math/rand/v2"
	"os"
	"slices"
	"testing"
)

// genModel builds a pool the way a kernel would leave it after a
// workload: an origin written in runs, a snapshot of it where both sides
// then broke sharing, snapshots of the snapshot (so blocks have 3 and 4
// references and the ref count btrees fill), an empty device and a small
// scattered one.
func genModel(seed uint64, origin int) *model {
	rng := rand.New(rand.NewPCG(seed, seed^0x5eed))
	m := &model{Time: 3, TransactionID: 42, DataBlockSize: 128, NrDataBlocks: uint64(origin) * 8}
	next := uint64(rng.IntN(50))
	alloc := func() uint64 {
		b := next
		next += 1 + uint64(rng.IntN(100)/97) // mostly sequential, some holes
		return b
	}

	// Device 1: runs of consecutive blocks with gaps between them.
	var d1 []Mapping
	for v := uint64(rng.IntN(10)); len(d1) < origin; v += uint64(rng.IntN(20)) {
		for n := 1 + rng.IntN(200); n > 0 && len(d1) < origin; n-- {
			d1 = append(d1, Mapping{VBlock: v, DBlock: alloc(), Time: 0})
			v++
		}
	}
	// Device 2 snapshots 1 at time 1; then each breaks sharing on some
	// blocks, 2 drops some and gains some past the end of 1.
	d2 := slices.Clone(d1)
	for i := range d1 {
		switch rng.IntN(20) {
		case 0:
			d1[i].DBlock, d1[i].Time = alloc(), 1
		case 1:
			d2[i].DBlock, d2[i].Time = alloc(), 1
		}
	}
	d2 = slices.DeleteFunc(d2, func(Mapping) bool { return rng.IntN(30) == 0 })
	end := d2[len(d2)-1].VBlock
	for i := 0; i < origin/20; i++ {
		d2 = append(d2, Mapping{VBlock: end + 1 + uint64(i)*3, DBlock: alloc(), Time: 1})
	}
	// Devices 3 and 4 snapshot 2 at time 2; 4 then writes some blocks.
	d3 := slices.Clone(d2)
	d3 = d3[:len(d3)*2/3]
	d4 := slices.Clone(d2)
	for i := range d4 {
		if rng.IntN(25) == 0 {
			d4[i].DBlock, d4[i].Time = alloc(), 2
		}
	}
	// Device 1000: scattered single blocks written at time 2.
	var d1000 []Mapping
	for v := uint64(0); len(d1000) < 500; v += 1 + uint64(rng.IntN(1<<20)) {
		d1000 = append(d1000, Mapping{VBlock: v, DBlock: alloc(), Time: 2})
	}
	if next > m.NrDataBlocks {
		panic("genModel: data device too small")
	}

	add := func(id uint64, trans uint64, created, snapped uint32, ms []Mapping) {
		m.Devices = append(m.Devices, modelDevice{
			Device:   Device{ID: id, MappedBlocks: uint64(len(ms)), TransactionID: trans, CreationTime: created, SnapshottedTime: snapped},
			Mappings: ms,
		})
	}
	add(1, 0, 0, 1, d1)
	add(2, 7, 1, 2, d2)
	add(3, 9, 2, 2, d3)
	add(4, 9, 2, 2, d4)
	add(5, 11, 2, 2, nil)
	add(1000, 40, 2, 2, d1000)
	return m
}

// TestRestoredPool restores a pool of several hundred thousand mappings
// with thin_restore and checks that the reader sees exactly what the XML
// said, and what thin_dump says.
func TestRestoredPool(t *testing.T) {
	want := genModel(1, 100_000)
	meta := restore(t, want, 64<<20)
	run(t, tool(t, "thin_check"), meta)
	p := openFile(t, meta)

	sb := p.Superblock()
	if sb.Version != 2 || sb.Flags != 0 || sb.HeldRoot != 0 || sb.MetadataNrBlocks != 64<<20/BlockSize {
		t.Errorf("superblock: %+v", sb)
	}
	got, err := readModel(p)
	if err != nil {
		t.Fatal(err)
	}
	if d := diffModels(want, got); d != "" {
		t.Fatalf("reader differs from the XML restored:\n%s", d)
	}
	dumped, err := parseXML(bytes.NewReader(run(t, tool(t, "thin_dump"), meta)))
	if err != nil {
		t.Fatal(err)
	}
	if d := diffModels(dumped, got); d != "" {
		t.Fatalf("reader differs from thin_dump:\n%s", d)
	}
	n := checkTrees(t, p)
	if n.mappingDepth < 3 || n.refCountDepth < 2 {
		t.Errorf("want multi-level btrees, got mapping depth %d, ref count depth %d", n.mappingDepth, n.refCountDepth)
	}
	total := 0
	for _, d := range want.Devices {
		total += len(d.Mappings)
	}
	t.Logf("%d devices, %d mappings, %d metadata blocks used; mapping btree depth %d, data ref count btree depth %d",
		len(want.Devices), total, sb.MetadataSpaceMap.NrAllocated, n.mappingDepth, n.refCountDepth)

	t.Run("lookup", func(t *testing.T) {
		rng := rand.New(rand.NewPCG(2, 3))
		for _, d := range want.Devices {
			mapped := map[uint64]Mapping{}
			for _, m := range d.Mappings {
				mapped[m.VBlock] = m
			}
			probes := []uint64{0, 1, 1 << 62, ^uint64(0)}
			for i := 0; i < 300 && len(d.Mappings) > 0; i++ {
				m := d.Mappings[rng.IntN(len(d.Mappings))]
				probes = append(probes, m.VBlock, m.VBlock+1, m.VBlock-1)
			}
			for _, v := range probes {
				got, ok, err := p.Lookup(d.ID, v)
				if err != nil {
					t.Fatalf("Lookup(%d, %d): %v", d.ID, v, err)
				}
				w, wok := mapped[v]
				if ok != wok || got != w {
					t.Fatalf("Lookup(%d, %d) = %+v %v, want %+v %v", d.ID, v, got, ok, w, wok)
				}
			}
		}
	})

	t.Run("walk from", func(t *testing.T) {
		d := want.Devices[1]
		for _, i := range []int{0, 1, 251, 252, 253, len(d.Mappings) / 2, len(d.Mappings) - 1} {
			from := d.Mappings[i].VBlock
			var got []Mapping
			if err := p.WalkMappings(d.ID, from, func(m Mapping) error { got = append(got, m); return nil }); err != nil {
				t.Fatal(err)
			}
			if !slices.Equal(got, d.Mappings[i:]) {
				t.Fatalf("WalkMappings from %d: got %d mappings, want %d", from, len(got), len(d.Mappings)-i)
			}
		}
		// A walk stops at the callback's error and returns it.
		stop := errors.New("stop")
		n := 0
		err := p.WalkMappings(d.ID, 0, func(Mapping) error {
			if n++; n == 1000 {
				return stop
			}
			return nil
		})
		if err != stop || n != 1000 {
			t.Fatalf("stopped walk: err %v after %d mappings", err, n)
		}
	})

	t.Run("data space map", func(t *testing.T) {
		rc := want.refCounts()
		sm := p.DataSpaceMap()
		if sm.NrBlocks() != want.NrDataBlocks || sm.NrAllocated() != uint64(len(rc)) {
			t.Errorf("data space map: %d blocks, %d allocated; want %d, %d", sm.NrBlocks(), sm.NrAllocated(), want.NrDataBlocks, len(rc))
		}
		seen, overflow := 0, 0
		err := sm.Walk(func(b uint64, c uint32) error {
			if rc[b] != c {
				t.Fatalf("data block %d: count %d, want %d", b, c, rc[b])
			}
			if c >= 3 {
				overflow++
			}
			seen++
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
		if seen != len(rc) || overflow < 1000 {
			t.Fatalf("walk saw %d blocks (%d with 3+ references), want %d (1000+)", seen, overflow, len(rc))
		}
		for b := uint64(0); b < want.NrDataBlocks; b += 97 {
			c, err := sm.Count(b)
			if err != nil || c != rc[b] {
				t.Fatalf("Count(%d) = %d, %v; want %d", b, c, err, rc[b])
			}
		}
		if _, err := sm.Count(want.NrDataBlocks); !errors.Is(err, ErrOutOfRange) {
			t.Fatalf("Count past the end: %v, want ErrOutOfRange", err)
		}
	})

	t.Run("unknown device", func(t *testing.T) {
		if _, err := p.Device(6); !errors.Is(err, ErrUnknownDevice) {
			t.Errorf("Device(6): %v", err)
		}
		if _, _, err := p.Lookup(6, 0); !errors.Is(err, ErrUnknownDevice) {
			t.Errorf("Lookup(6, 0): %v", err)
		}
		if err := p.WalkMappings(999, 0, func(Mapping) error { return nil }); !errors.Is(err, ErrUnknownDevice) {
			t.Errorf("WalkMappings(999): %v", err)
		}
		d, err := p.Device(1000)
		if err != nil || d != want.Devices[5].Device {
			t.Errorf("Device(1000) = %+v, %v; want %+v", d, err, want.Devices[5].Device)
		}
	})
}

// treeStats says how deep the pool's btrees are.
type treeStats struct {
	mappingDepth, refCountDepth int
	shared                      int // references to nodes beyond their first
	overflow                    int // metadata blocks with 3 or more references
	dataOverflow                int // data blocks with 3 or more references
}

// checkTrees counts the references to every metadata and data block by
// walking every structure the superblock reaches, and checks the space
// maps hold exactly those counts: a block the walk misses, or one the
// space map does not know, is a reader (or format) bug.
func checkTrees(t *testing.T, p *Pool) treeStats {
	t.Helper()
	refs := map[uint64]uint32{0: 1} // the superblock
	var stats treeStats
	// nodes adds the nodes of a btree and returns its depth; leaf calls
	// visit each leaf value.
	var nodes func(root uint64, valueSize int, leaf func([]byte)) int
	var visit func(blk uint64, valueSize int, leaf func([]byte), isRoot bool) int
	nodes = func(root uint64, valueSize int, leaf func([]byte)) int {
		return visit(root, valueSize, leaf, true)
	}
	visit = func(root uint64, valueSize int, leaf func([]byte), isRoot bool) int {
		refs[root]++
		if refs[root] > 1 {
			stats.shared++
			return 0 // shared, counted once per parent, walked once
		}
		n, err := p.readNode(root, valueSize, "test")
		if err != nil {
			t.Fatal(err)
		}
		// thin_check's rule, which the kernel's rebalancing keeps.
		if !isRoot && n.nr < n.max/3 {
			t.Errorf("btree node %d: %d entries, fewer than a third of %d", root, n.nr, n.max)
		}
		if n.leaf {
			for i := 0; i < n.nr; i++ {
				if leaf != nil {
					leaf(n.value(i))
				}
			}
			return 1
		}
		depth := 0
		for i := 0; i < n.nr; i++ {
			depth = visit(n.child(i), valueSize, leaf, false) + 1
		}
		return depth
	}
	sb := p.Superblock()
	// A data block has one reference from each leaf that maps it: a
	// leaf that snapshots share counts once.
	dataRefs := map[uint64]uint32{}
	nodes(sb.DataMappingRoot, blockValueSize, func(v []byte) {
		stats.mappingDepth = max(stats.mappingDepth, 1+nodes(le64(v, 0), mappingValueSize, func(v []byte) {
			dataRefs[le64(v, 0)>>mappingTimeBits]++
		}))
	})
	nodes(sb.DeviceDetailsRoot, detailsValueSize, nil)
	nodes(sb.DataSpaceMap.BitmapRoot, indexEntrySize, func(v []byte) { refs[le64(v, 0)]++ })
	stats.refCountDepth = nodes(sb.DataSpaceMap.RefCountRoot, refCountSize, nil)
	msm := p.MetadataSpaceMap()
	refs[sb.MetadataSpaceMap.BitmapRoot]++
	index := msm.indexer()
	for i := uint64(0); i < msm.nrBitmaps(); i++ {
		bm, err := index(i)
		if err != nil {
			t.Fatal(err)
		}
		refs[bm]++
	}
	nodes(sb.MetadataSpaceMap.RefCountRoot, refCountSize, nil)

	seen := 0
	err := msm.Walk(func(b uint64, c uint32) error {
		if c >= 3 {
			stats.overflow++
		}
		if refs[b] != c {
			t.Errorf("metadata block %d: space map count %d, %d references found", b, c, refs[b])
		}
		seen++
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if seen != len(refs) || msm.NrAllocated() != uint64(len(refs)) {
		t.Errorf("metadata space map: %d blocks counted, %d allocated, %d referenced", seen, msm.NrAllocated(), len(refs))
	}
	seen = 0
	dsm := p.DataSpaceMap()
	err = dsm.Walk(func(b uint64, c uint32) error {
		if dataRefs[b] != c {
			t.Errorf("data block %d: space map count %d, %d references found", b, c, dataRefs[b])
		}
		if c >= 3 {
			stats.dataOverflow++
		}
		seen++
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if seen != len(dataRefs) || dsm.NrAllocated() != uint64(len(dataRefs)) {
		t.Errorf("data space map: %d blocks counted, %d allocated, %d referenced", seen, dsm.NrAllocated(), len(dataRefs))
	}
	return stats
}

// TestSmallPool reads testdata/small.xml, a pool small enough to read
// as a whole: its metadata blocks hold every kind of structure.
func TestSmallPool(t *testing.T) {
	meta := restoreFile(t, "testdata/small.xml", 4<<20)
	p := openFile(t, meta)
	f, err := os.Open("testdata/small.xml")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	want, err := parseXML(f)
	if err != nil {
		t.Fatal(err)
	}
	got, err := readModel(p)
	if err != nil {
		t.Fatal(err)
	}
	if d := diffModels(want, got); d != "" {
		t.Fatal(d)
	}
	checkTrees(t, p)
}
