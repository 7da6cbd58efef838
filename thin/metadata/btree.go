package metadata

import (
	"fmt"
	"sort"
)

// maxDepth bounds a btree's height. A node holds at least a third of its
// at least 84 (internal) entries, so 2^64 keys need 11 levels; a deeper path
// is a loop in corrupt metadata.
const maxDepth = 16

// node is one decoded btree node, its keys and values still in the block.
type node struct {
	b         []byte
	blocknr   uint64
	leaf      bool
	nr        int
	max       int
	valueSize int
}

func (n node) key(i int) uint64 { return le64(n.b, nodeHeaderSize+8*i) }

func (n node) value(i int) []byte {
	off := nodeHeaderSize + 8*n.max + n.valueSize*i
	return n.b[off : off+n.valueSize]
}

// child is the block an internal node's value i points at.
func (n node) child(i int) uint64 { return le64(n.value(i), 0) }

// readNode reads and checks one node of a btree whose leaves hold values
// of valueSize bytes.
func (p *Pool) readNode(blk uint64, valueSize int, what string) (node, error) {
	b, err := p.readBlock(blk, btreeCsumXor, what+" btree node")
	if err != nil {
		return node{}, err
	}
	n := node{b: b, blocknr: blk, nr: int(le32(b, 16)), max: int(le32(b, 20)), valueSize: int(le32(b, 24))}
	bad := func(format string, args ...any) (node, error) {
		return node{}, fmt.Errorf("%w: %s btree node %d: %s", ErrCorrupt, what, blk, fmt.Sprintf(format, args...))
	}
	switch flags := le32(b, 4); flags {
	case nodeLeafFlag:
		n.leaf = true
		if n.valueSize != valueSize {
			return bad("leaf values of %d bytes, want %d", n.valueSize, valueSize)
		}
	case nodeInternalFlag:
		if n.valueSize != blockValueSize {
			return bad("internal values of %d bytes, want %d", n.valueSize, blockValueSize)
		}
	default:
		return bad("flags %#x are neither internal nor leaf", flags)
	}
	// Compare in int64 so a huge max_entries cannot wrap.
	if uint64(n.max) > BlockSize || nodeHeaderSize+int64(n.max)*int64(8+n.valueSize) > BlockSize {
		return bad("%d entries of %d bytes do not fit a block", n.max, 8+n.valueSize)
	}
	if n.nr > n.max {
		return bad("%d entries, at most %d", n.nr, n.max)
	}
	if !n.leaf && n.nr == 0 {
		return bad("internal node without entries")
	}
	for i := 1; i < n.nr; i++ {
		if n.key(i-1) >= n.key(i) {
			return bad("keys out of order at entry %d", i)
		}
	}
	return n, nil
}

// lookup finds key in the btree rooted at root and returns its value,
// copied out of the block.
func (p *Pool) lookup(root uint64, key uint64, valueSize int, what string) ([]byte, bool, error) {
	return lookupIn(func(blk uint64) (node, error) { return p.readNode(blk, valueSize, what) }, root, key, what)
}

// lookupIn is lookup over the nodes read gives: the committed tree's
// (Pool) or a transaction's (Writer).
func lookupIn(read func(blk uint64) (node, error), root, key uint64, what string) ([]byte, bool, error) {
	blk := root
	for depth := 0; depth < maxDepth; depth++ {
		n, err := read(blk)
		if err != nil {
			return nil, false, err
		}
		if n.leaf {
			i := sort.Search(n.nr, func(i int) bool { return n.key(i) >= key })
			if i == n.nr || n.key(i) != key {
				return nil, false, nil
			}
			return append([]byte(nil), n.value(i)...), true, nil
		}
		// Child i holds the keys from key(i) up to key(i+1).
		i := sort.Search(n.nr, func(i int) bool { return n.key(i) > key }) - 1
		if i < 0 {
			return nil, false, nil
		}
		blk = n.child(i)
	}
	return nil, false, fmt.Errorf("%w: %s btree deeper than %d levels", ErrCorrupt, what, maxDepth)
}

// walk calls fn with every key >= from and its value, in ascending key
// order. The value slice is only valid during the call.
//
// Corrupt metadata cannot make it loop or blow up: every node's keys must
// lie within the range its parent gives it, all leaves sit at one depth,
// and a walk reads at most as many nodes as the metadata has blocks (in a
// sound tree no node has two parents).
func (p *Pool) walk(root uint64, from uint64, valueSize int, what string, fn func(key uint64, value []byte) error) error {
	w := treeWalk{p: p, valueSize: valueSize, what: what, from: from, fn: fn, leafDepth: -1}
	return w.visit(root, 0, 0, 0, false)
}

type treeWalk struct {
	p         *Pool
	valueSize int
	what      string
	from      uint64
	fn        func(uint64, []byte) error
	nodes     uint64
	leafDepth int
}

// visit walks the subtree at blk, whose keys must lie in [lo, hi), or in
// [lo, 2^64) if !bounded.
func (w *treeWalk) visit(blk uint64, depth int, lo, hi uint64, bounded bool) error {
	if depth >= maxDepth {
		return fmt.Errorf("%w: %s btree deeper than %d levels", ErrCorrupt, w.what, maxDepth)
	}
	if w.nodes++; w.nodes > w.p.nrBlocks {
		return fmt.Errorf("%w: %s btree has more nodes than the metadata has blocks", ErrCorrupt, w.what)
	}
	n, err := w.p.readNode(blk, w.valueSize, w.what)
	if err != nil {
		return err
	}
	if n.nr > 0 && (n.key(0) < lo || bounded && n.key(n.nr-1) >= hi) {
		return fmt.Errorf("%w: %s btree node %d: keys %d..%d outside its parent's range", ErrCorrupt, w.what, blk, n.key(0), n.key(n.nr-1))
	}
	if n.leaf {
		if w.leafDepth < 0 {
			w.leafDepth = depth
		} else if w.leafDepth != depth {
			return fmt.Errorf("%w: %s btree leaves at depths %d and %d", ErrCorrupt, w.what, w.leafDepth, depth)
		}
		for i := 0; i < n.nr; i++ {
			if k := n.key(i); k >= w.from {
				if err := w.fn(k, n.value(i)); err != nil {
					return err
				}
			}
		}
		return nil
	}
	for i := 0; i < n.nr; i++ {
		clo, chi, cbounded := n.key(i), hi, bounded
		if i+1 < n.nr {
			chi, cbounded = n.key(i+1), true
		}
		if cbounded && chi <= w.from {
			continue
		}
		if err := w.visit(n.child(i), depth+1, clo, chi, cbounded); err != nil {
			return err
		}
	}
	return nil
}
