package metadata

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"maps"
	"slices"
)

// ErrNoSpace: the metadata or data device has no free block left.
var ErrNoSpace = errors.New("thin pool out of space")

// ErrNeedsCheck: the superblock carries the needs_check flag (set by the
// kernel after a metadata error); like dm-thin, the Writer refuses the
// pool until thin_check has cleared it.
var ErrNeedsCheck = errors.New("thin metadata needs check")

// ErrExists: a thin device with the id already exists.
var ErrExists = errors.New("thin device exists")

// MaxDevID is the largest thin device id dm-thin accepts (24 bits).
const MaxDevID = 1<<24 - 1

// File is a metadata device the Writer can update.
type File interface {
	io.ReaderAt
	io.WriterAt
	Sync() error
}

// freshBlock is a block allocated in the current transaction, held in
// memory until the commit writes it.
type freshBlock struct {
	b    []byte
	salt uint32
}

// Writer changes a pool's metadata in transactions, as the kernel's
// transaction manager does: nothing the last commit wrote is
// overwritten until Commit has written every new block and synced, and
// Commit writes the superblock last. A crash at any point leaves the
// metadata of the last commit intact.
//
// Reference counts of the metadata blocks are kept in memory (4 bytes
// a block: at most 16 MiB for the largest metadata device dm-thin
// takes); data counts changed in the transaction are kept in memory
// over the committed data space map. A Writer is for one goroutine at a
// time.
//
// An error that says nothing was changed (ErrUnknownDevice, ErrExists,
// ErrOutOfRange) leaves the transaction as it was. Any other error (out
// of metadata space, a read error, corrupt metadata) may leave it half
// done: the Writer then returns that error from every call, and the
// device still holds the last commit, to be reopened with OpenWriter.
type Writer struct {
	dev  File
	size int64
	old  *Pool // the last commit; nil until the first one
	sb   Superblock

	meta, metaOld []uint32 // metadata counts now and at the last commit
	metaBitmaps   []uint64 // metadata space map bitmap blocks
	metaIndex     uint64   // metadata space map index block
	fresh         map[uint64]freshBlock
	data          map[uint64]uint32 // data counts changed in this transaction
	metaCursor    uint64
	dataCursor    uint64
	// oldBitmaps caches the committed data bitmaps this transaction read.
	oldBitmaps map[uint64][]byte
	// err is the first error that left the transaction half done; every
	// later call returns it.
	err error
}

// Format writes a new, empty pool to the metadata device dev of size
// bytes, for a data device of nrDataBlocks blocks of dataBlockSize
// sectors, and returns a Writer for it.
func Format(dev File, size int64, dataBlockSize uint32, nrDataBlocks uint64) (*Writer, error) {
	if nrDataBlocks > 1<<(64-mappingTimeBits) {
		return nil, fmt.Errorf("thin metadata: %d data blocks: %w (at most 2^40)", nrDataBlocks, ErrOutOfRange)
	}
	if dataBlockSize < 128 || dataBlockSize > 2097152 || dataBlockSize%128 != 0 {
		return nil, fmt.Errorf("thin metadata: data block size %d sectors is not a multiple of 128 in 128..2097152", dataBlockSize)
	}
	nr := min(uint64(size)/BlockSize, maxMetadataBitmaps*entriesPerBitmap)
	if nr < 16 {
		return nil, fmt.Errorf("thin metadata: a device of %d bytes is too small", size)
	}
	w := &Writer{
		dev: dev, size: size,
		meta: make([]uint32, nr), metaOld: make([]uint32, nr),
		metaBitmaps: make([]uint64, (nr+entriesPerBitmap-1)/entriesPerBitmap),
		fresh:       map[uint64]freshBlock{}, data: map[uint64]uint32{}, oldBitmaps: map[uint64][]byte{},
	}
	w.meta[0] = 1 // the superblock
	w.sb = Superblock{
		Version:           2,
		DataBlockSize:     dataBlockSize,
		MetadataBlockSize: BlockSize / 512,
		MetadataNrBlocks:  nr,
		DataSpaceMap:      SpaceMapRoot{NrBlocks: nrDataBlocks},
		MetadataSpaceMap:  SpaceMapRoot{NrBlocks: nr},
	}
	for _, t := range []struct {
		root *uint64
		vs   int
	}{
		{&w.sb.DataMappingRoot, blockValueSize},
		{&w.sb.DeviceDetailsRoot, detailsValueSize},
		{&w.sb.DataSpaceMap.BitmapRoot, indexEntrySize},
		{&w.sb.DataSpaceMap.RefCountRoot, refCountSize},
		{&w.sb.MetadataSpaceMap.RefCountRoot, refCountSize},
	} {
		n, err := w.newNode(true, t.vs)
		if err != nil {
			return nil, err
		}
		*t.root = n.blk
	}
	if err := w.Commit(); err != nil {
		return nil, err
	}
	return w, nil
}

