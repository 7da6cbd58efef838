package metadata

import (
	"encoding/binary"
	"hash/crc32"
)

// The on-disk layout, as drivers/md/dm-thin-metadata.c and
// drivers/md/persistent-data/ define it. All integers are little-endian.

// BlockSize is the size of every metadata block (THIN_METADATA_BLOCK_SIZE).
const BlockSize = 4096

// Superblock magic and the versions this package reads: the kernel
// accepts THIN_MIN_VERSION 1 to THIN_MAX_VERSION 2, and thin-provisioning-
// tools reads both with this one layout.
const (
	superblockMagic = 27022010
	minVersion      = 1
	maxVersion      = 2
)

// Superblock flags (the flags word at byte 4).
const (
	// FlagNeedsCheck is THIN_METADATA_NEEDS_CHECK_FLAG: the kernel set it
	// after an error and refuses to write until thin_check clears it.
	FlagNeedsCheck = 1 << 0
)

// Checksum salts: each block kind xors its crc32c with its own constant,
// so a block of one kind is never taken for another.
const (
	superblockCsumXor = 160774 // dm-thin-metadata.c SUPERBLOCK_CSUM_XOR
	btreeCsumXor      = 121107 // dm-btree-internal.h BTREE_CSUM_XOR
	bitmapCsumXor     = 240779 // dm-space-map-common.c BITMAP_CSUM_XOR
	indexCsumXor      = 160478 // dm-space-map-common.c INDEX_CSUM_XOR
)

// Superblock, block 0 (struct thin_disk_superblock):
//
//	off  size  field
//	  0     4  csum: crc32c of bytes 4..4095, xor superblockCsumXor
//	  4     4  flags
//	  8     8  blocknr (0)
//	 16    16  uuid
//	 32     8  magic (27022010)
//	 40     4  version
//	 44     4  time: bumped by each snapshot; mapping times are below it
//	 48     8  trans_id: set by userspace (set_transaction_id)
//	 56     8  held_root: metadata snapshot's superblock copy, 0 if none
//	 64   128  data_space_map_root  (sm root, below)
//	192   128  metadata_space_map_root
//	320     8  data_mapping_root: top of the two-level mapping btree
//	328     8  device_details_root
//	336     4  data_block_size, in 512-byte sectors
//	340     4  metadata_block_size, in sectors (8)
//	344     8  metadata_nr_blocks
//	352     4  compat_flags
//	356     4  compat_ro_flags
//	360     4  incompat_flags
const (
	sbFlags             = 4
	sbBlocknr           = 8
	sbUUID              = 16
	sbMagic             = 32
	sbVersion           = 40
	sbTime              = 44
	sbTransID           = 48
	sbHeldRoot          = 56
	sbDataSMRoot        = 64
	sbMetadataSMRoot    = 192
	sbDataMappingRoot   = 320
	sbDeviceDetailsRoot = 328
	sbDataBlockSize     = 336
	sbMetadataBlockSize = 340
	sbMetadataNrBlocks  = 344
	sbCompatFlags       = 352
	sbCompatROFlags     = 356
	sbIncompatFlags     = 360
)

// Space map root, the first 32 of the 128 bytes the superblock keeps for
// each space map (struct disk_sm_root):
//
//	off  size  field
//	  0     8  nr_blocks
//	  8     8  nr_allocated
//	 16     8  bitmap_root: metadata sm: its index block;
//	           data sm: btree of bitmap number -> index entry
//	 24     8  ref_count_root: btree of block -> le32 count, for counts >= 3
const smRootSize = 32

// Index entry, one per bitmap block (struct disk_index_entry), 16 bytes:
//
//	off  size  field
//	  0     8  blocknr of the bitmap
//	  8     4  nr_free
//	 12     4  none_free_before
const indexEntrySize = 16

// Metadata space map index block (struct disk_metadata_index):
//
//	off  size  field
//	  0     4  csum (indexCsumXor)
//	  4     4  padding
//	  8     8  blocknr
//	 16  16*255  index entries (MAX_METADATA_BITMAPS)
const (
	indexHeaderSize    = 16
	maxMetadataBitmaps = 255
)

// Bitmap block (struct disk_bitmap_header, then words):
//
//	off  size  field
//	  0     4  csum (bitmapCsumXor)
//	  4     4  not_used
//	  8     8  blocknr
//	 16  4080  2-bit reference counts, 32 to a little-endian 64-bit word
//
// Entry i of a word occupies bits 2i and 2i+1; bit 2i is the high bit of
// the count and bit 2i+1 the low one (sm_lookup_bitmap). 3 means "3 or more:
// look in the ref count btree".
const (
	bitmapHeaderSize = 16
	entriesPerBitmap = (BlockSize - bitmapHeaderSize) * 4 // 16320
)

// Btree node (struct btree_node):
//
//	off  size  field
//	  0     4  csum (btreeCsumXor)
//	  4     4  flags: 1 internal, 2 leaf
//	  8     8  blocknr
//	 16     4  nr_entries
//	 20     4  max_entries: a multiple of 3 that fits the block
//	 24     4  value_size: 8 in internal nodes (child block numbers)
//	 28     4  padding
//	 32  8*max_entries  keys (le64), sorted
//	 ..  value_size*max_entries  values
//
// Key i of an internal node is the lowest key under child i.
const (
	nodeHeaderSize   = 32
	nodeInternalFlag = 1
	nodeLeafFlag     = 2
)

// Value sizes of the trees.
const (
	mappingValueSize = 8  // le64: data block << 24 | time
	blockValueSize   = 8  // le64 block number (internal nodes, top mapping level)
	detailsValueSize = 24 // struct disk_device_details
	refCountSize     = 4  // le32
)

// Device details (struct disk_device_details), 24 bytes:
//
//	off  size  field
//	  0     8  mapped_blocks
//	  8     8  transaction_id: the pool's trans_id when the device was created
//	 16     4  creation_time
//	 20     4  snapshotted_time
const (
	ddMappedBlocks    = 0
	ddTransactionID   = 8
	ddCreationTime    = 16
	ddSnapshottedTime = 20
)

// A mapping value packs the data block and the 24-bit time of the
// snapshot epoch it was written in.
const mappingTimeBits = 24

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// checksum is dm_bm_checksum over a block's bytes after its csum field:
// the kernel's crc32c(~0, ...) has no final inversion, Go's does, so undo it.
func checksum(block []byte, salt uint32) uint32 {
	return ^crc32.Checksum(block[4:], castagnoli) ^ salt
}

// checksumOK reports whether a block carries the checksum of its kind.
func checksumOK(block []byte, salt uint32) bool {
	return binary.LittleEndian.Uint32(block) == checksum(block, salt)
}

func le32(b []byte, off int) uint32 { return binary.LittleEndian.Uint32(b[off:]) }
func le64(b []byte, off int) uint64 { return binary.LittleEndian.Uint64(b[off:]) }
