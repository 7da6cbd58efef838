package soak

import (
	"encoding/binary"
	"fmt"
	"math"
	"slices"
	"sync"
)

// Every sector a soak client writes is stamped with the export, the
// sector's index and the writing operation's id, followed by bytes derived
// from those, so any sector read back names the one write it came from (or
// is all zeros) and a torn, misplaced or corrupted sector shows:
//
//	0      8        16     24                                   512
//	| magic | sector | op   | fill(export, sector, op) ...       |
const stampMagic = 0x534f414b53544d50 // "SOAKSTMP"

func fillWord(export uint8, s int64, op uint64, i int) uint64 {
	x := op*0x9E3779B97F4A7C15 ^ uint64(s)<<8 ^ uint64(export) ^ uint64(i)*0xBF58476D1CE4E5B9
	x ^= x >> 31
	return x
}

func stamp(b []byte, export uint8, s int64, op uint64) {
	binary.LittleEndian.PutUint64(b, stampMagic^uint64(export))
	binary.LittleEndian.PutUint64(b[8:], uint64(s))
	binary.LittleEndian.PutUint64(b[16:], op)
	for i := 3; i < sector/8; i++ {
		binary.LittleEndian.PutUint64(b[i*8:], fillWord(export, s, op, i))
	}
}

// decode returns the op a sector of the export came from, 0 for zeros, or
// ok false if it is neither.
func decode(b []byte, export uint8, s int64) (op uint64, ok bool) {
	if binary.LittleEndian.Uint64(b) == 0 {
		for _, v := range b {
			if v != 0 {
				return 0, false
			}
		}
		return 0, true
	}
	if binary.LittleEndian.Uint64(b) != stampMagic^uint64(export) || binary.LittleEndian.Uint64(b[8:]) != uint64(s) {
		return 0, false
	}
	op = binary.LittleEndian.Uint64(b[16:])
	for i := 3; i < sector/8; i++ {
		if binary.LittleEndian.Uint64(b[i*8:]) != fillWord(export, s, op, i) {
			return 0, false
		}
	}
	return op, op != 0
}

// The model of one export. Time is a sequence number the model hands out:
// an operation is issued at one tick and resolved at a later one. For each
// sector it keeps the operations that may still be what the sector holds:
//
//	entry   value    lifetime          kind
//	base    v        [0, 0]            sure      (what the last check found)
//	write   op id    [issue, resolve]  sure      (acknowledged)
//	trim    zeros    [issue, resolve]  maybe     (advisory: old data or zeros)
//	failed  op/zeros [issue, resolve]  maybe     (may or may not have landed)
//	pending op/zeros [issue, +inf)     maybe     (in flight, or orphaned by an abort)
//
// A read issued at r0 and answered at r1 may return an entry's value unless
// the entry was overwritten before r0: a sure entry issued after it was
// resolved, and itself resolved before r0. After a power cut a sector may
// hold an entry's value unless a durable sure entry (FUA, or resolved before
// a successful flush was issued) was issued after it was resolved; a value
// that only such a durable overwrite rules out is a lost flushed write.
type model struct {
	name   string
	export uint8
	mu     sync.Mutex
	now    uint64
	// flushed: every sure entry resolved before it is durable (the issue
	// time of the latest successful flush).
	flushed uint64
	sectors [][]entry
	reads   map[uint64]int // issue times of reads in flight
}

type entry struct {
	op      uint64 // operation id; the value is val
	val     uint64 // op id stamped, 0 for zeros
	issue   uint64
	resolve uint64 // math.MaxUint64 while pending
	sure    bool
	fua     bool // durable on its own
}

const pending = math.MaxUint64

func newModel(name string, export uint8, sectors int64) *model {
	m := &model{name: name, export: export, sectors: make([][]entry, sectors), reads: make(map[uint64]int)}
	for i := range m.sectors {
		m.sectors[i] = []entry{{sure: true, fua: true}}
	}
	return m
}

// tick returns the next time. Called with mu held.
func (m *model) tick() uint64 {
	m.now++
	return m.now
}

// startWrite records a mutating operation in flight over sectors
// [s, s+n): val is the op id for writes and 0 for zeroing and trims.
func (m *model) startWrite(op, val uint64, s, n int64) uint64 {
	m.mu.Lock()
	defer m.mu.Unlock()
	t := m.tick()
	for i := s; i < s+n; i++ {
		m.sectors[i] = append(m.sectors[i], entry{op: op, val: val, issue: t, resolve: pending})
	}
	return t
}

// endWrite resolves it: sure when it succeeded and is not a trim, durable
// on its own with fua.
func (m *model) endWrite(op uint64, s, n int64, sure, fua bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	t := m.tick()
	for i := s; i < s+n; i++ {
		es := m.sectors[i]
		for k := range es {
			if es[k].op == op && es[k].resolve == pending {
				es[k].resolve, es[k].sure, es[k].fua = t, sure, fua && sure
			}
		}
		if sure {
			m.sectors[i] = m.prune(es)
		}
	}
}

// startRead records a read or block status in flight.
func (m *model) startRead() uint64 {
	m.mu.Lock()
	defer m.mu.Unlock()
	t := m.tick()
	m.reads[t]++
	return t
}

// answered returns the time a read's answer arrived. The read stays
// registered, so that nothing it may see is pruned, until doneRead.
func (m *model) answered() uint64 {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.tick()
}

