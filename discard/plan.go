package discard

import (
	"cmp"
	"fmt"
	"iter"
	"slices"
	"strings"

	"github.com/nbdmapper/nbdmapper/backing"
)

// Extent is a byte range on one backing device.
type Extent struct {
	Dev      backing.Device
	Off, Len int64
}

// Op is what a plan does to its ranges.
type Op uint8

const (
	// OpDiscard deallocates; advisory, so ranges are cut to the device's
	// granularity and split at its maximum.
	OpDiscard Op = iota
	// OpZero makes ranges read back as zeros; exact, so ranges are only
	// sorted and merged.
	OpZero
)

func (o Op) String() string {
	if o == OpZero {
		return "zero"
	}
	return "discard"
}

// Plan is the device work for one batch of requests: per device, the ranges
// that came in and the calls that will reach the device. It is a plain value:
// build it with PlanDiscard or PlanZero, print it, compare it.
type Plan struct {
	Op      Op
	Devices []DevicePlan // in order of first appearance in the input
}

// DevicePlan is one device's part of a Plan.
type DevicePlan struct {
	Dev     backing.Device
	Limits  backing.Limits  // the device's limits when the plan was made
	In      []backing.Range // ranges received, in arrival order
	Claimed []backing.Range // ranges written since they arrived (merged), never discarded
	Merged  []backing.Range // In sorted, merged, minus Claimed
	Calls   []backing.Range // what reaches the device, ascending (see plan)

	err     error // the device's Limits panicked (see plan)
	mergedN int   // len(Merge(In))
}

// MergedAway is how many received ranges disappeared into a neighbour.
func (d DevicePlan) MergedAway() int { return max(len(d.In)-d.mergedN, 0) }

// PlanDiscard plans a discard of exts: per device, sorted, merged, cut
// inward to the device's granularity and split at its maximum size.
func PlanDiscard(exts []Extent) Plan { return plan(OpDiscard, group(exts), nil) }

// PlanZero plans zeroing exts: per device, sorted and merged, nothing cut,
// because the whole range must read back as zeros.
func PlanZero(exts []Extent) Plan { return plan(OpZero, group(exts), nil) }

// pending is one device's ranges while a plan is being gathered.
type pending struct {
	dev         backing.Device
	in, claimed []backing.Range
}

func group(exts []Extent) []*pending {
	var out []*pending
	var byDev map[backing.Device]*pending // once out is too long to search
	find := func(d backing.Device) *pending {
		if byDev != nil {
			return byDev[d]
		}
		for _, p := range out {
			if p.dev == d {
				return p
			}
		}
		return nil
	}
	for _, x := range exts {
		if x.Len <= 0 {
			continue
		}
		p := find(x.Dev)
		if p == nil {
			p = &pending{dev: x.Dev}
			out = append(out, p)
			if byDev == nil && len(out) > 8 {
				byDev = make(map[backing.Device]*pending, 2*len(out))
				for _, q := range out {
					byDev[q.dev] = q
				}
			} else if byDev != nil {
				byDev[x.Dev] = p
			}
		}
		p.in = append(p.in, backing.Range{Off: x.Off, Len: x.Len})
	}
	return out
}

// plan plans devs. For a plan the engine issues (issuer set), a discard's
// Calls are cut but not split: the engine splits each one at
// Limits.MaxBytes only as it issues it (see cut). And a device whose Limits
// panics gets no calls but the panic's error in err, for the trims that
// wait for it: the engine plans on the batch timer's goroutine too.
func plan(op Op, devs []*pending, issuer *Engine) Plan {
	p := Plan{Op: op, Devices: make([]DevicePlan, 0, len(devs))}
	for _, d := range devs {
		p.Devices = append(p.Devices, planDevice(op, d, issuer))
	}
	return p
}

// planDevice is plan for one device's ranges.
func planDevice(op Op, d *pending, issuer *Engine) DevicePlan {
	dp := DevicePlan{
		Dev:     d.dev,
		In:      d.in,
		Claimed: Merge(d.claimed),
	}
	if issuer == nil {
		dp.Limits = d.dev.Limits()
	} else {
		dp.Limits, dp.err = issuer.limits(d.dev)
	}
	merged := Merge(d.in)
	dp.mergedN = len(merged)
	dp.Merged = Subtract(merged, dp.Claimed)
	switch {
	case dp.err != nil:
	case op == OpDiscard && issuer != nil:
		dp.Calls = cut(dp.Merged, dp.Limits)
	case op == OpDiscard:
		dp.Calls = Align(dp.Merged, dp.Limits)
	default:
		dp.Calls = dp.Merged
	}
	return dp
}

