package metadata

import (
	"bytes"
	"encoding/binary"
	"errors"
	"os"
	"testing"
)

// readAll reads everything the metadata holds, as a pool's user would:
// every device, its mappings and a lookup, and both space maps.
func readAll(img []byte) error {
	p, err := Open(bytes.NewReader(img), int64(len(img)))
	if err != nil {
		return err
	}
	var devs []uint64
	if err := p.WalkDevices(func(d Device) error { devs = append(devs, d.ID); return nil }); err != nil {
		return err
	}
	// The mapping tree may name devices the details tree lacks.
	err = p.walk(p.sb.DataMappingRoot, 0, blockValueSize, "mapping", func(id uint64, _ []byte) error {
		devs = append(devs, id)
		return nil
	})
	if err != nil {
		return err
	}
	for _, id := range devs {
		if _, err := p.Device(id); err != nil {
			return err
		}
		if err := p.WalkMappings(id, 0, func(Mapping) error { return nil }); err != nil {
			return err
		}
		if _, _, err := p.Lookup(id, 1); err != nil {
			return err
		}
	}
	for _, sm := range []*SpaceMap{p.DataSpaceMap(), p.MetadataSpaceMap()} {
		if err := sm.Walk(func(uint64, uint32) error { return nil }); err != nil {
			return err
		}
		// Walk reads the ref count btree only where a bitmap says 3.
		if err := p.walk(sm.root.RefCountRoot, 0, refCountSize, "ref count", func(uint64, []byte) error { return nil }); err != nil {
			return err
		}
		if _, err := sm.Count(0); err != nil && !errors.Is(err, ErrOutOfRange) {
			return err
		}
	}
	return nil
}

// clearError reports whether err is one a caller can act on: nil or one
// of the package's sentinels.
func clearError(err error) bool {
	if err == nil {
		return true
	}
	for _, s := range []error{ErrCorrupt, ErrNotThinMetadata, ErrUnsupported, ErrUnknownDevice, ErrOutOfRange} {
		if errors.Is(err, s) {
			return true
		}
	}
	return false
}

// smallImage is testdata/small.xml restored, with the salt of each
// block that holds metadata.
type smallImage struct {
	img   []byte
	used  []uint64          // blocks with a valid checksum, ascending
	salts map[uint64]uint32 // their kinds
}

func loadSmallImage(t testing.TB) *smallImage {
	t.Helper()
	img, err := os.ReadFile(restoreFile(t, "testdata/small.xml", 1<<20))
	if err != nil {
		t.Fatal(err)
	}
	s := &smallImage{img: img, salts: map[uint64]uint32{}}
	for b := uint64(0); b < uint64(len(img))/BlockSize; b++ {
		blk := img[b*BlockSize : (b+1)*BlockSize]
		for _, salt := range []uint32{superblockCsumXor, btreeCsumXor, bitmapCsumXor, indexCsumXor} {
			if checksumOK(blk, salt) {
				s.used = append(s.used, b)
				s.salts[b] = salt
			}
		}
	}
	if len(s.used) < 10 {
		t.Fatalf("small image has %d metadata blocks", len(s.used))
	}
	return s
}

// resign gives block b of img a valid checksum again.
func (s *smallImage) resign(img []byte, b uint64) {
	blk := img[b*BlockSize : (b+1)*BlockSize]
	binary.LittleEndian.PutUint32(blk, checksum(blk, s.salts[b]))
}

// TestCorruptBlockChecksum flips one byte in each block that holds
// metadata: reading the pool must then fail with ErrChecksum (the whole
// read reaches every such block).
func TestCorruptBlockChecksum(t *testing.T) {
	s := loadSmallImage(t)
	if err := readAll(s.img); err != nil {
		t.Fatal(err)
	}
	for _, b := range s.used {
		img := bytes.Clone(s.img)
		img[b*BlockSize+100] ^= 0x10
		if err := readAll(img); !errors.Is(err, ErrChecksum) {
			t.Errorf("byte 100 of block %d flipped: got %v, want ErrChecksum", b, err)
		}
	}
}

// TestCorruptFields overwrites each header field and the first keys of
// every metadata block, and every field of the superblock, and signs the
// block again, so the corruption passes the checksum and reaches the
// decoders: they must return a clear error or read a consistent pool, and
// never panic. (FuzzCorrupt goes further at random.)
func TestCorruptFields(t *testing.T) {
	s := loadSmallImage(t)
	img := bytes.Clone(s.img)
	failures := 0
	for _, b := range s.used {
		blk := img[b*BlockSize : (b+1)*BlockSize]
		end := 72
		if b == 0 {
			end = sbIncompatFlags + 4
		}
		for off := 4; off < end; off++ {
			old, csum := blk[off], binary.LittleEndian.Uint32(blk)
			for _, v := range []byte{0x00, 0x01, 0xff} {
				if v == old {
					continue
				}
				blk[off] = v
				s.resign(img, b)
				err := readAll(img)
				if !clearError(err) {
					t.Fatalf("block %d byte %d = %#x: unclear error %v", b, off, v, err)
				}
				if err != nil {
					failures++
				}
			}
			blk[off] = old
			binary.LittleEndian.PutUint32(blk, csum)
		}
	}
	if failures == 0 {
		t.Fatal("no corruption was detected")
	}
	t.Logf("%d of the corruptions were reported", failures)
}

