package metadata

import (
	"errors"
	"fmt"
	"io"
)

// Errors a caller can act on. Every error from this package that comes
// from the bytes on the device wraps ErrCorrupt, and says which block.
var (
	// ErrCorrupt: the metadata breaks the format (bad checksum, a block
	// out of range, a malformed node). thin_check and thin_repair are
	// the tools for it.
	ErrCorrupt = errors.New("thin metadata corrupt")
	// ErrChecksum: a block's checksum does not match; it also wraps ErrCorrupt.
	ErrChecksum = fmt.Errorf("%w: bad checksum", ErrCorrupt)
	// ErrNotThinMetadata: block 0 is not a thin-pool superblock.
	ErrNotThinMetadata = errors.New("not thin-pool metadata")
	// ErrUnsupported: a version or incompat feature this package does not know.
	ErrUnsupported = errors.New("unsupported thin metadata")
	// ErrUnknownDevice: no thin device has the id.
	ErrUnknownDevice = errors.New("unknown thin device")
	// ErrOutOfRange: a block number past the end of its space map.
	ErrOutOfRange = errors.New("block out of range")
)

// Superblock is the decoded block 0.
type Superblock struct {
	Flags             uint32
	UUID              [16]byte
	Version           uint32
	Time              uint32 // current snapshot epoch
	TransactionID     uint64
	HeldRoot          uint64 // block of the metadata snapshot, 0 if none
	DataSpaceMap      SpaceMapRoot
	MetadataSpaceMap  SpaceMapRoot
	DataMappingRoot   uint64
	DeviceDetailsRoot uint64
	DataBlockSize     uint32 // in 512-byte sectors
	MetadataBlockSize uint32 // in 512-byte sectors
	MetadataNrBlocks  uint64
	CompatFlags       uint32
	CompatROFlags     uint32
	IncompatFlags     uint32
}

// SpaceMapRoot is a space map's root as the superblock holds it.
type SpaceMapRoot struct {
	NrBlocks     uint64
	NrAllocated  uint64
	BitmapRoot   uint64
	RefCountRoot uint64
}

func decodeSMRoot(b []byte) SpaceMapRoot {
	return SpaceMapRoot{
		NrBlocks:     le64(b, 0),
		NrAllocated:  le64(b, 8),
		BitmapRoot:   le64(b, 16),
		RefCountRoot: le64(b, 24),
	}
}

// Pool reads the metadata of one thin pool from its metadata device.
// It reads blocks on demand and keeps nothing but the superblock, so a
// walk of any size holds a bounded amount of memory: one block per btree
// level. A Pool is safe for concurrent readers if the device is.
type Pool struct {
	dev io.ReaderAt
	sb  Superblock
	// nrBlocks bounds every metadata block number: the smaller of the
	// superblock's count and the metadata space map's.
	nrBlocks uint64
}

