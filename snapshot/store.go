package snapshot

import (
	"errors"
	"fmt"
	"math"
	"math/bits"

	"github.com/nbdmapper/nbdmapper/backing"
)

// Errors a caller can test with errors.Is.
var (
	// ErrInvalid is returned for I/O on an invalidated snapshot: its COW
	// filled up (P, N), an exception could not be committed, or the store
	// was marked invalid on disk. dm returns EIO for all of these.
	ErrInvalid = errors.New("snapshot is invalid")
	// ErrOverflow is returned for writes to a PO snapshot whose COW is full;
	// reads still work.
	ErrOverflow = errors.New("snapshot overflowed")
	// ErrCorrupt: the COW device has neither a zero nor a "SnAp" magic.
	ErrCorrupt = errors.New("invalid or corrupt snapshot")
	// ErrVersion: the on-disk version is not 1.
	ErrVersion = errors.New("unsupported snapshot disk version")
	// ErrChunkSize: a chunk size that is 0 where it must be set, not a power
	// of two, or too large.
	ErrChunkSize = errors.New("bad chunk size")
	// ErrCOWSize: the COW device cannot hold the header and the first
	// metadata area.
	ErrCOWSize = errors.New("COW device too small")
	// ErrSameDevice: the COW device is the origin device.
	ErrSameDevice = errors.New("COW device cannot be the same as origin device")
	// ErrCOWInUse: two other loaded snapshots use the COW device already,
	// its owner and a handover destination (dm: "Snapshot cow pairing for
	// exception table handover failed").
	ErrCOWInUse = errors.New("COW device already used by another snapshot and its handover destination")
	// ErrMergeStore: snapshot-merge on a transient (N) store, which has no
	// merge (dm: "Snapshot exception store does not support snapshot-merge").
	ErrMergeStore = errors.New("snapshot exception store does not support snapshot-merge")
	// ErrMerging: a second snapshot-merge on a COW that is merging already.
	ErrMerging = errors.New("a snapshot is already merging")
	// ErrStoreType: the store type is not P, PO or N.
	ErrStoreType = errors.New("exception store type must be P, PO or N")

	errFull  = errors.New("COW device full")
	errBound = errors.New("I/O beyond the end of the COW device")
)

// Type is an exception store type as written in tables.
type Type uint8

const (
	// Persistent (P): exceptions survive restarts; a full COW invalidates.
	Persistent Type = iota
	// PersistentOverflow (PO): as P, but a full COW makes snapshot writes
	// fail ("Overflow") while reads keep working.
	PersistentOverflow
	// Transient (N): exceptions live in memory only.
	Transient
)

func (t Type) String() string {
	switch t {
	case Persistent:
		return "P"
	case PersistentOverflow:
		return "PO"
	case Transient:
		return "N"
	}
	return fmt.Sprintf("type(%d)", uint8(t))
}

// ParseType reads a store type the way dm does: the first letter P or N in
// either case; after P an O (any case) asks for overflow support.
func ParseType(s string) (Type, error) {
	if s == "" {
		return 0, ErrStoreType
	}
	switch s[0] {
	case 'P', 'p':
		if len(s) == 1 {
			return Persistent, nil
		}
		if s[1] == 'O' || s[1] == 'o' {
			return PersistentOverflow, nil
		}
	case 'N', 'n':
		return Transient, nil
	}
	return 0, fmt.Errorf("%w: %q", ErrStoreType, s)
}

// maxChunkSectors is dm's limit (INT_MAX >> SECTOR_SHIFT).
const maxChunkSectors = (1<<31 - 1) >> 9

// CheckChunk validates a chunk size in sectors as dm does.
func CheckChunk(sectors uint32) error {
	switch {
	case sectors == 0 || bits.OnesCount32(sectors) != 1:
		return fmt.Errorf("%w: %d is not a power of 2", ErrChunkSize, sectors)
	case sectors > maxChunkSectors:
		return fmt.Errorf("%w: %d is too high", ErrChunkSize, sectors)
	}
	return nil
}

