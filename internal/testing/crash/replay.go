package crash

import (
	"fmt"
	"math/rand/v2"
	"os"
	"slices"

	"github.com/nbdmapper/nbdmapper/backing"
)

// SectorSize is the unit a crash image may tear a write at.
const SectorSize = 512

// Image describes one crash image a Replayer built.
type Image struct {
	// Pos is the crash moment: log entries [0, Pos) completed, and the
	// entry at Pos (usually a sync) had not.
	Pos int
	// Kind is "durable" (no volatile write persisted), "all" (every one,
	// in log order, untorn) or "random" (a random subset, in random
	// order, some torn).
	Kind string
	// Volatile is how many writes were not yet durable at Pos; Persisted
	// how many of them the image holds (wholly or in part), Torn how many
	// of those only in part.
	Volatile, Persisted, Torn int
}

func (im Image) String() string {
	return fmt.Sprintf("crash at log entry %d, %s: %d of %d volatile writes persisted, %d torn",
		im.Pos, im.Kind, im.Persisted, im.Volatile, im.Torn)
}

// Replayer builds, from a WriteLog's entries, the disk images a power cut
// could leave, in files that hold one image at a time.
//
// At a crash moment Pos, a device's durable writes are those a completed
// sync covers (entries before the sync's Covers) and FUA writes; they are
// on the disk, the newest winning sector by sector. Every other write
// before Pos sat in a volatile cache, which may have persisted any of its
// sectors, in any order, or none:
//
//	log      w1 w2 S(covers w1) w3 w4 | crash
//	durable  w1                          (w2 completed after S was issued)
//	volatile w2, w3, w4: any subset, any order, each possibly torn;
//	         but never a sector older than a durable write of that sector
type Replayer struct {
	entries []backing.LogEntry
	devs    []*imageDev
	rng     *rand.Rand

	pos     int   // entries [0, pos) are accounted for
	covers  []int // per device: the largest Covers of a completed sync
	pending []int // writes before pos that are not durable, ascending
	built   []int // the volatile writes the files hold beyond the durable state
}

type imageDev struct {
	f    *os.File
	base []byte  // the durable contents at pos
	img  []byte  // the contents of the file
	last []int32 // per sector: the durable entry it holds, -1 for the initial contents
}

// NewReplayer replays entries onto files, one per device of the log (by
// LogEntry.Dev), which must hold each device's contents from before the
// first entry. The files are rewritten in place; rng drives the choice of
// volatile writes.
func NewReplayer(entries []backing.LogEntry, files []string, rng *rand.Rand) (*Replayer, error) {
	r := &Replayer{entries: entries, rng: rng, covers: make([]int, len(files))}
	for _, name := range files {
		b, err := os.ReadFile(name)
		if err != nil {
			r.Close()
			return nil, err
		}
		f, err := os.OpenFile(name, os.O_RDWR, 0)
		if err != nil {
			r.Close()
			return nil, err
		}
		last := make([]int32, (len(b)+SectorSize-1)/SectorSize)
		for i := range last {
			last[i] = -1
		}
		r.devs = append(r.devs, &imageDev{f: f, base: b, img: slices.Clone(b), last: last})
	}
	for _, e := range entries {
		if e.Dev >= len(files) {
			r.Close()
			return nil, fmt.Errorf("log entry %v: no image file for device %d", e, e.Dev)
		}
	}
	return r, nil
}

// Close closes the image files.
func (r *Replayer) Close() error {
	for _, d := range r.devs {
		d.f.Close()
	}
	return nil
}

// Points returns the crash moments worth checking: just before each sync
// completed, at each of extra (positions of client-visible events, such as
// flush replies, taken with WriteLog.Len), and at the end of the log;
// ascending, without duplicates.
func (r *Replayer) Points(extra []int) []int {
	var ps []int
	for i, e := range r.entries {
		if e.Op == backing.OpSync {
			ps = append(ps, i)
		}
	}
	for _, p := range extra {
		if p >= 0 && p <= len(r.entries) {
			ps = append(ps, p)
		}
	}
	ps = append(ps, len(r.entries))
	slices.Sort(ps)
	return slices.Compact(ps)
}

