package backing

import (
	"sync"
	"sync/atomic"
)

var memIno atomic.Uint64

// Mem is an in-memory device for tests. It is allocated in pages so that
// discarded ranges become holes, as in a sparse file.
type Mem struct {
	name string
	id   ID
	size int64

	mu    sync.RWMutex
	pages map[int64][]byte // page index -> memPage bytes; absent pages are holes
}

const memPage = 4096

var _ Device = (*Mem)(nil)

// NewMem returns a zero-filled in-memory device of size bytes.
func NewMem(name string, size int64) *Mem {
	return &Mem{
		name:  name,
		id:    ID{Dev: ^uint64(0), Ino: memIno.Add(1)},
		size:  size,
		pages: make(map[int64][]byte),
	}
}

func (m *Mem) Name() string   { return m.name }
func (m *Mem) ID() ID         { return m.id }
func (m *Mem) Size() int64    { return m.size }
func (m *Mem) Sync() error    { return nil }
func (m *Mem) Close() error   { return nil }
func (m *Mem) Limits() Limits { return Limits{Granularity: memPage, DiscardZeroes: true} }

func (m *Mem) ReadAt(p []byte, off int64) (int, error) {
	if err := checkRange(m.size, off, int64(len(p))); err != nil {
		return 0, err
	}
	m.mu.RLock()
	defer m.mu.RUnlock()
	m.walk(off, int64(len(p)), func(idx, in, pos, n int64) {
		if pg := m.pages[idx]; pg != nil {
			copy(p[pos:pos+n], pg[in:in+n])
		} else {
			clear(p[pos : pos+n])
		}
	})
	return len(p), nil
}

func (m *Mem) WriteAt(p []byte, off int64) (int, error) {
	if err := checkRange(m.size, off, int64(len(p))); err != nil {
		return 0, err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	m.walk(off, int64(len(p)), func(idx, in, pos, n int64) {
		pg := m.pages[idx]
		if pg == nil {
			pg = make([]byte, memPage)
			m.pages[idx] = pg
		}
		copy(pg[in:in+n], p[pos:pos+n])
	})
	return len(p), nil
}

// Discard drops whole pages inside the range and zeroes partial ones, so
// that discarded data reads back as zeros, like a punched hole.
func (m *Mem) Discard(off, n int64) error { return m.Zero(off, n, true) }

func (m *Mem) Zero(off, n int64, mayPunch bool) error {
	if err := checkRange(m.size, off, n); err != nil {
		return err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	m.walk(off, n, func(idx, in, _, k int64) {
		pg := m.pages[idx]
		switch {
		case pg == nil:
		case mayPunch && k == memPage:
			delete(m.pages, idx)
		default:
			clear(pg[in : in+k])
		}
	})
	return nil
}

func (m *Mem) Holes(off, n int64) ([]Range, error) {
	if err := checkRange(m.size, off, n); err != nil {
		return nil, err
	}
	m.mu.RLock()
	defer m.mu.RUnlock()
	var holes []Range
	m.walk(off, n, func(idx, _, pos, k int64) {
		if m.pages[idx] != nil {
			return
		}
		start := off + pos
		if last := len(holes) - 1; last >= 0 && holes[last].End() == start {
			holes[last].Len += k
			return
		}
		holes = append(holes, Range{Off: start, Len: k})
	})
	return holes, nil
}

// walk calls fn for each page piece of [off, off+n): page index, offset in
// the page, offset in the caller's buffer, and length.
func (m *Mem) walk(off, n int64, fn func(idx, in, pos, n int64)) {
	for pos := int64(0); pos < n; {
		idx, in := (off+pos)/memPage, (off+pos)%memPage
		k := min(memPage-in, n-pos)
		fn(idx, in, pos, k)
		pos += k
	}
}