// Merge returns rs sorted ascending with overlapping and adjacent ranges
// joined and empty ones dropped. rs is not modified.
//
//	in        [---)  [----)
//	             [-----)      [--)
//	merged    [----------)    [--)
func Merge(rs []backing.Range) []backing.Range {
	s := make([]backing.Range, 0, len(rs))
	for _, r := range rs {
		if r.Len > 0 {
			s = append(s, r)
		}
	}
	return mergeInPlace(s)
}

// mergeInPlace is Merge reusing rs's array: rs is sorted and the merged
// ranges are written over its start.
func mergeInPlace(rs []backing.Range) []backing.Range {
	slices.SortFunc(rs, func(a, b backing.Range) int { return cmp.Compare(a.Off, b.Off) })
	out := rs[:0]
	for _, r := range rs {
		if r.Len <= 0 {
			continue
		}
		if k := len(out) - 1; k >= 0 && r.Off <= out[k].End() {
			out[k].Len = max(out[k].End(), r.End()) - out[k].Off
			continue
		}
		out = append(out, r)
	}
	return out
}

// Subtract returns rs without the bytes in cut. Both must be merged
// (sorted, disjoint); so is the result.
//
//	rs        [--------------)   [----)
//	cut          [--)    [---------)
//	result    [--)  [----)         [--)
func Subtract(rs, cut []backing.Range) []backing.Range {
	if len(cut) == 0 {
		return rs
	}
	var out []backing.Range
	j := 0
	for _, r := range rs {
		off, end := r.Off, r.End()
		for j < len(cut) && cut[j].End() <= off {
			j++
		}
		for k := j; k < len(cut) && cut[k].Off < end; k++ {
			if cut[k].Off > off {
				out = append(out, backing.Range{Off: off, Len: cut[k].Off - off})
			}
			off = max(off, cut[k].End())
		}
		if off < end {
			out = append(out, backing.Range{Off: off, Len: end - off})
		}
	}
	return out
}

// Align cuts each of rs inward to multiples of lim.Granularity, dropping
// what becomes empty, and splits the rest into pieces of at most
// lim.MaxBytes (rounded down to the granularity). Shrinking is allowed
// because a discard is advisory; it is why merging comes first: two
// adjacent half-granule ranges are discarded once merged, and lost if cut
// one by one.
//
//	granule  |...|...|...|...|
//	merged    [--------]  [-]   1+10 13+3
//	aligned      [--]           4+4     (granularity 4)
//	merged   [--------------]   0+16
//	aligned  [--][--][--][--]   0+4 4+4 8+4 12+4  (granularity 4, MaxBytes 4..7)
func Align(rs []backing.Range, lim backing.Limits) []backing.Range {
	var out []backing.Range
	for _, r := range cut(rs, lim) {
		for p := range pieces(r, lim) {
			out = append(out, p)
		}
	}
	return out
}

// cut is Align without the splitting: each of rs cut inward to the
// granularity, empty ones dropped. The engine plans with it and splits a
// range into calls only as it issues them (pieces), so that a plan's memory
// grows with the number of ranges it was given, never with their length
// over the device's MaxBytes (a 4 GiB trim on a device taking 512 bytes per
// discard would otherwise be 8 Mi calls, 128 MiB, held at once).
func cut(rs []backing.Range, lim backing.Limits) []backing.Range {
	var out []backing.Range
	for _, r := range rs {
		if c, ok := cutOne(r, lim); ok {
			out = append(out, c)
		}
	}
	return out
}

// cutOne is r cut inward to lim's granularity; ok is false if nothing is left.
func cutOne(r backing.Range, lim backing.Limits) (c backing.Range, ok bool) {
	g := max(lim.Granularity, 1)
	off := (r.Off + g - 1) / g * g
	end := r.End() / g * g
	return backing.Range{Off: off, Len: end - off}, off < end
}

// step is the largest discard call lim allows, a multiple of the
// granularity; 0 means no limit.
func step(lim backing.Limits) int64 {
	if lim.MaxBytes <= 0 {
		return 0
	}
	g := max(lim.Granularity, 1)
	return max(lim.MaxBytes/g*g, g)
}

// pieces yields r, already cut, as the calls that discard it: pieces of
// step(lim) bytes from its start, the last one shorter.
func pieces(r backing.Range, lim backing.Limits) iter.Seq[backing.Range] {
	return func(yield func(backing.Range) bool) {
		s := step(lim)
		for off := r.Off; off < r.End(); {
			n := r.End() - off
			if s > 0 {
				n = min(n, s)
			}
			if !yield(backing.Range{Off: off, Len: n}) {
				return
			}
			off += n
		}
	}
}

