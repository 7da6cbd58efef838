package soak

import "testing"

// TestModel checks the model's rules on one sector with scripted histories,
// since the soak can only be as right as its model.
func TestModel(t *testing.T) {
	type step func(m *model, ts map[string]uint64)
	write := func(name string, op uint64) step {
		return func(m *model, ts map[string]uint64) { ts[name] = m.startWrite(op, op, 0, 1) }
	}
	zero := func(name string, op uint64) step {
		return func(m *model, ts map[string]uint64) { ts[name] = m.startWrite(op, 0, 0, 1) }
	}
	end := func(op uint64, sure, fua bool) step {
		return func(m *model, ts map[string]uint64) { m.endWrite(op, 0, 1, sure, fua) }
	}
	read := func(name string) step {
		return func(m *model, ts map[string]uint64) { ts[name] = m.startRead() }
	}
	flushed := func() step {
		return func(m *model, ts map[string]uint64) { m.endFlush(m.startFlush()) }
	}
	type want struct {
		read string // the read's name, "" for a read issued and answered now
		val  uint64
		ok   bool
	}
	tests := []struct {
		name  string
		steps []step
		reads []want
		crash map[uint64]string // value -> afterCrash verdict prefix ("" allowed)
	}{
		{
			name:  "answered write overwrites",
			steps: []step{write("w1", 1), end(1, true, false), write("w2", 2), end(2, true, false)},
			reads: []want{{val: 2, ok: true}, {val: 1, ok: false}, {val: 0, ok: false}},
			crash: map[uint64]string{0: "", 1: "", 2: "", 7: "wrong"},
		},
		{
			name:  "a read in flight sees both sides of a write",
			steps: []step{write("w1", 1), end(1, true, false), read("r"), write("w2", 2), end(2, true, false)},
			reads: []want{{read: "r", val: 1, ok: true}, {read: "r", val: 2, ok: true}, {val: 1, ok: false}},
		},
		{
			name:  "a write in flight may or may not be seen",
			steps: []step{write("w1", 1), end(1, true, false), write("w2", 2)},
			reads: []want{{val: 1, ok: true}, {val: 2, ok: true}},
		},
		{
			name:  "a failed write may have landed and overwrites nothing",
			steps: []step{write("w1", 1), end(1, true, false), write("w2", 2), end(2, false, false)},
			reads: []want{{val: 1, ok: true}, {val: 2, ok: true}},
		},
		{
			name:  "a trim leaves old data or zeros",
			steps: []step{write("w1", 1), end(1, true, false), zero("t", 2), end(2, false, false)},
			reads: []want{{val: 1, ok: true}, {val: 0, ok: true}},
		},
		{
			name:  "a flushed write survives a power cut",
			steps: []step{write("w1", 1), end(1, true, false), flushed(), write("w2", 2), end(2, true, false)},
			crash: map[uint64]string{0: "lost", 1: "", 2: ""},
		},
		{
			name:  "a FUA write survives a power cut",
			steps: []step{write("w1", 1), end(1, true, true)},
			crash: map[uint64]string{0: "lost", 1: ""},
		},
		{
			name:  "a flush covers only writes answered before it was sent",
			steps: []step{write("w1", 1), flushed(), end(1, true, false)},
			crash: map[uint64]string{0: "", 1: ""},
		},
		{
			name: "pruning keeps what a read in flight may see",
			steps: []step{write("w1", 1), end(1, true, true), read("r"), write("w2", 2), end(2, true, true),
				write("w3", 3), end(3, true, true)},
			reads: []want{{read: "r", val: 1, ok: true}, {read: "r", val: 3, ok: true}, {val: 1, ok: false}},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			for v, verdict := range tc.crash {
				m := newModel("m", 1, 1)
				ts := map[string]uint64{}
				for _, s := range tc.steps {
					s(m, ts)
				}
				got := m.afterCrash(0, v)
				if len(got) < len(verdict) || got[:len(verdict)] != verdict || (verdict == "" && got != "") {
					t.Errorf("after a power cut, value %d: %q, want %q...", v, got, verdict)
				}
			}
			m := newModel("m", 1, 1)
			ts := map[string]uint64{}
			for _, s := range tc.steps {
				s(m, ts)
			}
			now := m.answered()
			for _, w := range tc.reads {
				r0 := now
				if w.read != "" {
					r0 = ts[w.read]
				}
				if ok, why := m.readOK(0, w.val, r0, now); ok != w.ok {
					t.Errorf("read %q of value %d: %v, want %v (%s)", w.read, w.val, ok, w.ok, why)
				}
			}
		})
	}
}