// store is an exception store on a COW device: the map from origin chunks
// to COW chunks, the allocator of COW chunks, and (persistent only) the
// metadata areas that make both survive a restart. It is not safe for
// concurrent use. Its owner, a Snapshot, guards exc, valid, nextFree and
// shownArea with its mutex; the metadata area itself (area, curArea,
// committed) belongs to whoever commits — one commit leader at a time, or
// the merge — and is touched outside that mutex.
type store struct {
	typ          Type
	cow          backing.Device
	cowSize      int64 // bytes, whole sectors
	chunkSectors uint32
	chunk        int64 // bytes

	valid bool
	exc   map[uint64]uint64 // origin chunk -> COW chunk

	// nextFree is the next COW chunk to allocate. Persistent stores skip
	// metadata chunks; transient ones start at 0.
	nextFree uint64

	// Persistent only.
	perArea   uint64 // E, entries per metadata area
	area      []byte // the current area, as on disk once committed
	curArea   uint64
	committed int // entries used in area
	// shownArea is curArea as status reports it: updated under the
	// owner's mutex once a commit or merge step has moved curArea.
	shownArea uint64
}

// openStore reads (or, when the COW is new, initialises) the exception
// store. chunkSectors is the table's chunk size; a persistent store keeps
// the size in its header and that wins, as in dm.
func openStore(cow backing.Device, typ Type, chunkSectors uint32) (*store, error) {
	s := &store{
		typ:     typ,
		cow:     cow,
		cowSize: cow.Size() &^ 511,
		valid:   true,
		exc:     make(map[uint64]uint64),
	}
	if typ == Transient {
		if chunkSectors == 0 {
			return nil, fmt.Errorf("%w: chunk size not set", ErrChunkSize)
		}
		if err := s.setChunk(chunkSectors); err != nil {
			return nil, err
		}
		return s, nil
	}
	return s, s.readMetadata(chunkSectors)
}

func (s *store) setChunk(sectors uint32) error {
	if err := CheckChunk(sectors); err != nil {
		return err
	}
	s.chunkSectors = sectors
	s.chunk = int64(sectors) * 512
	return nil
}

func (s *store) readMetadata(tableChunk uint32) error {
	var hb [16]byte
	if s.cowSize < int64(len(hb)) {
		return fmt.Errorf("%w: %d bytes", ErrCOWSize, s.cowSize)
	}
	if _, err := s.cow.ReadAt(hb[:], 0); err != nil {
		return fmt.Errorf("read snapshot header: %w", err)
	}
	h := decodeHeader(hb[:])
	switch {
	case h.Magic == 0:
		return s.create(tableChunk)
	case h.Magic != diskMagic:
		return fmt.Errorf("%w: magic %#08x", ErrCorrupt, h.Magic)
	}
	// The header's chunk size overrides the table's.
	if err := s.setChunk(h.ChunkSectors); err != nil {
		return fmt.Errorf("on-disk chunk size: %w", err)
	}
	if s.cowSize < (headerChunks+1)*s.chunk {
		return fmt.Errorf("%w: %d bytes, on-disk chunk size %d sectors", ErrCOWSize, s.cowSize, s.chunkSectors)
	}
	s.perArea = uint64(s.chunk / exceptionSize)
	if h.Version != diskVersion {
		return fmt.Errorf("%w %d", ErrVersion, h.Version)
	}
	if h.Valid == 0 {
		s.valid = false
		return nil
	}
	s.area = make([]byte, s.chunk)
	s.nextFree = headerChunks + 1
	for a := uint64(0); ; a++ {
		if err := s.readChunk(s.area, areaChunk(s.perArea, a)); err != nil {
			return fmt.Errorf("read metadata area %d: %w", a, err)
		}
		s.curArea = a
		full, err := s.insertArea()
		if err != nil {
			return fmt.Errorf("metadata area %d: %w", a, err)
		}
		if !full {
			break
		}
	}
	s.shownArea = s.curArea
	s.nextFree = skipMetadata(s.nextFree, s.perArea)
	return nil
}

// insertArea adds the current area's exceptions to the map and reports
// whether the area is full (and the next one must be read too). An
// exception whose COW chunk is the header, a metadata area or past the
// COW device's end, or whose origin chunk has no byte offset, makes the
// store corrupt: served, it would read the metadata as data, write new
// exceptions' data over it, or grow a COW file without bound.
func (s *store) insertArea() (full bool, err error) {
	chunks := uint64(s.cowSize / s.chunk)
	for i := 0; i < int(s.perArea); i++ {
		e := getException(s.area, i)
		if e.New == 0 {
			s.committed = i
			return false, nil
		}
		switch {
		case e.New%(s.perArea+1) == headerChunks: // New 0, the header, ended the area above
			return false, fmt.Errorf("%w: exception %d maps origin chunk %d to metadata chunk %d", ErrCorrupt, i, e.Old, e.New)
		case e.New >= chunks:
			return false, fmt.Errorf("%w: exception %d maps origin chunk %d to chunk %d, past the COW device's %d", ErrCorrupt, i, e.Old, e.New, chunks)
		case e.Old > uint64(math.MaxInt64/s.chunk):
			return false, fmt.Errorf("%w: exception %d: origin chunk %d is past any device's end", ErrCorrupt, i, e.Old)
		}
		s.nextFree = max(s.nextFree, e.New+1)
		s.exc[e.Old] = e.New
	}
	return true, nil
}

