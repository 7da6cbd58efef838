package metadata

import (
	"errors"
	"fmt"
)

// SpaceMap reads the reference counts of one of the pool's two space
// maps: the data device's blocks or the metadata device's own.
//
// Both keep 2-bit counts in bitmap blocks, found through an index (for
// the metadata space map one index block, for the data space map a btree
// keyed by bitmap number), and counts of 3 or more in a ref count btree.
type SpaceMap struct {
	p        *Pool
	root     SpaceMapRoot
	metadata bool
	what     string
}

// DataSpaceMap returns the space map of the data device's blocks.
func (p *Pool) DataSpaceMap() *SpaceMap {
	return &SpaceMap{p: p, root: p.sb.DataSpaceMap, what: "data space map"}
}

// MetadataSpaceMap returns the space map of the metadata device's blocks.
func (p *Pool) MetadataSpaceMap() *SpaceMap {
	return &SpaceMap{p: p, root: p.sb.MetadataSpaceMap, metadata: true, what: "metadata space map"}
}

// NrBlocks is the number of blocks the space map covers.
func (s *SpaceMap) NrBlocks() uint64 { return s.root.NrBlocks }

// NrAllocated is the number of blocks with a non-zero count, as the
// space map's root records it.
func (s *SpaceMap) NrAllocated() uint64 { return s.root.NrAllocated }

func (s *SpaceMap) nrBitmaps() uint64 {
	return (s.root.NrBlocks + entriesPerBitmap - 1) / entriesPerBitmap
}

// indexer returns the index entry of bitmap i. For the metadata space
// map it reads the index block once, on first use.
type indexer func(i uint64) (uint64, error)

func (s *SpaceMap) indexer() indexer {
	if !s.metadata {
		return func(i uint64) (uint64, error) {
			v, ok, err := s.p.lookup(s.root.BitmapRoot, i, indexEntrySize, s.what+" index")
			if err != nil {
				return 0, err
			}
			if !ok {
				return 0, fmt.Errorf("%w: %s has no index entry for bitmap %d", ErrCorrupt, s.what, i)
			}
			return le64(v, 0), nil
		}
	}
	var index []byte
	return func(i uint64) (uint64, error) {
		if i >= maxMetadataBitmaps {
			return 0, fmt.Errorf("%w: %s needs bitmap %d, its index holds %d", ErrCorrupt, s.what, i, maxMetadataBitmaps)
		}
		if index == nil {
			b, err := s.p.readBlock(s.root.BitmapRoot, indexCsumXor, s.what+" index")
			if err != nil {
				return 0, err
			}
			index = b
		}
		return le64(index, indexHeaderSize+int(i)*indexEntrySize), nil
	}
}

// bitmapCount is entry j of a bitmap block.
func bitmapCount(b []byte, j uint64) uint32 {
	w := le64(b, bitmapHeaderSize+int(j/32)*8)
	shift := (j % 32) * 2
	return uint32(w>>shift&1)<<1 | uint32(w>>(shift+1)&1)
}

// overflow returns block n's count from the ref count btree, for an
// entry whose bitmap says 3 or more.
func (s *SpaceMap) overflow(n uint64) (uint32, error) {
	v, ok, err := s.p.lookup(s.root.RefCountRoot, n, refCountSize, s.what+" ref count")
	if err != nil {
		return 0, err
	}
	c := uint32(0)
	if ok {
		c = le32(v, 0)
	}
	if c < 3 {
		return 0, fmt.Errorf("%w: %s: block %d overflows its bitmap but its ref count is %d", ErrCorrupt, s.what, n, c)
	}
	return c, nil
}

// Count returns block n's reference count.
func (s *SpaceMap) Count(n uint64) (uint32, error) {
	if n >= s.root.NrBlocks {
		return 0, fmt.Errorf("%s: %w: block %d of %d", s.what, ErrOutOfRange, n, s.root.NrBlocks)
	}
	bm, err := s.indexer()(n / entriesPerBitmap)
	if err != nil {
		return 0, err
	}
	b, err := s.p.readBlock(bm, bitmapCsumXor, s.what+" bitmap")
	if err != nil {
		return 0, err
	}
	if c := bitmapCount(b, n%entriesPerBitmap); c < 3 {
		return c, nil
	}
	return s.overflow(n)
}

// errStopWalk ends a btree walk early; it never leaves this package.
var errStopWalk = errors.New("stop walk")

// overflowed is a count from the ref count btree.
type overflowed struct {
	block uint64
	count uint32
}

// Walk calls fn with every block whose count is not zero, in ascending
// order, until fn returns an error, which it returns. It reads one bitmap
// block at a time, and the ref count btree's entries for that bitmap's
// blocks in one walk (at most one per block of the bitmap).
func (s *SpaceMap) Walk(fn func(block uint64, count uint32) error) error {
	index := s.indexer()
	var over []overflowed
	for i := uint64(0); i < s.nrBitmaps(); i++ {
		bm, err := index(i)
		if err != nil {
			return err
		}
		b, err := s.p.readBlock(bm, bitmapCsumXor, s.what+" bitmap")
		if err != nil {
			return err
		}
		base := i * entriesPerBitmap
		n := min(uint64(entriesPerBitmap), s.root.NrBlocks-base)
		over = over[:0]
		err = s.p.walk(s.root.RefCountRoot, base, refCountSize, s.what+" ref count", func(k uint64, v []byte) error {
			if k-base >= n {
				return errStopWalk
			}
			over = append(over, overflowed{k, le32(v, 0)})
			return nil
		})
		if err != nil && err != errStopWalk {
			return err
		}
		for j := uint64(0); j < n; j++ {
			c := bitmapCount(b, j)
			if c == 0 {
				continue
			}
			if c == 3 {
				for len(over) > 0 && over[0].block < base+j {
					over = over[1:]
				}
				if len(over) == 0 || over[0].block != base+j || over[0].count < 3 {
					return fmt.Errorf("%w: %s: block %d overflows its bitmap but the ref count btree has no count of 3 or more for it", ErrCorrupt, s.what, base+j)
				}
				c = over[0].count
			}
			if err := fn(base+j, c); err != nil {
				return err
			}
		}
	}
	return nil
}