// Open reads and validates the superblock of the metadata device dev,
// which holds size bytes.
func Open(dev io.ReaderAt, size int64) (*Pool, error) {
	if size < BlockSize {
		return nil, fmt.Errorf("%w: device of %d bytes is smaller than one %d-byte block", ErrNotThinMetadata, size, BlockSize)
	}
	b := make([]byte, BlockSize)
	if _, err := dev.ReadAt(b, 0); err != nil {
		return nil, fmt.Errorf("thin metadata: read superblock: %w", err)
	}
	if le64(b, sbMagic) != superblockMagic {
		return nil, fmt.Errorf("%w: superblock magic %d, want %d", ErrNotThinMetadata, le64(b, sbMagic), superblockMagic)
	}
	if !checksumOK(b, superblockCsumXor) {
		return nil, fmt.Errorf("superblock: %w", ErrChecksum)
	}
	sb := Superblock{
		Flags:             le32(b, sbFlags),
		Version:           le32(b, sbVersion),
		Time:              le32(b, sbTime),
		TransactionID:     le64(b, sbTransID),
		HeldRoot:          le64(b, sbHeldRoot),
		DataSpaceMap:      decodeSMRoot(b[sbDataSMRoot:]),
		MetadataSpaceMap:  decodeSMRoot(b[sbMetadataSMRoot:]),
		DataMappingRoot:   le64(b, sbDataMappingRoot),
		DeviceDetailsRoot: le64(b, sbDeviceDetailsRoot),
		DataBlockSize:     le32(b, sbDataBlockSize),
		MetadataBlockSize: le32(b, sbMetadataBlockSize),
		MetadataNrBlocks:  le64(b, sbMetadataNrBlocks),
		CompatFlags:       le32(b, sbCompatFlags),
		CompatROFlags:     le32(b, sbCompatROFlags),
		IncompatFlags:     le32(b, sbIncompatFlags),
	}
	copy(sb.UUID[:], b[sbUUID:sbUUID+16])
	if n := le64(b, sbBlocknr); n != 0 {
		return nil, fmt.Errorf("%w: superblock says it is block %d", ErrCorrupt, n)
	}
	if sb.Version < minVersion || sb.Version > maxVersion {
		return nil, fmt.Errorf("%w: version %d (this reader knows %d..%d)", ErrUnsupported, sb.Version, minVersion, maxVersion)
	}
	// dm-thin-metadata.c refuses incompat features it does not know; it
	// knows none.
	if sb.IncompatFlags != 0 {
		return nil, fmt.Errorf("%w: incompat flags %#x", ErrUnsupported, sb.IncompatFlags)
	}
	if sb.MetadataBlockSize != BlockSize/512 {
		return nil, fmt.Errorf("%w: metadata block size %d sectors, want %d", ErrCorrupt, sb.MetadataBlockSize, BlockSize/512)
	}
	// dm-thin: data blocks are 64 KiB..1 GiB, a multiple of 64 KiB.
	if sb.DataBlockSize < 128 || sb.DataBlockSize > 2097152 || sb.DataBlockSize%128 != 0 {
		return nil, fmt.Errorf("%w: data block size %d sectors", ErrCorrupt, sb.DataBlockSize)
	}
	nr := sb.MetadataNrBlocks
	if sb.MetadataSpaceMap.NrBlocks < nr {
		nr = sb.MetadataSpaceMap.NrBlocks
	}
	if dev := uint64(size) / BlockSize; dev < nr {
		return nil, fmt.Errorf("%w: metadata of %d blocks on a device of %d", ErrCorrupt, nr, dev)
	}
	if nr > maxMetadataBitmaps*entriesPerBitmap {
		return nil, fmt.Errorf("%w: %d metadata blocks, at most %d", ErrCorrupt, nr, maxMetadataBitmaps*entriesPerBitmap)
	}
	if sb.MetadataSpaceMap.NrAllocated > sb.MetadataSpaceMap.NrBlocks {
		return nil, fmt.Errorf("%w: metadata space map has %d of %d blocks allocated", ErrCorrupt, sb.MetadataSpaceMap.NrAllocated, sb.MetadataSpaceMap.NrBlocks)
	}
	if sb.DataSpaceMap.NrAllocated > sb.DataSpaceMap.NrBlocks {
		return nil, fmt.Errorf("%w: data space map has %d of %d blocks allocated", ErrCorrupt, sb.DataSpaceMap.NrAllocated, sb.DataSpaceMap.NrBlocks)
	}
	return &Pool{dev: dev, sb: sb, nrBlocks: nr}, nil
}

// Superblock returns the superblock as Open read it.
func (p *Pool) Superblock() Superblock { return p.sb }

// readBlock reads metadata block n and checks its checksum and its own
// idea of where it lives (the blocknr every block kind but the
// superblock carries at byte 8).
func (p *Pool) readBlock(n uint64, salt uint32, what string) ([]byte, error) {
	if n == 0 || n >= p.nrBlocks {
		return nil, fmt.Errorf("%w: %s at block %d, outside 1..%d", ErrCorrupt, what, n, p.nrBlocks-1)
	}
	b := make([]byte, BlockSize)
	if _, err := p.dev.ReadAt(b, int64(n)*BlockSize); err != nil {
		return nil, fmt.Errorf("thin metadata: read %s block %d: %w", what, n, err)
	}
	if !checksumOK(b, salt) {
		return nil, fmt.Errorf("%s block %d: %w", what, n, ErrChecksum)
	}
	if at := le64(b, 8); at != n {
		return nil, fmt.Errorf("%w: %s block %d says it is block %d", ErrCorrupt, what, n, at)
	}
	return b, nil
}
