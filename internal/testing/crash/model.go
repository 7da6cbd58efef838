package crash

import (
	"encoding/binary"
	"fmt"
	"sync"
)

// Model is what the clients of a workload were promised, per virtual
// device (a view: one export, as its clients see it), per sector: every
// version written there, when each was acknowledged, and which flush or
// FUA reply made it durable. Check compares a crash image with it.
//
// Every sector a workload writes is self-describing (Pattern): its
// first 16 bytes name the write and the sector, the rest is derived from
// both, so a sector read back from a crash image tells which version it
// is, or that it is none (garbage: an exception pointing at an unwritten
// chunk, a torn sector).
//
// A flush covers the writes to its view acknowledged before it was sent,
// on any connection; once its reply is in the log (position pos), a crash
// after pos must keep them, or newer versions:
//
//	sector 7:  v0 (initial)   v1 ack 3   v2 ack 5   v3 ack 8
//	flush sent after ack 5, replied at log position 40
//	crash at 39: v0, v1, v2 or v3 may be there
//	crash at 41: v2 or v3 (v1 or v0 would be a lost write)
type Model struct {
	mu     sync.Mutex
	acks   uint64
	nextID uint64
	views  map[string]*view
}

type view struct {
	sectors [][]version // per sector, oldest first; [0] is the initial contents
	flushes []flushRec
}

type version struct {
	id    uint64
	ack   uint64 // 0 until acknowledged
	fuaAt int    // log position of a FUA write's reply, -1 otherwise
}

type flushRec struct {
	covers uint64 // acks before the flush was sent
	at     int    // log position of its reply
}

// NewModel returns a model with no views.
func NewModel() *Model { return &Model{views: make(map[string]*view)} }

// AddView adds a view of size bytes whose sectors initially hold
// Pattern(0, sector): the caller writes them so before the workload.
func (m *Model) AddView(name string, size int64) {
	m.mu.Lock()
	defer m.mu.Unlock()
	v := &view{sectors: make([][]version, size/SectorSize)}
	for i := range v.sectors {
		v.sectors[i] = []version{{fuaAt: -1}}
	}
	m.views[name] = v
}

// Write is a write a client is about to send.
type Write struct {
	View string
	Off  int64
	Data []byte
	id   uint64
}

// Begin registers a write of n bytes at off (both whole sectors) to view
// and returns it with its data. Writes to one sector must be sent in the
// order they are begun, and not concurrently.
func (m *Model) Begin(viewName string, off int64, n int) *Write {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.nextID++
	w := &Write{View: viewName, Off: off, Data: make([]byte, n), id: m.nextID}
	v := m.views[viewName]
	for i := 0; i < n/SectorSize; i++ {
		s := off/SectorSize + int64(i)
		v.sectors[s] = append(v.sectors[s], version{id: w.id, fuaAt: -1})
		Pattern(w.id, uint64(s), w.Data[i*SectorSize:(i+1)*SectorSize])
	}
	return w
}

// Acked records w's success reply; a FUA write's reply was at log position
// pos.
func (m *Model) Acked(w *Write, fua bool, pos int) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.acks++
	v := m.views[w.View]
	for i := 0; i < len(w.Data)/SectorSize; i++ {
		vs := v.sectors[w.Off/SectorSize+int64(i)]
		for j := len(vs) - 1; j >= 0; j-- {
			if vs[j].id == w.id {
				vs[j].ack = m.acks
				if fua {
					vs[j].fuaAt = pos
				}
				break
			}
		}
	}
}

// FlushSent returns what a flush sent now covers, for Flushed.
func (m *Model) FlushSent() uint64 {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.acks
}

// Flushed records the success reply, at log position pos, of a flush of
// view that covers what FlushSent returned.
func (m *Model) Flushed(viewName string, covers uint64, pos int) {
	m.mu.Lock()
	defer m.mu.Unlock()
	v := m.views[viewName]
	v.flushes = append(v.flushes, flushRec{covers: covers, at: pos})
}

