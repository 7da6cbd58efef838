package snapshot

import (
	"slices"
	"sync"
	"sync/atomic"

	"github.com/nbdmapper/nbdmapper/backing"
)

// group is every snapshot of one origin device, found through the origin's
// backing.ID: dm's struct origin, which its snapshot-origin target and its
// snapshot targets look up by block device. Groups live in one registry per
// process, so that tables loaded separately still see each other.
//
// What keeps an origin chunk from changing under someone who still needs
// its old contents:
//
//	who needs it                    how the origin write waits
//	a copy-out or fill in progress  its pending exception (pending.go)
//	a snapshot read of the origin   reads (a tracker): a pending exception
//	                                is removed only after the reads that
//	                                began before its commit
//
// An origin write goes ahead at once when every snapshot has an exception
// and no pending one for each chunk it touches.
type group struct {
	id    backing.ID // the origin's
	users int        // snapshots and snapshot-origins of it open; guarded by registry.mu
	mu    sync.RWMutex
	snaps []*Snapshot // guarded by mu
	reads tracker     // snapshot reads of the origin in flight, in origin bytes
}

func (g *group) add(s *Snapshot) {
	g.mu.Lock()
	g.snaps = append(g.snaps, s)
	g.mu.Unlock()
}

func (g *group) remove(s *Snapshot) {
	g.mu.Lock()
	g.snaps = slices.DeleteFunc(g.snaps, func(x *Snapshot) bool { return x == s })
	g.mu.Unlock()
}

// list is the snapshots now, in the order they were loaded.
func (g *group) list() []*Snapshot {
	g.mu.RLock()
	defer g.mu.RUnlock()
	return slices.Clone(g.snaps)
}

var registry struct {
	mu     sync.Mutex
	groups map[backing.ID]*group    // by origin device
	cows   map[backing.ID]*Snapshot // by COW device: the snapshot whose store it is
}

// groupOf returns the group of the origin device id, creating it, for a
// new snapshot or snapshot-origin, which gives it back with releaseGroup
// when it closes: the last one frees it. (A mapped device has a new ID
// each time it is made, so groups kept for good would pile up with every
// create and remove of an origin.)
func groupOf(id backing.ID) *group {
	registry.mu.Lock()
	defer registry.mu.Unlock()
	g := registry.groups[id]
	if g == nil {
		if registry.groups == nil {
			registry.groups = make(map[backing.ID]*group)
		}
		g = &group{id: id}
		registry.groups[id] = g
	}
	g.users++
	return g
}

// releaseGroup gives back a groupOf.
func releaseGroup(g *group) {
	registry.mu.Lock()
	defer registry.mu.Unlock()
	if g.users--; g.users == 0 {
		delete(registry.groups, g.id)
	}
}

// claimCOW records that s uses its COW device. If another snapshot owns
// it, s becomes that one's handover destination and claimCOW returns the
// owner (dm's __validate_exception_handover); a second destination, or a
// second merging one, is refused.
func claimCOW(s *Snapshot) (src *Snapshot, err error) {
	registry.mu.Lock()
	defer registry.mu.Unlock()
	id := s.cow.ID()
	src = registry.cows[id]
	if src == nil {
		if registry.cows == nil {
			registry.cows = make(map[backing.ID]*Snapshot)
		}
		registry.cows[id] = s
		return nil, nil
	}
	if src.dest != nil {
		return nil, ErrCOWInUse
	}
	if s.opt.Merge && src.opt.Merge {
		return nil, ErrMerging
	}
	if s.opt.Merge && src.opt.Type == Transient {
		return nil, ErrMergeStore
	}
	src.dest, s.src = s, src
	return src, nil
}

// releaseCOW gives up s's claim: its store, or its place as a handover
// destination; a destination waiting for s is cancelled (dm marks it
// invalid).
func releaseCOW(s *Snapshot) {
	registry.mu.Lock()
	defer registry.mu.Unlock()
	if registry.cows[s.cow.ID()] == s {
		delete(registry.cows, s.cow.ID())
	}
	if s.dest != nil {
		s.dest.src, s.dest.cancelled = nil, true
		s.dest = nil
	}
	if s.src != nil {
		s.src.dest, s.src = nil, nil
	}
}

// Stacked devices get IDs no file or block device has (Dev = all ones is
// backing.Mem's; this is the next value down).
const stackedDev = ^uint64(0) - 1

var stackedIno atomic.Uint64

func newStackedID() backing.ID { return backing.ID{Dev: stackedDev, Ino: stackedIno.Add(1)} }
