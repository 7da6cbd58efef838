package snapshot

import (
	"bytes"
	"fmt"
	"path/filepath"
	"strings"
	"testing"

	"github.com/nbdmapper/nbdmapper/backing"
	"github.com/nbdmapper/nbdmapper/internal/testing/golden"
)

// goldenSeq is a small known sequence of writes on a snapshot and its
// origin; its COW bytes are the golden output. The origin starts with each
// 512-byte sector filled with its index + 1.
type goldenSeq struct {
	name     string
	typ      Type
	chunk    uint32
	origin   int64 // bytes
	cow      int64 // bytes
	features Options
	steps    []goldenStep
}

type goldenStep struct {
	toOrigin bool
	off      int64
	data     []byte
}

func fillByte(b byte, n int) []byte { return bytes.Repeat([]byte{b}, n) }

var goldenSeqs = []goldenSeq{
	{
		name: "P-chunk1", typ: Persistent, chunk: 1, origin: 32 << 10, cow: 24 << 10,
		steps: append([]goldenStep{
			{off: 1000, data: []byte("snap!")},                  // partial chunk 1: copy + overlay
			{toOrigin: true, off: 0, data: fillByte(0xEE, 512)}, // copy-out of chunk 0
			{off: 5 * 512, data: fillByte(0x55, 512)},           // whole chunk 5: no copy
			{off: 1001, data: []byte("again")},                  // chunk 1 again: in place
		}, originTouches(6, 41)...), // 35 copy-outs: area 0 fills, area 1 begins
	},
	{
		name: "P-chunk1-full", typ: Persistent, chunk: 1, origin: 8 << 10, cow: 3 * 512, // header, area 0, one data chunk
		steps: []goldenStep{
			{off: 0, data: []byte("a")},
			{off: 512, data: []byte("b")}, // no room: invalid, header valid = 0
		},
	},
	{
		name: "N-chunk2", typ: Transient, chunk: 2, origin: 8 << 10, cow: 4 << 10,
		steps: []goldenStep{
			{off: 1024 + 7, data: []byte("transient")},
			{toOrigin: true, off: 0, data: []byte("o")},
		},
	},
}

// originTouches writes one byte to each origin chunk in [from, to).
func originTouches(from, to int64) []goldenStep {
	var s []goldenStep
	for c := from; c < to; c++ {
		s = append(s, goldenStep{toOrigin: true, off: c * 512, data: []byte{0xF0}})
	}
	return s
}

// run plays the sequence on fresh devices and returns them.
func (g goldenSeq) run(t *testing.T) (origin, cow *backing.Mem, s *Snapshot) {
	t.Helper()
	origin, cow = newPair(t, g.origin, g.cow)
	opt := g.features
	opt.Type, opt.ChunkSectors = g.typ, g.chunk
	s = open(t, origin, cow, opt)
	o, err := NewOrigin("origin", origin, 0)
	if err != nil {
		t.Fatal(err)
	}
	for _, st := range g.steps {
		var d backing.Device = s
		if st.toOrigin {
			d = o
		}
		d.WriteAt(st.data, st.off) // errors are part of the story (full COW)
	}
	return origin, cow, s
}

// TestGoldenCOW compares the COW device's bytes after each sequence with
// testdata/<name>.cow.txt, a hexdump -C style listing.
func TestGoldenCOW(t *testing.T) {
	for _, g := range goldenSeqs {
		t.Run(g.name, func(t *testing.T) {
			_, cow, s := g.run(t)
			raw := make([]byte, cow.Size())
			if _, err := cow.ReadAt(raw, 0); err != nil {
				t.Fatal(err)
			}
			got := fmt.Sprintf("# %s: status %s\n%s", g.name, s.Status(), hexdump(raw))
			golden.Check(t, filepath.Join("testdata", g.name+".cow.txt"), got)
		})
	}
}

// hexdump renders b as `hexdump -C` does: 16 bytes a line, a line equal to
// the previous one collapsed into "*", and the total length at the end.
func hexdump(b []byte) string {
	var sb strings.Builder
	var prev []byte
	starred := false
	for off := 0; off < len(b); off += 16 {
		line := b[off:min(off+16, len(b))]
		if prev != nil && bytes.Equal(line, prev) {
			if !starred {
				sb.WriteString("*\n")
				starred = true
			}
			continue
		}
		starred = false
		prev = line
		fmt.Fprintf(&sb, "%08x ", off)
		for i := 0; i < 16; i++ {
			if i == 8 {
				sb.WriteByte(' ')
			}
			if i < len(line) {
				fmt.Fprintf(&sb, " %02x", line[i])
			} else {
				sb.WriteString("   ")
			}
		}
		sb.WriteString("  |")
		for _, c := range line {
			if c < 0x20 || c > 0x7e {
				c = '.'
			}
			sb.WriteByte(c)
		}
		sb.WriteString("|\n")
	}
	fmt.Fprintf(&sb, "%08x\n", len(b))
	return sb.String()
}