// create writes a new store: a zeroed area 0, then the header.
func (s *store) create(tableChunk uint32) error {
	if tableChunk == 0 {
		tableChunk = defaultChunkSectors
	}
	if err := s.setChunk(tableChunk); err != nil {
		return err
	}
	if s.cowSize < (headerChunks+1)*s.chunk {
		return fmt.Errorf("%w: %d bytes, need %d for the header and the first metadata area",
			ErrCOWSize, s.cowSize, (headerChunks+1)*s.chunk)
	}
	s.perArea = uint64(s.chunk / exceptionSize)
	s.area = make([]byte, s.chunk)
	s.nextFree = headerChunks + 1
	// Area 0 is zeroed and synced before the header that makes it count:
	// a reused COW device may hold an old store's exceptions there, and a
	// crash that kept only the header would serve them as snapshot data.
	if err := s.writeChunk(s.area, areaChunk(s.perArea, 0)); err != nil {
		return fmt.Errorf("zero metadata area 0: %w", err)
	}
	if err := s.cow.Sync(); err != nil {
		return err
	}
	if err := s.writeHeader(); err != nil {
		return err
	}
	return s.cow.Sync()
}

func (s *store) writeHeader() error {
	valid := uint32(0)
	if s.valid {
		valid = 1
	}
	b := make([]byte, s.chunk)
	header{Magic: diskMagic, Valid: valid, Version: diskVersion, ChunkSectors: s.chunkSectors}.encode(b)
	if err := s.writeChunk(b, 0); err != nil {
		return fmt.Errorf("write snapshot header: %w", err)
	}
	return nil
}

func (s *store) readChunk(b []byte, chunk uint64) error {
	return s.io(b, int64(chunk)*s.chunk, false)
}

func (s *store) writeChunk(b []byte, chunk uint64) error {
	return s.io(b, int64(chunk)*s.chunk, true)
}

// io reads or writes the COW device, refusing to go past its end (a file
// would silently grow; a block device would fail).
func (s *store) io(b []byte, off int64, write bool) error {
	if off < 0 || off > s.cowSize || int64(len(b)) > s.cowSize-off {
		return fmt.Errorf("%w: [%d, %d) of %d", errBound, off, off+int64(len(b)), s.cowSize)
	}
	var err error
	if write {
		_, err = s.cow.WriteAt(b, off)
	} else {
		_, err = s.cow.ReadAt(b, off)
	}
	return err
}

// lookup returns the COW chunk holding origin chunk old.
func (s *store) lookup(old uint64) (uint64, bool) {
	n, ok := s.exc[old]
	return n, ok
}

// prepare allocates a COW chunk, or fails with errFull.
func (s *store) prepare() (uint64, error) {
	if s.cowSize < int64(s.nextFree+1)*s.chunk {
		return 0, errFull
	}
	n := s.nextFree
	s.nextFree++
	if s.typ != Transient {
		s.nextFree = skipMetadata(s.nextFree, s.perArea)
	}
	return n, nil
}

// commit writes the metadata of exceptions whose data chunks have been
// written. For a persistent store the order is dm's: the data (and a
// freshly wiped next area) are synced before the metadata that points at
// them is written, and the caller syncs the metadata before it
// acknowledges anything, so an acknowledged write survives a crash and an
// unacknowledged one never leaves an exception pointing at garbage.
//
//	write data chunk(s) -> sync -> write metadata area -> (caller) sync -> ack
//
// Every exception of es shares the syncs and the one metadata write (more
// only where es fills an area). dataSynced says a sync that began after
// the data was written has completed already (the previous commit's final
// sync), so the first sync is not needed. commit does not add es to exc:
// the owner does, under its mutex. On error the caller invalidates the
// store.
func (s *store) commit(es []exception, dataSynced bool) error {
	if s.typ == Transient {
		return nil
	}
	if !dataSynced {
		if err := syncBeforeMetadata(s.cow); err != nil {
			return fmt.Errorf("sync before metadata area %d: %w", s.curArea, err)
		}
	}
	lo, hi := -1, -1
	for _, e := range es {
		putException(s.area, s.committed, e)
		if lo < 0 {
			lo = s.committed
		}
		s.committed++
		hi = s.committed
		if s.committed < int(s.perArea) {
			continue
		}
		// Area full: wipe the next one first, durably, so that a full
		// area on disk is always followed by a terminating one.
		if err := s.writeChunk(make([]byte, s.chunk), areaChunk(s.perArea, s.curArea+1)); err != nil {
			return fmt.Errorf("zero metadata area %d: %w", s.curArea+1, err)
		}
		if err := syncBeforeMetadata(s.cow); err != nil {
			return fmt.Errorf("sync before metadata area %d: %w", s.curArea, err)
		}
		if err := s.writeArea(lo, hi); err != nil {
			return err
		}
		s.curArea++
		s.committed = 0
		clear(s.area)
		lo, hi = -1, -1
	}
	if lo >= 0 {
		return s.writeArea(lo, hi)
	}
	return nil
}

