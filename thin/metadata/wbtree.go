package metadata

import (
	"encoding/binary"
	"fmt"
	"sort"
)

// Btree updates with shadowing, as persistent-data/dm-btree.c does them:
// every node on the path from the root to the changed leaf is shadowed
// (copied to a block allocated in this transaction, unless it already was
// and nobody else refers to it), so the tree the last commit wrote stays
// intact until the next superblock points at the new one.
//
// Inserts split a full node before descending into it, so a split never
// has to travel back up; removes top up a child that is at its minimum
// (a third of max_entries, which thin_check requires of every node but
// the root) from a sibling before descending, merging the two when they
// fit in one node.

// valueKind says what a leaf's values refer to, so shadowing a shared
// node and dropping the last reference to one can count references.
type valueKind int

const (
	valuePlain   valueKind = iota // no references (details, space map trees)
	valueSubtree                  // a metadata block: a thin device's mapping root
	valueMapping                  // a data block << 24 | time
)

// maxEntries is calc_max_entries: as many entries as fit, rounded down
// to a multiple of 3.
func maxEntries(valueSize int) int {
	return (BlockSize - nodeHeaderSize) / (8 + valueSize) / 3 * 3
}

// wnode is a writable node: a fresh block's buffer.
type wnode struct {
	blk uint64
	b   []byte
}

func (n wnode) leaf() bool       { return le32(n.b, 4) == nodeLeafFlag }
func (n wnode) nr() int          { return int(le32(n.b, 16)) }
func (n wnode) max() int         { return int(le32(n.b, 20)) }
func (n wnode) valueSize() int   { return int(le32(n.b, 24)) }
func (n wnode) setNr(nr int)     { binary.LittleEndian.PutUint32(n.b[16:], uint32(nr)) }
func (n wnode) key(i int) uint64 { return le64(n.b, nodeHeaderSize+8*i) }
func (n wnode) setKey(i int, k uint64) {
	binary.LittleEndian.PutUint64(n.b[nodeHeaderSize+8*i:], k)
}

func (n wnode) value(i int) []byte {
	off := nodeHeaderSize + 8*n.max() + n.valueSize()*i
	return n.b[off : off+n.valueSize()]
}

func (n wnode) child(i int) uint64 { return le64(n.value(i), 0) }

func (n wnode) setChild(i int, c uint64) { binary.LittleEndian.PutUint64(n.value(i), c) }

// insertAt makes room at i and stores k, v there.
func (n wnode) insertAt(i int, k uint64, v []byte) {
	nr, vs := n.nr(), n.valueSize()
	keys := n.b[nodeHeaderSize:]
	copy(keys[8*(i+1):8*(nr+1)], keys[8*i:8*nr])
	vals := n.b[nodeHeaderSize+8*n.max():]
	copy(vals[vs*(i+1):vs*(nr+1)], vals[vs*i:vs*nr])
	n.setNr(nr + 1)
	n.setKey(i, k)
	copy(n.value(i), v)
}

// removeAt drops entry i.
func (n wnode) removeAt(i int) {
	nr, vs := n.nr(), n.valueSize()
	keys := n.b[nodeHeaderSize:]
	copy(keys[8*i:], keys[8*(i+1):8*nr])
	vals := n.b[nodeHeaderSize+8*n.max():]
	copy(vals[vs*i:], vals[vs*(i+1):vs*nr])
	n.setNr(nr - 1)
}

// moveTail moves entries [from, nr) of n to the end of m.
func (n wnode) moveTail(from int, m wnode) {
	for i := from; i < n.nr(); i++ {
		m.insertAt(m.nr(), n.key(i), n.value(i))
	}
	n.setNr(from)
}

// moveHead moves the first count entries of n to the end of m.
func (n wnode) moveHead(count int, m wnode) {
	for i := 0; i < count; i++ {
		m.insertAt(m.nr(), n.key(0), n.value(0))
		n.removeAt(0)
	}
}

// lowerBound is the index of the last key <= k, or -1.
func (n wnode) lowerBound(k uint64) int {
	return sort.Search(n.nr(), func(i int) bool { return n.key(i) > k }) - 1
}

