package backing

// SparseReader is implemented by devices that can read a range without
// reading its holes: a HoleMap, and the stacked devices above one (a mapped
// device, a snapshot-origin), which pass the call down.
type SparseReader interface {
	// ReadAtSparse reads [off, off+len(p)) as ReadAt does, except for
	// holes: it appends them to holes (device offsets, ascending, inside
	// the range) and leaves their bytes in p as they were; they read as
	// zeros. A hole shorter than minHole is read as data unless it is all
	// of p, and after maxHoles holes the rest is read as data, so that a
	// call makes at most maxHoles+1 reads of the device below.
	ReadAtSparse(p []byte, off, minHole int64, maxHoles int, holes []Range) ([]Range, error)
}

// ReadSparse reads [off, off+len(p)) of d as SparseReader.ReadAtSparse
// does, where d, or a device it wraps, is a SparseReader; otherwise it is
// d.ReadAt, and reports no holes.
func ReadSparse(d Device, p []byte, off, minHole int64, maxHoles int, holes []Range) ([]Range, error) {
	for inner := d; inner != nil && maxHoles > 0; {
		if s, ok := inner.(SparseReader); ok {
			return s.ReadAtSparse(p, off, minHole, maxHoles, holes)
		}
		w, ok := inner.(Wrapper)
		if !ok {
			break
		}
		inner = w.Unwrap()
	}
	_, err := d.ReadAt(p, off)
	return holes, err
}
