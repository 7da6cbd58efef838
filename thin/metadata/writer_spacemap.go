package metadata

// The Writer's reference counts: metadata blocks counted in memory, data
// blocks over the committed data space map, and how a commit writes both
// space maps (the metadata one last, as it must count its own blocks).

import (
	"encoding/binary"
	"fmt"
	"maps"
	"slices"
)

// allocMeta takes a metadata block free both now and at the last commit
// (a block freed in this transaction still holds the committed
// metadata), with a count of 1.
func (w *Writer) allocMeta() (uint64, error) {
	nr := uint64(len(w.meta))
	for i := uint64(0); i < nr; i++ {
		b := (w.metaCursor + i) % nr
		if w.meta[b] == 0 && w.metaOld[b] == 0 {
			w.meta[b] = 1
			w.metaCursor = b + 1
			return b, nil
		}
	}
	return 0, fmt.Errorf("%w: metadata device full (%d blocks)", ErrNoSpace, nr)
}

// incMeta adds a reference to metadata block b.
func (w *Writer) incMeta(b uint64) error {
	if b == 0 || b >= uint64(len(w.meta)) {
		return fmt.Errorf("%w: reference to metadata block %d of %d", ErrCorrupt, b, len(w.meta))
	}
	w.meta[b]++
	return nil
}

// decMeta drops a reference to metadata block b; the last one frees it.
func (w *Writer) decMeta(b uint64) error {
	if b == 0 || b >= uint64(len(w.meta)) || w.meta[b] == 0 {
		return fmt.Errorf("%w: metadata block %d released with no references", ErrCorrupt, b)
	}
	if w.meta[b]--; w.meta[b] == 0 {
		delete(w.fresh, b)
	}
	return nil
}

// oldBitmap returns committed data bitmap i.
func (w *Writer) oldBitmap(i uint64) ([]byte, error) {
	if b, ok := w.oldBitmaps[i]; ok {
		return b, nil
	}
	blk, err := w.old.DataSpaceMap().indexer()(i)
	if err != nil {
		return nil, err
	}
	b, err := w.old.readBlock(blk, bitmapCsumXor, "data space map bitmap")
	if err != nil {
		return nil, err
	}
	w.oldBitmaps[i] = b
	return b, nil
}

// oldDataCount is data block b's count at the last commit.
func (w *Writer) oldDataCount(b uint64) (uint32, error) {
	if w.old == nil || b >= w.old.sb.DataSpaceMap.NrBlocks {
		return 0, nil
	}
	bm, err := w.oldBitmap(b / entriesPerBitmap)
	if err != nil {
		return 0, err
	}
	if c := bitmapCount(bm, b%entriesPerBitmap); c < 3 {
		return c, nil
	}
	return w.old.DataSpaceMap().overflow(b)
}

func (w *Writer) dataCount(b uint64) (uint32, error) {
	if c, ok := w.data[b]; ok {
		return c, nil
	}
	return w.oldDataCount(b)
}

func (w *Writer) incData(b uint64) error {
	if b >= w.sb.DataSpaceMap.NrBlocks {
		return fmt.Errorf("data block %d: %w (%d blocks)", b, ErrOutOfRange, w.sb.DataSpaceMap.NrBlocks)
	}
	c, err := w.dataCount(b)
	if err != nil {
		return err
	}
	w.data[b] = c + 1
	return nil
}

func (w *Writer) decData(b uint64) error {
	c, err := w.dataCount(b)
	if err != nil {
		return err
	}
	if c == 0 {
		return fmt.Errorf("%w: data block %d released with no references", ErrCorrupt, b)
	}
	w.data[b] = c - 1
	return nil
}