// newNode allocates an empty node.
func (w *Writer) newNode(leaf bool, valueSize int) (wnode, error) {
	blk, err := w.allocMeta()
	if err != nil {
		return wnode{}, err
	}
	b := make([]byte, BlockSize)
	flags := uint32(nodeInternalFlag)
	if leaf {
		flags = nodeLeafFlag
	} else {
		valueSize = blockValueSize
	}
	binary.LittleEndian.PutUint32(b[4:], flags)
	binary.LittleEndian.PutUint64(b[8:], blk)
	binary.LittleEndian.PutUint32(b[20:], uint32(maxEntries(valueSize)))
	binary.LittleEndian.PutUint32(b[24:], uint32(valueSize))
	w.fresh[blk] = freshBlock{b: b, salt: btreeCsumXor}
	return wnode{blk: blk, b: b}, nil
}

// shadow returns a writable copy of node blk. A node this transaction
// made, which only one parent refers to, is written in place; any other
// is copied to a new block. If others still share the old node, its
// children gain a reference from the copy.
func (w *Writer) shadow(blk uint64, valueSize int, kind valueKind) (wnode, error) {
	if f, ok := w.fresh[blk]; ok && w.meta[blk] == 1 {
		return wnode{blk: blk, b: f.b}, nil
	}
	old, err := w.readNode(blk, valueSize)
	if err != nil {
		return wnode{}, err
	}
	nb, err := w.allocMeta()
	if err != nil {
		return wnode{}, err
	}
	b := make([]byte, BlockSize)
	copy(b, old.b)
	binary.LittleEndian.PutUint64(b[8:], nb)
	w.fresh[nb] = freshBlock{b: b, salt: btreeCsumXor}
	n := wnode{blk: nb, b: b}
	if w.meta[blk] > 1 {
		for i := 0; i < n.nr(); i++ {
			if err := w.incValue(n, i, kind); err != nil {
				return wnode{}, err
			}
		}
	}
	if err := w.decMeta(blk); err != nil {
		return wnode{}, err
	}
	return n, nil
}

// incValue adds the reference entry i of n holds.
func (w *Writer) incValue(n wnode, i int, kind valueKind) error {
	switch {
	case !n.leaf() || kind == valueSubtree:
		return w.incMeta(n.child(i))
	case kind == valueMapping:
		return w.incData(le64(n.value(i), 0) >> mappingTimeBits)
	}
	return nil
}

// decTree drops one reference to the subtree at blk; the last one frees
// it and drops the references its entries hold.
func (w *Writer) decTree(blk uint64, valueSize int, kind valueKind) error {
	return w.decTreeAt(blk, valueSize, kind, 0)
}

func (w *Writer) decTreeAt(blk uint64, valueSize int, kind valueKind, depth int) error {
	if depth >= 2*maxDepth {
		return fmt.Errorf("%w: btree deeper than %d levels", ErrCorrupt, 2*maxDepth)
	}
	if blk < uint64(len(w.meta)) && w.meta[blk] > 1 {
		return w.decMeta(blk)
	}
	n, err := w.readNode(blk, valueSize)
	if err != nil {
		return err
	}
	if err := w.decMeta(blk); err != nil {
		return err
	}
	for i := 0; i < n.nr; i++ {
		var err error
		switch {
		case !n.leaf:
			err = w.decTreeAt(n.child(i), valueSize, kind, depth+1)
		case kind == valueSubtree:
			err = w.decTreeAt(le64(n.value(i), 0), mappingValueSize, valueMapping, depth+1)
		case kind == valueMapping:
			err = w.decData(le64(n.value(i), 0) >> mappingTimeBits)
		}
		if err != nil {
			return err
		}
	}
	return nil
}

// btreeInsert sets key to value in the tree at root and returns the new
// root and the value it replaced, if any (whose reference the caller
// drops).
func (w *Writer) btreeInsert(root, key uint64, value []byte, kind valueKind) (newRoot uint64, old []byte, err error) {
	vs := len(value)
	n, err := w.shadow(root, vs, kind)
	if err != nil {
		return 0, nil, err
	}
	if n.nr() == n.max() {
		if n, err = w.splitBeneath(n, vs); err != nil {
			return 0, nil, err
		}
	}
	newRoot = n.blk
	for !n.leaf() {
		i := n.lowerBound(key)
		if i < 0 {
			i = 0
			n.setKey(0, key)
		}
		c, err := w.shadow(n.child(i), vs, kind)
		if err != nil {
			return 0, nil, err
		}
		n.setChild(i, c.blk)
		if c.nr() == c.max() {
			s, err := w.newNode(c.leaf(), vs)
			if err != nil {
				return 0, nil, err
			}
			c.moveTail(c.nr()/2, s)
			var v [8]byte
			binary.LittleEndian.PutUint64(v[:], s.blk)
			n.insertAt(i+1, s.key(0), v[:])
			if key >= s.key(0) {
				c = s
			}
		}
		n = c
	}
	i := sort.Search(n.nr(), func(i int) bool { return n.key(i) >= key })
	if i < n.nr() && n.key(i) == key {
		old = append([]byte(nil), n.value(i)...)
		copy(n.value(i), value)
		return newRoot, old, nil
	}
	n.insertAt(i, key, value)
	return newRoot, nil, nil
}

