package table

import (
	"fmt"
	"strconv"
	"strings"

	"github.com/nbdmapper/nbdmapper/backing"
)

// striped <#stripes> <chunk> (<dev> <offset>)+
//
// newStriped spreads the line over #stripes areas, chunk sectors at a time,
// round robin, like dm-stripe. It checks what the kernel's stripe_ctr
// checks, in the same order: #stripes and chunk are non-zero 32-bit numbers
// (since Linux 3.6 the chunk need not be a power of two, nor a page), the
// length divides by #stripes, the per-stripe width divides by chunk, and
// there is one <dev> <offset> pair per stripe. Each stripe's area,
// [offset, offset+length/#stripes), must lie inside its device.
func newStriped(open Opener, _, length Sector, args []string) (Target, error) {
	if len(args) < 2 {
		return nil, fmt.Errorf("%w: want <#stripes> <chunk> (<dev> <offset>)+, got %d arguments", ErrArgCount, len(args))
	}
	n, err := parseUint32("#stripes", args[0])
	if err != nil {
		return nil, err
	}
	if n == 0 {
		return nil, fmt.Errorf("%w: zero stripes", ErrStriped)
	}
	chunk, err := parseUint32("chunk size", args[1])
	if err != nil {
		return nil, err
	}
	if chunk == 0 {
		return nil, fmt.Errorf("%w: zero chunk size", ErrStriped)
	}
	if length%Sector(n) != 0 {
		return nil, fmt.Errorf("%w: length %d not divisible by %d stripes", ErrStriped, length, n)
	}
	width := length / Sector(n)
	if width%Sector(chunk) != 0 {
		return nil, fmt.Errorf("%w: length per stripe %d not divisible by chunk size %d", ErrStriped, width, chunk)
	}
	if uint64(len(args)) != 2+2*uint64(n) {
		return nil, fmt.Errorf("%w: %d stripes need %d arguments, got %d", ErrArgCount, n, 2+2*uint64(n), len(args))
	}
	s := &striped{chunk: Sector(chunk), stripes: make([]stripe, n)}
	for i := range s.stripes {
		off, err := parseSector("offset", args[3+2*i])
		if err != nil {
			return nil, fmt.Errorf("stripe %d: %w", i, err)
		}
		dev, name, err := openArea(open, args[2+2*i], off, width)
		if err != nil {
			return nil, fmt.Errorf("stripe %d: %w", i, err)
		}
		s.stripes[i] = stripe{dev: dev, name: name, off: off}
		if !contains(s.devs, dev) {
			s.devs = append(s.devs, dev)
		}
	}
	return s, nil
}

func contains(devs []backing.Device, d backing.Device) bool {
	for _, x := range devs {
		if x == d {
			return true
		}
	}
	return false
}

type striped struct {
	chunk   Sector
	stripes []stripe
	devs    []backing.Device // distinct, in stripe order
}

type stripe struct {
	dev  backing.Device
	name string // as the table gave it
	off  Sector
}

func (s *striped) Type() string { return "striped" }

func (s *striped) Args() []string {
	out := make([]string, 0, 2+2*len(s.stripes))
	out = append(out, strconv.Itoa(len(s.stripes)), strconv.FormatUint(uint64(s.chunk), 10))
	for _, st := range s.stripes {
		out = append(out, st.name, strconv.FormatUint(uint64(st.off), 10))
	}
	return out
}

// Status is `dmsetup status` for dm-stripe: the stripe count, each device,
// then "1" and one A (alive) per stripe. nbdmapper does not take stripes
// offline, so every stripe reads A.
func (s *striped) Status() string {
	var b strings.Builder
	b.WriteString(strconv.Itoa(len(s.stripes)))
	for _, st := range s.stripes {
		b.WriteByte(' ')
		b.WriteString(st.name)
	}
	b.WriteString(" 1 ")
	b.WriteString(strings.Repeat("A", len(s.stripes)))
	return b.String()
}

func (s *striped) Devices() []backing.Device { return s.devs }

// Cover sends, for each stripe, the one device range that holds the
// stripe's part of [off, off+n): consecutive chunks of a stripe are adjacent
// on its device, so whatever the chunk size the range is contiguous.
//
//	`0 8 striped 2 2 a 0 b 100`, Cover(sectors 1, 6):
//	  a: chunks 0, 2 -> a[1,4)    b: chunks 1, 3 -> b[100,103)
func (s *striped) Cover(off, n int64, yield func(Extent) bool) bool {
	cb := s.chunk.Bytes()
	nst := int64(len(s.stripes))
	end := off + n
	c0, c1 := off/cb, (end-1)/cb // first and last chunk touched
	for i := range nst {
		first := c0 + (i-c0%nst+nst)%nst // first chunk >= c0 on stripe i
		last := c1 - (c1%nst-i+nst)%nst  // last chunk <= c1 on stripe i
		if first > last {
			continue
		}
		lo := max(off, first*cb)
		hi := min(end, (last+1)*cb)
		st := &s.stripes[i]
		devLo := st.off.Bytes() + (first/nst)*cb + lo%cb
		devHi := st.off.Bytes() + (last/nst)*cb + (hi-1)%cb + 1
		if !yield(Extent{Kind: KindMapped, Dev: st.dev, Off: devLo, VOff: lo, Len: devHi - devLo}) {
			return false
		}
	}
	return true
}

// Map cuts [off, off+n) at chunk boundaries and sends each piece to its
// stripe, with dm-stripe's arithmetic (in bytes here):
//
//	chunk           = off / chunk_size
//	stripe          = chunk % #stripes
//	chunk_in_stripe = chunk / #stripes
//	device offset   = stripe offset + chunk_in_stripe*chunk_size + off%chunk_size
//
// For example, `0 8 striped 2 2 a 0 b 100`, in sectors:
//
//	virtual sector   0   1 | 2    3    | 4   5 | 6    7
//	chunk              0   |     1     |   2   |     3
//	stripe             a   |     b     |   a   |     b
//	chunk in stripe    0   |     0     |   1   |     1
//	device sector    a0  a1| b100 b101 | a2  a3| b102 b103
//
// Mapping virtual sectors [1, 7) gives four extents: a[1,2) b[100,102)
// a[2,4) b[102,103). Pieces that follow each other on the same stripe (only
// with one stripe) are merged into one extent.
func (s *striped) Map(off, n int64, yield func(Extent) bool) bool {
	cb := s.chunk.Bytes()
	nst := int64(len(s.stripes))
	var pend Extent
	pendStripe := int64(-1)
	for n > 0 {
		c, in := off/cb, off%cb
		k := min(cb-in, n)
		i := c % nst
		st := &s.stripes[i]
		devOff := st.off.Bytes() + (c/nst)*cb + in
		if i == pendStripe && pend.Off+pend.Len == devOff {
			pend.Len += k
		} else {
			if pendStripe >= 0 && !yield(pend) {
				return false
			}
			pend = Extent{Kind: KindMapped, Dev: st.dev, Off: devOff, VOff: off, Len: k}
			pendStripe = i
		}
		off += k
		n -= k
	}
	return pendStripe < 0 || yield(pend)
}
