package backing

// zeros is the source of every zero-filling write. It is never written, so
// its pages stay the kernel's shared zero page: writing zeros costs no
// memory however many callers do it at once.
var zeros [1 << 20]byte

// WriteZeros makes [off, off+n) of d read back as zeros by writing them, in
// pieces of at most 1 MiB from one shared read-only buffer. It is the
// fallback for devices without native zeroing. d must not modify the slice
// it is given (io.WriterAt already forbids it).
func WriteZeros(d Device, off, n int64) error {
	for end := off + n; off < end; {
		m := min(int64(len(zeros)), end-off)
		if _, err := d.WriteAt(zeros[:m], off); err != nil {
			return err
		}
		off += m
	}
	return nil
}