// splitBeneath moves a full root's entries into two new children, so the
// root becomes an internal node of two entries.
func (w *Writer) splitBeneath(root wnode, vs int) (wnode, error) {
	l, err := w.newNode(root.leaf(), vs)
	if err != nil {
		return wnode{}, err
	}
	r, err := w.newNode(root.leaf(), vs)
	if err != nil {
		return wnode{}, err
	}
	half := root.nr() / 2
	root.moveTail(half, r)
	root.moveTail(0, l)
	binary.LittleEndian.PutUint32(root.b[4:], nodeInternalFlag)
	binary.LittleEndian.PutUint32(root.b[20:], uint32(maxEntries(blockValueSize)))
	binary.LittleEndian.PutUint32(root.b[24:], blockValueSize)
	var v [8]byte
	binary.LittleEndian.PutUint64(v[:], l.blk)
	root.insertAt(0, l.key(0), v[:])
	binary.LittleEndian.PutUint64(v[:], r.blk)
	root.insertAt(1, r.key(0), v[:])
	return root, nil
}

// btreeRemove removes key from the tree at root and returns the new root
// and the removed value (nil if the key was absent).
func (w *Writer) btreeRemove(root, key uint64, vs int, kind valueKind) (newRoot uint64, old []byte, err error) {
	n, err := w.shadow(root, vs, kind)
	if err != nil {
		return 0, nil, err
	}
	top := n
	for !n.leaf() {
		i := n.lowerBound(key)
		if i < 0 {
			break
		}
		if err := w.rebalance(n, i, vs, kind); err != nil {
			return 0, nil, err
		}
		i = max(n.lowerBound(key), 0)
		c, err := w.shadow(n.child(i), vs, kind)
		if err != nil {
			return 0, nil, err
		}
		n.setChild(i, c.blk)
		n = c
	}
	if n.leaf() {
		i := sort.Search(n.nr(), func(i int) bool { return n.key(i) >= key })
		if i < n.nr() && n.key(i) == key {
			old = append([]byte(nil), n.value(i)...)
			n.removeAt(i)
		}
	}
	// An internal root left with one child gives way to it; the child
	// inherits the root's reference.
	for !top.leaf() && top.nr() == 1 {
		c := top.child(0)
		if err := w.decMeta(top.blk); err != nil {
			return 0, nil, err
		}
		if top, err = w.shadow(c, vs, kind); err != nil {
			return 0, nil, err
		}
	}
	return top.blk, old, nil
}

// rebalance makes sure child i of n holds more than the minimum number
// of entries, by merging it with a neighbour or moving entries over from
// one. Entry indexes of n may change; the caller looks the key up again.
func (w *Writer) rebalance(n wnode, i, vs int, kind valueKind) error {
	c, err := w.readNode(n.child(i), vs)
	if err != nil {
		return err
	}
	if c.nr > c.max/3 || n.nr() < 2 {
		return nil
	}
	li := i
	if li == n.nr()-1 {
		li--
	}
	l, err := w.shadow(n.child(li), vs, kind)
	if err != nil {
		return err
	}
	n.setChild(li, l.blk)
	r, err := w.shadow(n.child(li+1), vs, kind)
	if err != nil {
		return err
	}
	n.setChild(li+1, r.blk)
	if l.nr()+r.nr() <= l.max() {
		r.moveHead(r.nr(), l)
		n.removeAt(li + 1)
		return w.decMeta(r.blk)
	}
	total := l.nr() + r.nr()
	for l.nr() > total/2 {
		last := l.nr() - 1
		r.insertAt(0, l.key(last), l.value(last))
		l.setNr(last)
	}
	if l.nr() < total/2 {
		r.moveHead(total/2-l.nr(), l)
	}
	n.setKey(li+1, r.key(0))
	return nil
}