// OpenWriter opens the pool on dev for changes.
func OpenWriter(dev File, size int64) (*Writer, error) {
	p, err := Open(dev, size)
	if err != nil {
		return nil, err
	}
	if p.sb.Flags&FlagNeedsCheck != 0 {
		return nil, ErrNeedsCheck
	}
	nr := p.nrBlocks
	w := &Writer{
		dev: dev, size: size, old: p, sb: p.sb,
		meta: make([]uint32, nr), metaOld: make([]uint32, nr),
		fresh: map[uint64]freshBlock{}, data: map[uint64]uint32{}, oldBitmaps: map[uint64][]byte{},
	}
	msm := p.MetadataSpaceMap()
	err = msm.Walk(func(b uint64, c uint32) error {
		if b >= nr {
			return fmt.Errorf("%w: metadata space map counts block %d of %d", ErrCorrupt, b, nr)
		}
		w.meta[b] = c
		return nil
	})
	if err != nil {
		return nil, err
	}
	copy(w.metaOld, w.meta)
	w.metaIndex = p.sb.MetadataSpaceMap.BitmapRoot
	index := msm.indexer()
	for i := uint64(0); i < msm.nrBitmaps(); i++ {
		bm, err := index(i)
		if err != nil {
			return nil, err
		}
		if bm == 0 || bm >= nr {
			return nil, fmt.Errorf("%w: metadata space map bitmap %d at block %d of %d", ErrCorrupt, i, bm, nr)
		}
		w.metaBitmaps = append(w.metaBitmaps, bm)
	}
	return w, nil
}

// Pool returns a reader of the metadata as the last commit left it.
func (w *Writer) Pool() *Pool { return w.old }

// readNode reads a node, from this transaction's blocks or the device.
func (w *Writer) readNode(blk uint64, valueSize int) (node, error) {
	f, ok := w.fresh[blk]
	if !ok {
		if w.old == nil {
			return node{}, fmt.Errorf("%w: block %d is not part of the pool", ErrCorrupt, blk)
		}
		n, err := w.old.readNode(blk, valueSize, "btree")
		// The kernel and thin-provisioning-tools size every node alike;
		// splits and merges rely on it.
		if err == nil && n.max != maxEntries(n.valueSize) {
			return node{}, fmt.Errorf("%w: btree node %d: max_entries %d, want %d", ErrCorrupt, blk, n.max, maxEntries(n.valueSize))
		}
		return n, err
	}
	n := wnode{blk: blk, b: f.b}
	return node{b: f.b, blocknr: blk, leaf: n.leaf(), nr: n.nr(), max: n.max(), valueSize: n.valueSize()}, nil
}

// lookup finds key in a tree of this transaction.
func (w *Writer) lookup(root, key uint64, valueSize int) ([]byte, bool, error) {
	return lookupIn(func(blk uint64) (node, error) { return w.readNode(blk, valueSize) }, root, key, "transaction's")
}

// keep records the first error that left the transaction half done.
func (w *Writer) keep(err *error) {
	if *err != nil && w.err == nil {
		w.err = *err
	}
}

// SetTransactionID sets the id userspace gives the next commit.
func (w *Writer) SetTransactionID(id uint64) { w.sb.TransactionID = id }

// Superblock returns the superblock as the next commit would write it.
func (w *Writer) Superblock() Superblock { return w.sb }

func putDetails(d Device) []byte {
	v := make([]byte, detailsValueSize)
	binary.LittleEndian.PutUint64(v[ddMappedBlocks:], d.MappedBlocks)
	binary.LittleEndian.PutUint64(v[ddTransactionID:], d.TransactionID)
	binary.LittleEndian.PutUint32(v[ddCreationTime:], d.CreationTime)
	binary.LittleEndian.PutUint32(v[ddSnapshottedTime:], d.SnapshottedTime)
	return v
}

func put64(x uint64) []byte { return binary.LittleEndian.AppendUint64(nil, x) }

func (w *Writer) details(id uint64) (Device, error) {
	v, ok, err := w.lookup(w.sb.DeviceDetailsRoot, id, detailsValueSize)
	if err != nil {
		return Device{}, err
	}
	if !ok {
		return Device{}, fmt.Errorf("%w: %d", ErrUnknownDevice, id)
	}
	return decodeDevice(id, v), nil
}

func (w *Writer) setDetails(d Device) error {
	root, _, err := w.btreeInsert(w.sb.DeviceDetailsRoot, d.ID, putDetails(d), valuePlain)
	w.sb.DeviceDetailsRoot = root
	return err
}