// pieceCount is how many calls pieces yields for r.
func pieceCount(r backing.Range, lim backing.Limits) int64 {
	if s := step(lim); s > 0 {
		return (r.Len + s - 1) / s
	}
	return min(r.Len, 1)
}

// Bytes is the total length of rs.
func Bytes(rs []backing.Range) int64 {
	var n int64
	for _, r := range rs {
		n += r.Len
	}
	return n
}

// String prints the plan, one block per device, drawing the ranges as ASCII
// when they fit on a line (one column per unit, a power of two dividing
// every offset): `[` starts a range, `]` ends it, `#` is a one-unit range.
func (p Plan) String() string {
	var b strings.Builder
	for i, d := range p.Devices {
		if i > 0 {
			b.WriteByte('\n')
		}
		d.write(&b, p.Op)
	}
	return b.String()
}

const (
	drawWidth = 64 // widest drawing, in units
	listMax   = 8  // longest range list printed in full
)

func (d DevicePlan) write(b *strings.Builder, op Op) {
	fmt.Fprintf(b, "%s %s: granularity %d, max %d: %d in, %d merged away, %d claimed, %d calls, %d of %d bytes\n",
		op, d.Dev.Name(), d.Limits.Granularity, d.Limits.MaxBytes,
		len(d.In), d.MergedAway(), len(d.Claimed), len(d.Calls), Bytes(d.Calls), Bytes(d.In))
	unit, width, ok := scale(d)
	if ok {
		tick := int64(8)
		if g := d.Limits.Granularity / unit; g >= 2 {
			tick = g
		}
		fmt.Fprintf(b, "  %-8s %s  (column = %d bytes, | every %d)\n", "", ruler(width, tick), unit, tick*unit)
	}
	rows := []struct {
		name string
		rs   []backing.Range
		each bool // one line per range
	}{
		{"in", d.In, true},
		{"claimed", d.Claimed, false},
		{"merged", d.Merged, false},
		{"calls", d.Calls, false},
	}
	for _, row := range rows {
		if len(row.rs) == 0 {
			continue
		}
		if !ok {
			fmt.Fprintf(b, "  %-8s %s\n", row.name, list(row.rs))
			continue
		}
		if row.each {
			for _, r := range row.rs {
				fmt.Fprintf(b, "  %-8s %s\n", row.name, draw([]backing.Range{r}, unit))
			}
			continue
		}
		fmt.Fprintf(b, "  %-8s %s\n", row.name, draw(row.rs, unit))
	}
	if ok {
		fmt.Fprintf(b, "  %-8s %s\n", "calls", list(d.Calls))
	}
}

// scale picks the drawing unit: the largest power of two dividing every
// offset and length, if the drawing then fits in drawWidth columns and there
// are few enough input ranges to draw one per line.
func scale(d DevicePlan) (unit, width int64, ok bool) {
	if len(d.In) == 0 || len(d.In) > listMax {
		return 0, 0, false
	}
	var all []backing.Range
	for _, rs := range [][]backing.Range{d.In, d.Claimed, d.Merged, d.Calls} {
		all = append(all, rs...)
	}
	unit = 1 << 40
	var end int64
	for _, r := range all {
		for _, v := range []int64{r.Off, r.Len} {
			for v%unit != 0 {
				unit >>= 1
			}
		}
		end = max(end, r.End())
	}
	if g := d.Limits.Granularity; g > 0 && g < unit && g&(g-1) == 0 {
		unit = g // so that granules show on the ruler
	}
	width = (end + unit - 1) / unit
	return unit, width, width <= drawWidth
}

func ruler(width, tick int64) string {
	var b strings.Builder
	for i := range width + 1 {
		if i%tick == 0 {
			b.WriteByte('|')
		} else {
			b.WriteByte('.')
		}
	}
	return b.String()
}

func draw(rs []backing.Range, unit int64) string {
	var line []byte
	for _, r := range rs {
		s, e := int(r.Off/unit), int((r.End()+unit-1)/unit)
		for len(line) < e {
			line = append(line, ' ')
		}
		if e-s == 1 {
			line[s] = '#'
			continue
		}
		line[s] = '['
		for i := s + 1; i < e-1; i++ {
			line[i] = '-'
		}
		line[e-1] = ']'
	}
	return string(line)
}

func list(rs []backing.Range) string {
	if len(rs) > listMax {
		return fmt.Sprintf("%d ranges, %d bytes, %d+%d .. %d+%d",
			len(rs), Bytes(rs), rs[0].Off, rs[0].Len, rs[len(rs)-1].Off, rs[len(rs)-1].Len)
	}
	parts := make([]string, len(rs))
	for i, r := range rs {
		parts[i] = fmt.Sprintf("%d+%d", r.Off, r.Len)
	}
	return strings.Join(parts, " ")
}