// AllocData returns a data block free both now and at the last commit.
// It stays free until a mapping refers to it.
func (w *Writer) AllocData() (uint64, error) {
	if w.err != nil {
		return 0, w.err
	}
	nr := w.sb.DataSpaceMap.NrBlocks
	for i := uint64(0); i < nr; i++ {
		b := (w.dataCursor + i) % nr
		if c, ok := w.data[b]; ok && c != 0 {
			continue
		}
		if w.old != nil && b < w.old.sb.DataSpaceMap.NrBlocks {
			bm, err := w.oldBitmap(b / entriesPerBitmap)
			if err != nil {
				return 0, err
			}
			if bitmapCount(bm, b%entriesPerBitmap) != 0 {
				continue
			}
		}
		w.dataCursor = b + 1
		return b, nil
	}
	return 0, fmt.Errorf("%w: data device full (%d blocks)", ErrNoSpace, nr)
}

// setBitmapCount stores count c (3 for 3 or more) as entry j of a bitmap.
func setBitmapCount(b []byte, j uint64, c uint32) {
	c = min(c, 3)
	off := bitmapHeaderSize + int(j/32)*8
	word := le64(b, off)
	shift := (j % 32) * 2
	word &^= 3 << shift
	word |= uint64(c>>1&1)<<shift | uint64(c&1)<<(shift+1)
	binary.LittleEndian.PutUint64(b[off:], word)
}

// indexEntry describes a bitmap of n entries for its index.
func indexEntry(bm []byte, blk uint64, n uint64) []byte {
	free, first := uint32(0), uint32(n)
	for j := uint64(0); j < n; j++ {
		if bitmapCount(bm, j) == 0 {
			if free == 0 {
				first = uint32(j)
			}
			free++
		}
	}
	v := make([]byte, indexEntrySize)
	binary.LittleEndian.PutUint64(v, blk)
	binary.LittleEndian.PutUint32(v[8:], free)
	binary.LittleEndian.PutUint32(v[12:], first)
	return v
}

func (w *Writer) newBitmap(old []byte) (uint64, []byte, error) {
	blk, err := w.allocMeta()
	if err != nil {
		return 0, nil, err
	}
	b := make([]byte, BlockSize)
	if old != nil {
		copy(b, old)
	}
	binary.LittleEndian.PutUint64(b[8:], blk)
	w.fresh[blk] = freshBlock{b: b, salt: bitmapCsumXor}
	return blk, b, nil
}

// commitDataSpaceMap writes the data counts changed in this transaction.
func (w *Writer) commitDataSpaceMap() error {
	sm := &w.sb.DataSpaceMap
	nrBitmaps := (sm.NrBlocks + entriesPerBitmap - 1) / entriesPerBitmap
	changed := map[uint64][]uint64{}
	if w.old == nil {
		for i := uint64(0); i < nrBitmaps; i++ {
			changed[i] = nil
		}
	}
	for b := range w.data {
		changed[b/entriesPerBitmap] = append(changed[b/entriesPerBitmap], b)
	}
	for _, i := range slices.Sorted(maps.Keys(changed)) {
		blocks := changed[i]
		var cur []byte
		v, ok, err := w.lookup(sm.BitmapRoot, i, indexEntrySize)
		if err != nil {
			return err
		}
		var blk uint64
		if ok {
			old := le64(v, 0)
			if f, ok := w.fresh[old]; ok {
				blk, cur = old, f.b
			} else {
				ob, err := w.oldBitmap(i)
				if err != nil {
					return err
				}
				if blk, cur, err = w.newBitmap(ob); err != nil {
					return err
				}
				if err := w.decMeta(old); err != nil {
					return err
				}
			}
		} else if blk, cur, err = w.newBitmap(nil); err != nil {
			return err
		}
		for _, b := range blocks {
			c := w.data[b]
			o, err := w.oldDataCount(b)
			if err != nil {
				return err
			}
			setBitmapCount(cur, b%entriesPerBitmap, c)
			switch {
			case o == 0 && c != 0:
				sm.NrAllocated++
			case o != 0 && c == 0:
				sm.NrAllocated--
			}
			if c >= 3 {
				sm.RefCountRoot, _, err = w.btreeInsert(sm.RefCountRoot, b, binary.LittleEndian.AppendUint32(nil, c), valuePlain)
			} else if o >= 3 {
				sm.RefCountRoot, _, err = w.btreeRemove(sm.RefCountRoot, b, refCountSize, valuePlain)
			}
			if err != nil {
				return err
			}
		}
		n := min(uint64(entriesPerBitmap), sm.NrBlocks-i*entriesPerBitmap)
		if sm.BitmapRoot, _, err = w.btreeInsert(sm.BitmapRoot, i, indexEntry(cur, blk, n), valuePlain); err != nil {
			return err
		}
	}
	return nil
}