func (w *Writer) deviceRoot(id uint64) (uint64, error) {
	v, ok, err := w.lookup(w.sb.DataMappingRoot, id, blockValueSize)
	if err != nil {
		return 0, err
	}
	if !ok {
		return 0, fmt.Errorf("%w: %d", ErrUnknownDevice, id)
	}
	return le64(v, 0), nil
}

// setDeviceRoot points device id's entry of the top mapping level at
// root. The reference the entry held moved with the shadowing that
// produced root, so the replaced value needs no release.
func (w *Writer) setDeviceRoot(id, root uint64) error {
	top, _, err := w.btreeInsert(w.sb.DataMappingRoot, id, put64(root), valueSubtree)
	w.sb.DataMappingRoot = top
	return err
}

func (w *Writer) checkNew(id uint64) error {
	if id > MaxDevID {
		return fmt.Errorf("thin device id %d: %w (at most %d)", id, ErrOutOfRange, MaxDevID)
	}
	_, ok, err := w.lookup(w.sb.DeviceDetailsRoot, id, detailsValueSize)
	if err != nil {
		return err
	}
	if ok {
		return fmt.Errorf("%w: %d", ErrExists, id)
	}
	return nil
}

// CreateThin adds an empty thin device (dm's create_thin message).
func (w *Writer) CreateThin(id uint64) (err error) {
	if w.err != nil {
		return w.err
	}
	if err := w.checkNew(id); err != nil {
		return err
	}
	defer w.keep(&err)
	leaf, err := w.newNode(true, mappingValueSize)
	if err != nil {
		return err
	}
	if err := w.setDeviceRoot(id, leaf.blk); err != nil {
		return err
	}
	return w.setDetails(Device{ID: id, TransactionID: w.sb.TransactionID, CreationTime: w.sb.Time, SnapshottedTime: w.sb.Time})
}

// CreateSnap adds thin device id as a snapshot of origin (dm's
// create_snap message): it shares origin's mapping btree, whose root
// gains a reference; the first write to either side copies the path it
// changes. The pool's time moves on, so blocks mapped before now are
// known to be shared.
func (w *Writer) CreateSnap(id, origin uint64) (err error) {
	if w.err != nil {
		return w.err
	}
	if err := w.checkNew(id); err != nil {
		return err
	}
	od, err := w.details(origin)
	if err != nil {
		return err
	}
	root, err := w.deviceRoot(origin)
	if err != nil {
		return err
	}
	defer w.keep(&err)
	if err := w.incMeta(root); err != nil {
		return err
	}
	if err := w.setDeviceRoot(id, root); err != nil {
		return err
	}
	w.sb.Time++
	od.SnapshottedTime = w.sb.Time
	if err := w.setDetails(od); err != nil {
		return err
	}
	return w.setDetails(Device{ID: id, MappedBlocks: od.MappedBlocks, TransactionID: w.sb.TransactionID, CreationTime: w.sb.Time, SnapshottedTime: w.sb.Time})
}

// DeleteDevice removes thin device id and releases what only it used.
func (w *Writer) DeleteDevice(id uint64) (err error) {
	if w.err != nil {
		return w.err
	}
	if _, err := w.details(id); err != nil {
		return err
	}
	defer w.keep(&err)
	top, old, err := w.btreeRemove(w.sb.DataMappingRoot, id, blockValueSize, valueSubtree)
	w.sb.DataMappingRoot = top
	if err != nil {
		return err
	}
	if old == nil {
		return fmt.Errorf("%w: thin device %d has details but no mappings", ErrCorrupt, id)
	}
	if err := w.decTree(le64(old, 0), mappingValueSize, valueMapping); err != nil {
		return err
	}
	root, _, err := w.btreeRemove(w.sb.DeviceDetailsRoot, id, detailsValueSize, valuePlain)
	w.sb.DeviceDetailsRoot = root
	return err
}

// Insert maps virtual block vblock of thin device dev to data block
// dblock, written now, replacing any mapping it had.
func (w *Writer) Insert(dev, vblock, dblock uint64) (err error) {
	if w.err != nil {
		return w.err
	}
	d, err := w.details(dev)
	if err != nil {
		return err
	}
	root, err := w.deviceRoot(dev)
	if err != nil {
		return err
	}
	if dblock >= w.sb.DataSpaceMap.NrBlocks {
		return fmt.Errorf("data block %d: %w (%d blocks)", dblock, ErrOutOfRange, w.sb.DataSpaceMap.NrBlocks)
	}
	defer w.keep(&err)
	if err := w.incData(dblock); err != nil {
		return err
	}
	root, old, err := w.btreeInsert(root, vblock, put64(dblock<<mappingTimeBits|uint64(w.sb.Time&(1<<mappingTimeBits-1))), valueMapping)
	if err != nil {
		return err
	}
	if err := w.setDeviceRoot(dev, root); err != nil {
		return err
	}
	if old != nil {
		return w.decData(le64(old, 0) >> mappingTimeBits)
	}
	d.MappedBlocks++
	return w.setDetails(d)
}