// FuzzCorrupt applies up to 64 byte changes to the metadata blocks of
// the small pool, signing the blocks again when the first byte is odd, and
// reads the whole pool.
func FuzzCorrupt(f *testing.F) {
	s := loadSmallImage(f)
	f.Add([]byte{})
	f.Add([]byte{1, 16, 0, 0, 0, 0xff})               // block 0 byte 16 -> 0xff, re-signed
	f.Add([]byte{1, 20, 0x10, 0, 0, 0x7f})            // a node's max_entries
	f.Add([]byte{1, 8, 0x20, 0, 0, 3, 9, 0, 0, 0, 1}) // a node's blocknr and a key
	f.Add([]byte{0, 0, 0x30, 0, 0, 0xaa})
	f.Fuzz(func(t *testing.T, data []byte) {
		if len(data) == 0 {
			if err := readAll(s.img); err != nil {
				t.Fatal(err)
			}
			return
		}
		resign := data[0]&1 == 1
		img := bytes.Clone(s.img)
		touched := map[uint64]bool{}
		for rec := data[1:]; len(rec) >= 5 && len(touched) < 64; rec = rec[5:] {
			x := binary.LittleEndian.Uint32(rec)
			b := s.used[int(x/BlockSize)%len(s.used)]
			img[b*BlockSize+uint64(x%BlockSize)] = rec[4]
			touched[b] = true
		}
		if resign {
			for b := range touched {
				s.resign(img, b)
			}
		}
		if err := readAll(img); !clearError(err) {
			t.Fatalf("unclear error: %v", err)
		}
	})
}

// memFile is a metadata device in memory.
type memFile struct{ b []byte }

func (f *memFile) ReadAt(p []byte, off int64) (int, error) {
	if off < 0 || off+int64(len(p)) > int64(len(f.b)) {
		return 0, errors.New("memFile: read past the end")
	}
	return copy(p, f.b[off:]), nil
}

func (f *memFile) WriteAt(p []byte, off int64) (int, error) {
	if off < 0 || off+int64(len(p)) > int64(len(f.b)) {
		return 0, errors.New("memFile: write past the end")
	}
	return copy(f.b[off:], p), nil
}

func (f *memFile) Sync() error { return nil }

// writeAll changes a pool as the thin targets would, and reads it back.
func writeAll(img []byte) error {
	f := &memFile{b: img}
	w, err := OpenWriter(f, int64(len(img)))
	if err != nil {
		return err
	}
	steps := []func() error{
		func() error { return w.CreateSnap(50, 1) },
		func() error { return w.CreateThin(51) },
		func() error {
			b, err := w.AllocData()
			if err != nil {
				return err
			}
			return w.Insert(1, 10, b)
		},
		func() error { _, err := w.Remove(2, 5); return err },
		func() error { _, err := w.Remove(1, 999); return err },
		func() error { return w.DeleteDevice(3) },
		func() error { return w.DeleteDevice(50) },
		w.Commit,
	}
	for _, step := range steps {
		if err := step(); err != nil && !clearError(err) && !errors.Is(err, ErrExists) && !errors.Is(err, ErrNoSpace) {
			return err
		}
	}
	return readAll(img)
}

// FuzzWriterCorrupt opens a corrupted pool for writing and changes it:
// every error must be a clear one, and nothing may panic.
func FuzzWriterCorrupt(f *testing.F) {
	s := loadSmallImage(f)
	f.Add([]byte{})
	f.Add([]byte{1, 16, 0x10, 0, 0, 0x7f})
	f.Add([]byte{1, 32, 0x20, 0, 0, 3, 40, 0x20, 0, 0, 9})
	f.Fuzz(func(t *testing.T, data []byte) {
		img := bytes.Clone(s.img)
		if len(data) > 0 {
			touched := map[uint64]bool{}
			for rec := data[1:]; len(rec) >= 5 && len(touched) < 64; rec = rec[5:] {
				x := binary.LittleEndian.Uint32(rec)
				b := s.used[int(x/BlockSize)%len(s.used)]
				img[b*BlockSize+uint64(x%BlockSize)] = rec[4]
				touched[b] = true
			}
			if data[0]&1 == 1 {
				for b := range touched {
					s.resign(img, b)
				}
			}
		}
		err := writeAll(img)
		if len(data) == 0 && err != nil {
			t.Fatal(err)
		}
		if !clearError(err) && !errors.Is(err, ErrExists) && !errors.Is(err, ErrNoSpace) && !errors.Is(err, ErrNeedsCheck) {
			t.Fatalf("unclear error: %v", err)
		}
	})
}