func (m *model) doneRead(r0 uint64) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.reads[r0]--; m.reads[r0] == 0 {
		delete(m.reads, r0)
	}
}

func (m *model) startFlush() uint64 {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.tick()
}

// endFlush records a successful flush issued at t0.
func (m *model) endFlush(t0 uint64) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.flushed = max(m.flushed, t0)
}

func (m *model) durable(e *entry) bool {
	return e.fua || (e.resolve != pending && e.resolve < m.flushed)
}

// overwritten reports whether a sure entry in es issued after e resolved
// was itself resolved before t (and, with durable, is durable).
func (m *model) overwritten(es []entry, e *entry, t uint64, durable bool) bool {
	if e.resolve == pending {
		return false
	}
	for k := range es {
		o := &es[k]
		if o.sure && o.issue > e.resolve && o.resolve < t && (!durable || m.durable(o)) {
			return true
		}
	}
	return false
}

// prune drops the entries no read in flight or to come, and no crash, can
// see any more: overwritten by a durable entry resolved before the oldest
// read in flight. Called with mu held.
func (m *model) prune(es []entry) []entry {
	if *flagNoPrune {
		return es
	}
	oldest := m.now + 1
	for r := range m.reads {
		oldest = min(oldest, r)
	}
	// Decide for every entry before moving any: the test reads them all.
	drop := make([]bool, len(es))
	any := false
	for k := range es {
		drop[k] = m.overwritten(es, &es[k], oldest, true)
		any = any || drop[k]
	}
	if !any {
		return es
	}
	out := es[:0]
	for k := range es {
		if !drop[k] {
			out = append(out, es[k])
		}
	}
	return out
}

// readOK reports whether a read issued at r0 and answered at r1 may see val
// in sector s, and if not, what the sector's entries are.
func (m *model) readOK(s int64, val, r0, r1 uint64) (bool, string) {
	m.mu.Lock()
	defer m.mu.Unlock()
	es := m.sectors[s]
	for k := range es {
		e := &es[k]
		if e.val == val && e.issue < r1 && !m.overwritten(es, e, r0, false) {
			return true, ""
		}
	}
	return false, describe(es, m)
}

// readTornOK reports whether data, read from sector s between ticks r0 and
// r1 and not a whole stamp, is a byte-wise mix of values the read could
// see. A read that overlaps writes of the same sector may return such a mix
// from real files: the kernel copies a page to the reader while another
// request copies into it, and NBD leaves concurrent requests unordered.
// The in-process disk reads and writes whole sectors under a lock and never
// tears; the real binary over real files can.
func (m *model) readTornOK(s int64, data []byte, r0, r1 uint64) bool {
	m.mu.Lock()
	var vals []uint64
	es := m.sectors[s]
	for k := range es {
		e := &es[k]
		if e.issue < r1 && !m.overwritten(es, e, r0, false) {
			vals = append(vals, e.val)
		}
	}
	m.mu.Unlock()
	if len(vals) < 2 {
		return false
	}
	cands := make([][]byte, len(vals))
	for i, v := range vals {
		cands[i] = make([]byte, sector)
		if v != 0 {
			stamp(cands[i], m.export, s, v)
		}
	}
	for i, b := range data[:sector] {
		if !slices.ContainsFunc(cands, func(c []byte) bool { return c[i] == b }) {
			return false
		}
	}
	return true
}

// afterCrash checks what sector s holds after a power cut and a restart:
// any value not overwritten by a durable operation, "lost" if only a
// durable overwrite rules it out. It makes that the sector's only entry.
func (m *model) afterCrash(s int64, val uint64) string { return m.settle(s, val, true, "lost") }

// afterKill checks what sector s holds after the server process was killed
// and restarted: the files keep every write the server made (the page cache
// survives a process), so any value not overwritten by an answered
// operation; "lost acknowledged write" if only an answered overwrite rules
// it out.
func (m *model) afterKill(s int64, val uint64) string {
	return m.settle(s, val, false, "lost acknowledged write")
}

func (m *model) settle(s int64, val uint64, durable bool, lost string) string {
	m.mu.Lock()
	defer m.mu.Unlock()
	es := m.sectors[s]
	verdict := "wrong"
	for k := range es {
		e := &es[k]
		switch {
		case e.val == val && !m.overwritten(es, e, pending, durable):
			verdict = ""
		case e.val == val:
			verdict = lost
		case e.sure && (!durable || m.durable(e)) && val < e.op:
			// An older value whose entry was pruned (op ids grow, zeros
			// are oldest; only a durable overwrite prunes).
			verdict = lost
		default:
			continue
		}
		if verdict == "" {
			break
		}
	}
	if verdict != "" {
		verdict = fmt.Sprintf("%s: sector %d holds op %d; %s", verdict, s, val, describe(es, m))
	}
	m.sectors[s] = append(es[:0], entry{val: val, sure: true, fua: true})
	return verdict
}

// restart forgets the times of the last run: every sector has one entry.
func (m *model) restart() {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.now, m.flushed = 1, 0
	clear(m.reads)
}

func describe(es []entry, m *model) string {
	s := "entries:"
	for _, e := range es {
		res := "pending"
		if e.resolve != pending {
			res = fmt.Sprint(e.resolve)
		}
		s += fmt.Sprintf(" {op %d val %d [%d,%s] sure %v durable %v}", e.op, e.val, e.issue, res, e.sure, m.durable(&e))
	}
	return s
}