// writeArea writes entries [lo, hi) of the current area, rounded out to
// whole sectors.
func (s *store) writeArea(lo, hi int) error {
	from := int64(lo*exceptionSize) &^ 511
	to := min((int64(hi*exceptionSize)+511)&^511, s.chunk)
	if err := s.io(s.area[from:to], int64(areaChunk(s.perArea, s.curArea))*s.chunk+from, true); err != nil {
		return fmt.Errorf("write metadata area %d: %w", s.curArea, err)
	}
	return nil
}

// flushArea writes entries [lo, hi) of the current area between two syncs
// of the COW device (dm writes the area with PREFLUSH|FUA).
func (s *store) flushArea(lo, hi int) error {
	err := syncBeforeMetadata(s.cow)
	if err == nil {
		err = s.writeArea(lo, hi)
	}
	if err == nil {
		err = s.cow.Sync()
	}
	if err != nil {
		return fmt.Errorf("commit metadata area %d: %w", s.curArea, err)
	}
	return nil
}

// prepareMerge finds the next run of exceptions to merge, dm's
// persistent_prepare_merge: the last committed entry of the current area
// and the entries before it whose origin and COW chunks are both
// consecutive with it, working backwards. It returns the last entry and
// the run's length (0 when no exception is left). When the current area
// is empty it moves back to the previous one, reading it from the COW.
//
//	area entries   ... {40->70} {41->71} {42->72} {9->73}
//	                                             ^ last: run of 1 (9 -> 73)
//	after merging it: {40->70} {41->71} {42->72}  run of 3, ending 42 -> 72
func (s *store) prepareMerge() (last exception, n int, err error) {
	if s.committed == 0 {
		if s.curArea == 0 {
			return exception{}, 0, nil
		}
		s.curArea--
		if err := s.readChunk(s.area, areaChunk(s.perArea, s.curArea)); err != nil {
			return exception{}, 0, fmt.Errorf("read metadata area %d: %w", s.curArea, err)
		}
		s.committed = int(s.perArea)
	}
	last = getException(s.area, s.committed-1)
	for n = 1; n < s.committed; n++ {
		e := getException(s.area, s.committed-1-n)
		if e.Old != last.Old-uint64(n) || e.New != last.New-uint64(n) {
			break
		}
	}
	return last, n, nil
}

// commitMerge clears the last n entries of the current area on disk,
// dm's persistent_commit_merge: the chunks they name have been copied to
// the origin and the origin synced, so a crash from here on does not
// merge them again. It returns the next free chunk as dm then reports
// it: just past the last remaining entry of the current area.
func (s *store) commitMerge(n int) (nextFree uint64, err error) {
	lo := s.committed - n
	clear(s.area[lo*exceptionSize : s.committed*exceptionSize])
	if err := s.flushArea(lo, s.committed); err != nil {
		return 0, err
	}
	s.committed = lo
	return areaChunk(s.perArea, s.curArea) + uint64(s.committed) + 1, nil
}

// invalidate marks the store invalid, on disk too for a persistent store
// (dm's drop_snapshot rewrites the header with valid = 0).
func (s *store) invalidate() error {
	s.valid = false
	if s.typ == Transient {
		return nil
	}
	if err := s.writeHeader(); err != nil {
		return err
	}
	return s.cow.Sync()
}

// usage reports dm's status numbers, in sectors. Called under the owner's
// mutex.
func (s *store) usage() (allocated, total, metadata uint64) {
	total = uint64(s.cowSize / 512)
	allocated = s.nextFree * uint64(s.chunkSectors)
	if s.typ != Transient {
		metadata = (s.shownArea + 1 + headerChunks) * uint64(s.chunkSectors)
	}
	return allocated, total, metadata
}