// Run builds, for each crash moment of points (ascending), the image with
// only the durable writes, the image with every write in log order, and
// random more, and calls check on each while the files hold it. It stops
// at the first error of check, or of the files, and returns how many
// images were checked.
func (r *Replayer) Run(points []int, random int, check func(Image) error) (int, error) {
	n := 0
	for _, pos := range points {
		if pos < r.pos {
			return n, fmt.Errorf("crash points not ascending: %d after %d", pos, r.pos)
		}
		if err := r.advance(pos); err != nil {
			return n, err
		}
		kinds := []string{"durable", "all"}
		if len(r.pending) == 0 {
			kinds = kinds[:1] // the other images would all be this one
		} else {
			for range random {
				kinds = append(kinds, "random")
			}
		}
		for _, kind := range kinds {
			im, err := r.build(kind)
			if err == nil {
				n++
				err = check(im)
			}
			if rerr := r.restore(); err == nil {
				err = rerr
			}
			if err != nil {
				return n, fmt.Errorf("%v: %w", im, err)
			}
		}
	}
	return n, nil
}

// advance moves the durable state to crash moment pos: syncs before pos
// raise their device's cover, and the writes they (or FUA) make durable
// go into base and the files.
func (r *Replayer) advance(pos int) error {
	for i := r.pos; i < pos; i++ {
		e := r.entries[i]
		if e.Op == backing.OpSync {
			r.covers[e.Dev] = max(r.covers[e.Dev], e.Covers)
		} else {
			r.pending = append(r.pending, i)
		}
	}
	r.pos = pos
	still := r.pending[:0]
	var changed []int
	for _, i := range r.pending {
		e := r.entries[i]
		if !(e.FUA || i < r.covers[e.Dev]) {
			still = append(still, i)
			continue
		}
		d := r.devs[e.Dev]
		forSectors(e, func(s int, lo, hi int64) {
			if d.last[s] > int32(i) {
				return // a newer durable write of this sector is there already
			}
			d.last[s] = int32(i)
			apply(d.base, e, lo, hi)
			apply(d.img, e, lo, hi)
		})
		changed = append(changed, i)
	}
	r.pending = still
	for _, i := range changed {
		e := r.entries[i]
		if err := r.devs[e.Dev].writeBack(e.Off, e.Len); err != nil {
			return err
		}
	}
	return nil
}

// build lays volatile writes over the durable state in the image files.
func (r *Replayer) build(kind string) (Image, error) {
	im := Image{Pos: r.pos, Kind: kind, Volatile: len(r.pending)}
	var order []int
	switch kind {
	case "all":
		order = r.pending
	case "random":
		for _, i := range r.pending {
			if r.rng.IntN(2) == 0 {
				order = append(order, i)
			}
		}
		r.rng.Shuffle(len(order), func(a, b int) { order[a], order[b] = order[b], order[a] })
	}
	for _, i := range order {
		e := r.entries[i]
		d := r.devs[e.Dev]
		torn := kind == "random" && e.Len > SectorSize && r.rng.IntN(3) == 0
		wrote := false
		forSectors(e, func(s int, lo, hi int64) {
			if d.last[s] > int32(i) || (torn && r.rng.IntN(2) == 0) {
				return
			}
			apply(d.img, e, lo, hi)
			wrote = true
		})
		if wrote {
			im.Persisted++
			if torn {
				im.Torn++
			}
		}
	}
	for _, i := range order {
		e := r.entries[i]
		if err := r.devs[e.Dev].writeBack(e.Off, e.Len); err != nil {
			return im, err
		}
	}
	r.built = order
	return im, nil
}

// restore puts the durable state back where build changed it.
func (r *Replayer) restore() error {
	for _, i := range r.built {
		e := r.entries[i]
		d := r.devs[e.Dev]
		copy(d.img[e.Off:e.Off+e.Len], d.base[e.Off:e.Off+e.Len])
		if err := d.writeBack(e.Off, e.Len); err != nil {
			return err
		}
	}
	r.built = nil
	return nil
}

// forSectors calls fn for each sector entry e touches, with the byte range
// [lo, hi) of e inside it.
func forSectors(e backing.LogEntry, fn func(s int, lo, hi int64)) {
	for off := e.Off; off < e.Off+e.Len; {
		s := off / SectorSize
		hi := min((s+1)*SectorSize, e.Off+e.Len)
		fn(int(s), off, hi)
		off = hi
	}
}

// apply writes entry e's bytes [lo, hi) into b: its data, or zeros for a
// discard or zeroing (a discarded range may read back as anything; the
// files this replays onto read zeros there).
func apply(b []byte, e backing.LogEntry, lo, hi int64) {
	if e.Op == backing.OpWrite {
		copy(b[lo:hi], e.Data[lo-e.Off:hi-e.Off])
		return
	}
	clear(b[lo:hi])
}

// writeBack writes img's [off, off+n) to the file.
func (d *imageDev) writeBack(off, n int64) error {
	_, err := d.f.WriteAt(d.img[off:off+n], off)
	return err
}