// FlushPositions lists the log positions of every flush reply and FUA
// write reply, the moments at which the promises change.
func (m *Model) FlushPositions() []int {
	m.mu.Lock()
	defer m.mu.Unlock()
	var ps []int
	for _, v := range m.views {
		for _, f := range v.flushes {
			ps = append(ps, f.at)
		}
		for _, vs := range v.sectors {
			for _, x := range vs {
				if x.fuaAt >= 0 {
					ps = append(ps, x.fuaAt)
				}
			}
		}
	}
	return ps
}

// Result is what Check found in one view of one crash image.
type Result struct {
	Sectors  int // sectors checked
	Required int // sectors whose required version is a write, not the initial contents
	// Lost counts sectors missing a durable version: an older version
	// (Stale), no version at all (Garbage), or one never written to this
	// view (Foreign).
	Lost, Stale, Garbage, Foreign int
	First                         string // the first lost sector, described
}

// Add adds o's counts to r, keeping r's First if it has one.
func (r *Result) Add(o Result) {
	r.Sectors += o.Sectors
	r.Required += o.Required
	r.Lost += o.Lost
	r.Stale += o.Stale
	r.Garbage += o.Garbage
	r.Foreign += o.Foreign
	if r.First == "" {
		r.First = o.First
	}
}

// Check compares data, the whole of a view read back from a crash image
// at log position pos, with the model: each sector must hold the newest
// version made durable by a flush or FUA reply before pos, or a newer one.
func (m *Model) Check(viewName string, pos int, data []byte) Result {
	m.mu.Lock()
	defer m.mu.Unlock()
	v := m.views[viewName]
	var durable uint64
	for _, f := range v.flushes {
		if f.at <= pos {
			durable = max(durable, f.covers)
		}
	}
	var r Result
	for s, vs := range v.sectors {
		r.Sectors++
		req := 0
		for j := len(vs) - 1; j > 0; j-- {
			x := vs[j]
			if (x.ack != 0 && x.ack <= durable) || (x.fuaAt >= 0 && x.fuaAt <= pos) {
				req = j
				break
			}
		}
		if req > 0 {
			r.Required++
		}
		got := data[s*SectorSize : (s+1)*SectorSize]
		id, ok := Identify(uint64(s), got)
		at := -1
		for j, x := range vs {
			if ok && x.id == id {
				at = j
				break
			}
		}
		if at >= req {
			continue
		}
		r.Lost++
		what := ""
		switch {
		case !ok:
			r.Garbage++
			what = fmt.Sprintf("garbage %x...", got[:16])
		case at < 0:
			r.Foreign++
			what = fmt.Sprintf("write %d, which never wrote this sector of this view", id)
		default:
			r.Stale++
			what = fmt.Sprintf("version %d of %d (write %d)", at, len(vs)-1, id)
		}
		if r.First == "" {
			r.First = fmt.Sprintf("%s sector %d: want version %d of %d (write %d, ack %d, fua at %d; flushed acks <= %d) or newer, found %s",
				viewName, s, req, len(vs)-1, vs[req].id, vs[req].ack, vs[req].fuaAt, durable, what)
		}
	}
	return r
}

// Pattern fills p (one sector) with write id's contents for sector s:
//
//	off 0   le64 id      (0: the contents before the workload)
//	off 8   le64 sector
//	off 16  496 bytes of xorshift64 seeded from both
func Pattern(id, s uint64, p []byte) {
	binary.LittleEndian.PutUint64(p[0:], id)
	binary.LittleEndian.PutUint64(p[8:], s)
	x := id*0x9E3779B97F4A7C15 ^ s*0xC2B2AE3D27D4EB4F | 1
	for i := 16; i < SectorSize; i += 8 {
		x ^= x << 13
		x ^= x >> 7
		x ^= x << 17
		binary.LittleEndian.PutUint64(p[i:], x)
	}
}

// Identify returns the write whose Pattern p is for sector s, if it is one.
func Identify(s uint64, p []byte) (uint64, bool) {
	id := binary.LittleEndian.Uint64(p)
	if binary.LittleEndian.Uint64(p[8:]) != s {
		return 0, false
	}
	var want [SectorSize]byte
	Pattern(id, s, want[:])
	return id, string(want[:]) == string(p)
}
