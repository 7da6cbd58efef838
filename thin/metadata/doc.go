// Package metadata reads and writes the on-disk metadata of a thin pool
// in the format of the kernel's dm-thin (drivers/md/dm-thin-metadata.c
// and drivers/md/persistent-data/), the format thin_check, thin_dump and
// thin_restore (thin-provisioning-tools) work on. It is the foundation the
// thin-pool and thin targets stand on: they ask a Pool which data block
// backs a virtual block of a thin device, and record allocations,
// snapshots and discards through a Writer. It only touches the metadata
// device, never the data device.
//
// # Layout
//
// The metadata device is an array of 4 KiB blocks. Every block but the
// superblock starts with a crc32c checksum, xored with a salt per block
// kind, and its own block number:
//
//	block 0: superblock ──┬─ data_mapping_root ──► mapping btree, level 1
//	                      │                         key: thin dev id
//	                      │                         value: root of level 2 ─┐
//	                      │                                                  │
//	                      │   level 2, one btree per thin device ◄───────────┘
//	                      │     key: virtual block
//	                      │     value: data block << 24 | time (24 bits)
//	                      │
//	                      ├─ device_details_root ──► btree
//	                      │     key: thin dev id
//	                      │     value: mapped_blocks, transaction_id,
//	                      │            creation_time, snapshotted_time
//	                      │
//	                      ├─ data space map root ──► index btree ──► bitmaps
//	                      │     key: bitmap number       2 bits a block:
//	                      │     value: bitmap block,     0, 1, 2, or 3 = see
//	                      │            nr_free,          the ref count btree
//	                      │            none_free_before  (block -> le32 count)
//	                      │
//	                      └─ metadata space map root ──► index block ──► bitmaps
//	                            (the same, but its index is a single block of
//	                            at most 255 entries, since a btree's blocks
//	                            would themselves need the space map)
//
// A snapshot shares its origin's level-2 root: both devices' level-1
// values point at the same btree, whose reference count in the metadata
// space map goes up by one; nothing else changes. A data block's count
// is the number of leaves that map it, so blocks gain references only
// when a write copies a shared leaf (see Transactions).
//
// A btree node:
//
//	┌──────────────────────────────┬─────────────┬───────────────────┐
//	│ csum flags blocknr           │ keys        │ values            │
//	│ nr_entries max_entries       │ le64 × max  │ value_size × max  │
//	│ value_size padding; 32 bytes │             │                   │
//	└──────────────────────────────┴─────────────┴───────────────────┘
//
// Internal nodes (flags 1) hold child block numbers; key i is the lowest
// key under child i. Leaves (flags 2) hold the tree's values. All leaves
// of a tree sit at the same depth.
//
// The byte offsets of every structure are in format.go.
//
// # Transactions
//
// A Writer changes the metadata the way the kernel's transaction manager
// does. A block the last commit wrote is never written again before the
// next commit: changing a btree node shadows it, copying it to a block
// that is free both now and at the last commit, and so on up to the root;
// blocks freed in a transaction stay unused until it commits. Commit
// writes the space maps, every new block, syncs, and only then writes the
// superblock and syncs again, so a crash before the superblock lands
// leaves the previous commit whole:
//
//	commit N:   superblock ──► root A ──► leaf B   (A, B are never rewritten)
//	insert:                    root A' ──► leaf B'  (fresh copies)
//	commit N+1: superblock ──► root A' ──► leaf B' (now A, B may be reused)
//
// Shadowing a node that others share (a snapshot's root, before either
// side wrote) copies it and gives each of its children one more
// reference, which is how a snapshot costs one reference count until
// someone writes. The metadata space map records its own blocks: at
// commit, every bitmap whose counts changed moves to a fresh block, which
// may change counts in other bitmaps, until no bitmap is left to move;
// then all of them are filled in.
//
// # Corrupt metadata
//
// The metadata device is input this package does not trust: every block
// read is checked (checksum, its recorded block number, bounds), every
// btree walk is bounded in depth and in the number of nodes it reads, and
// anything wrong comes back as an error wrapping ErrCorrupt that names the
// block, never as a panic or an endless walk.
package metadata