// Remove unmaps virtual block vblock of thin device dev, and reports
// whether it was mapped.
func (w *Writer) Remove(dev, vblock uint64) (_ bool, err error) {
	if w.err != nil {
		return false, w.err
	}
	d, err := w.details(dev)
	if err != nil {
		return false, err
	}
	root, err := w.deviceRoot(dev)
	if err != nil {
		return false, err
	}
	defer w.keep(&err)
	root, old, err := w.btreeRemove(root, vblock, mappingValueSize, valueMapping)
	if err != nil {
		return false, err
	}
	if err := w.setDeviceRoot(dev, root); err != nil {
		return false, err
	}
	if old == nil {
		return false, nil
	}
	if err := w.decData(le64(old, 0) >> mappingTimeBits); err != nil {
		return false, err
	}
	d.MappedBlocks--
	return true, w.setDetails(d)
}

// Commit writes the transaction: the space maps, every new block, a
// sync, then the superblock and a sync. After an error the device still
// holds the last commit (or, if the superblock write itself failed half
// way, whatever the device made of it); drop the Writer and reopen the
// pool with OpenWriter.
func (w *Writer) Commit() (err error) {
	if w.err != nil {
		return w.err
	}
	defer w.keep(&err)
	if err := w.commitDataSpaceMap(); err != nil {
		return err
	}
	if err := w.commitMetadataSpaceMap(); err != nil {
		return err
	}
	for _, blk := range slices.Sorted(maps.Keys(w.fresh)) {
		f := w.fresh[blk]
		binary.LittleEndian.PutUint32(f.b, checksum(f.b, f.salt))
		if _, err := w.dev.WriteAt(f.b, int64(blk)*BlockSize); err != nil {
			return fmt.Errorf("thin metadata: write block %d: %w", blk, err)
		}
	}
	if err := w.dev.Sync(); err != nil {
		return fmt.Errorf("thin metadata: sync: %w", err)
	}
	sb := make([]byte, BlockSize)
	s := &w.sb
	binary.LittleEndian.PutUint32(sb[sbFlags:], s.Flags)
	copy(sb[sbUUID:], s.UUID[:])
	binary.LittleEndian.PutUint64(sb[sbMagic:], superblockMagic)
	binary.LittleEndian.PutUint32(sb[sbVersion:], s.Version)
	binary.LittleEndian.PutUint32(sb[sbTime:], s.Time)
	binary.LittleEndian.PutUint64(sb[sbTransID:], s.TransactionID)
	binary.LittleEndian.PutUint64(sb[sbHeldRoot:], s.HeldRoot)
	for off, r := range map[int]SpaceMapRoot{sbDataSMRoot: s.DataSpaceMap, sbMetadataSMRoot: s.MetadataSpaceMap} {
		binary.LittleEndian.PutUint64(sb[off:], r.NrBlocks)
		binary.LittleEndian.PutUint64(sb[off+8:], r.NrAllocated)
		binary.LittleEndian.PutUint64(sb[off+16:], r.BitmapRoot)
		binary.LittleEndian.PutUint64(sb[off+24:], r.RefCountRoot)
	}
	binary.LittleEndian.PutUint64(sb[sbDataMappingRoot:], s.DataMappingRoot)
	binary.LittleEndian.PutUint64(sb[sbDeviceDetailsRoot:], s.DeviceDetailsRoot)
	binary.LittleEndian.PutUint32(sb[sbDataBlockSize:], s.DataBlockSize)
	binary.LittleEndian.PutUint32(sb[sbMetadataBlockSize:], s.MetadataBlockSize)
	binary.LittleEndian.PutUint64(sb[sbMetadataNrBlocks:], s.MetadataNrBlocks)
	binary.LittleEndian.PutUint32(sb[sbCompatFlags:], s.CompatFlags)
	binary.LittleEndian.PutUint32(sb[sbCompatROFlags:], s.CompatROFlags)
	binary.LittleEndian.PutUint32(sb[sbIncompatFlags:], s.IncompatFlags)
	binary.LittleEndian.PutUint32(sb, checksum(sb, superblockCsumXor))
	if _, err := w.dev.WriteAt(sb, 0); err != nil {
		return fmt.Errorf("thin metadata: write superblock: %w", err)
	}
	if err := w.dev.Sync(); err != nil {
		return fmt.Errorf("thin metadata: sync: %w", err)
	}
	p, err := Open(w.dev, w.size)
	if err != nil {
		return fmt.Errorf("thin metadata: reopen after commit: %w", err)
	}
	w.old = p
	copy(w.metaOld, w.meta)
	clear(w.fresh)
	clear(w.data)
	clear(w.oldBitmaps)
	return nil
}