// commitMetadataSpaceMap writes the metadata counts. Its own blocks are
// metadata blocks whose allocation changes the counts it records, so
// bitmaps are given new blocks until every changed bitmap has one, and
// only then filled in.
func (w *Writer) commitMetadataSpaceMap() error {
	sm := &w.sb.MetadataSpaceMap
	var over []uint64
	for b := range w.meta {
		if w.meta[b] != w.metaOld[b] && (w.meta[b] >= 3 || w.metaOld[b] >= 3) {
			over = append(over, uint64(b))
		}
	}
	for _, b := range over {
		var err error
		if c := w.meta[b]; c >= 3 {
			sm.RefCountRoot, _, err = w.btreeInsert(sm.RefCountRoot, b, binary.LittleEndian.AppendUint32(nil, c), valuePlain)
		} else {
			sm.RefCountRoot, _, err = w.btreeRemove(sm.RefCountRoot, b, refCountSize, valuePlain)
		}
		if err != nil {
			return err
		}
	}
	if _, ok := w.fresh[w.metaIndex]; !ok || w.metaIndex == 0 {
		blk, err := w.allocMeta()
		if err != nil {
			return err
		}
		if w.metaIndex != 0 {
			if err := w.decMeta(w.metaIndex); err != nil {
				return err
			}
		}
		w.metaIndex = blk
		w.fresh[blk] = freshBlock{b: make([]byte, BlockSize), salt: indexCsumXor}
	}
	nr := uint64(len(w.meta))
	differs := func(i uint64) bool {
		for b := i * entriesPerBitmap; b < min(nr, (i+1)*entriesPerBitmap); b++ {
			if w.meta[b] != w.metaOld[b] {
				return true
			}
		}
		return false
	}
	for again := true; again; {
		again = false
		for i, blk := range w.metaBitmaps {
			if _, ok := w.fresh[blk]; ok && blk != 0 {
				continue
			}
			if blk != 0 && !differs(uint64(i)) {
				continue
			}
			nb, _, err := w.newBitmap(nil)
			if err != nil {
				return err
			}
			if blk != 0 {
				if err := w.decMeta(blk); err != nil {
					return err
				}
			}
			w.metaBitmaps[i] = nb
			again = true
		}
	}
	index := w.fresh[w.metaIndex].b
	binary.LittleEndian.PutUint64(index[8:], w.metaIndex)
	sm.NrAllocated = 0
	for i, blk := range w.metaBitmaps {
		base := uint64(i) * entriesPerBitmap
		n := min(uint64(entriesPerBitmap), nr-base)
		var bm []byte
		if f, ok := w.fresh[blk]; ok {
			bm = f.b
			for j := uint64(0); j < n; j++ {
				setBitmapCount(bm, j, w.meta[base+j])
			}
		} else {
			var err error
			if bm, err = w.old.readBlock(blk, bitmapCsumXor, "metadata space map bitmap"); err != nil {
				return err
			}
		}
		copy(index[indexHeaderSize+i*indexEntrySize:], indexEntry(bm, blk, n))
	}
	for _, c := range w.meta {
		if c != 0 {
			sm.NrAllocated++
		}
	}
	sm.BitmapRoot = w.metaIndex
	return nil
}
