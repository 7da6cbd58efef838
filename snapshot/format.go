package snapshot

import "encoding/binary"

// On-disk layout of dm-snapshot's persistent exception store (P and PO),
// as drivers/md/dm-snap-persistent.c writes it. All integers little-endian;
// C is the chunk size in sectors, chunk n starts at byte n*C*512.
//
//	chunk 0            header (rest of the chunk zero)
//	                     off 0  le32 magic      0x70416e53 ("SnAp")
//	                     off 4  le32 valid      1, or 0 once invalidated
//	                     off 8  le32 version    1
//	                     off 12 le32 chunk_size C, in sectors
//	chunk 1            metadata area 0: E = C*512/16 entries
//	                     { le64 old_chunk (origin), le64 new_chunk (COW) }
//	                     the first entry with new_chunk 0 ends the list
//	chunks 2..E+1      data chunks of area 0
//	chunk E+2          metadata area 1
//	...                area i at chunk 1 + i*(E+1), its data after it
//
// Worked example, C = 1 (512-byte chunks, E = 32):
//
//	chunk:  0    1      2 .. 33     34     35 .. 66    67
//	        hdr  area0  data(32)    area1  data(32)    area2 ...
//
// The first data chunk handed out is 2; after chunk 33 the allocator skips
// 34 (area 1's metadata) and hands out 35. A magic of 0 means a new store:
// the header is written and area 0 zeroed. Any other magic is an error.
const (
	diskMagic   = 0x70416e53
	diskVersion = 1

	headerChunks  = 1  // chunks before area 0 (NUM_SNAPSHOT_HDR_CHUNKS)
	exceptionSize = 16 // bytes per {old_chunk, new_chunk} entry

	// defaultChunkSectors is DM_CHUNK_SIZE_DEFAULT_SECTORS: the chunk size
	// of a new persistent store whose table says 0.
	defaultChunkSectors = 32
)

// header is the first 16 bytes of chunk 0.
type header struct {
	Magic, Valid, Version, ChunkSectors uint32
}

func (h header) encode(chunk []byte) {
	clear(chunk)
	binary.LittleEndian.PutUint32(chunk[0:], h.Magic)
	binary.LittleEndian.PutUint32(chunk[4:], h.Valid)
	binary.LittleEndian.PutUint32(chunk[8:], h.Version)
	binary.LittleEndian.PutUint32(chunk[12:], h.ChunkSectors)
}

func decodeHeader(b []byte) header {
	return header{
		Magic:        binary.LittleEndian.Uint32(b[0:]),
		Valid:        binary.LittleEndian.Uint32(b[4:]),
		Version:      binary.LittleEndian.Uint32(b[8:]),
		ChunkSectors: binary.LittleEndian.Uint32(b[12:]),
	}
}

// exception maps origin chunk Old to COW chunk New (absolute on the COW).
type exception struct {
	Old, New uint64
}

func putException(area []byte, i int, e exception) {
	binary.LittleEndian.PutUint64(area[i*exceptionSize:], e.Old)
	binary.LittleEndian.PutUint64(area[i*exceptionSize+8:], e.New)
}

func getException(area []byte, i int) exception {
	return exception{
		Old: binary.LittleEndian.Uint64(area[i*exceptionSize:]),
		New: binary.LittleEndian.Uint64(area[i*exceptionSize+8:]),
	}
}

// areaChunk is the COW chunk holding metadata area i.
func areaChunk(perArea uint64, i uint64) uint64 { return headerChunks + i*(perArea+1) }

// skipMetadata moves a free-chunk cursor off a metadata chunk.
func skipMetadata(next, perArea uint64) uint64 {
	if next%(perArea+1) == headerChunks {
		next++
	}
	return next
}
