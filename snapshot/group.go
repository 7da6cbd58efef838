package snapshot

import (
	"sync"
	"sync/atomic"

	"github.com/nbdmapper/nbdmapper/backing"
)

// group is every snapshot of one origin device, found through the origin's
// backing.ID: dm's struct origin, which its snapshot-origin target and its
// snapshot targets look up by block device. Groups live in one registry per
// process, so that tables loaded separately still see each other.
//
// mu orders copy-outs against everything that reads a chunk's location:
//
//	holder               lock    when
//	snapshot read        read    always
//	snapshot write       read    every chunk already has an exception
//	                     write   some chunk needs one (allocate, copy, commit)
//	origin write         read    every snapshot has every chunk already
//	                     write   some snapshot needs a copy-out first
//
// So an origin chunk is never overwritten while a snapshot may still read
// it from the origin, and the exception maps change only under the write lock.
type group struct {
	mu    sync.RWMutex
	snaps []*Snapshot // guarded by mu
}

var registry struct {
	mu     sync.Mutex
	groups map[backing.ID]*group    // by origin device
	cows   map[backing.ID]*Snapshot // by COW device, to refuse sharing one
}

// groupOf returns the group of the origin device id, creating it. Groups are
// never freed: one per origin device the process has seen.
func groupOf(id backing.ID) *group {
	registry.mu.Lock()
	defer registry.mu.Unlock()
	g := registry.groups[id]
	if g == nil {
		if registry.groups == nil {
			registry.groups = make(map[backing.ID]*group)
		}
		g = &group{}
		registry.groups[id] = g
	}
	return g
}

// claimCOW records that s uses its COW device, failing if another
// snapshot already does.
func claimCOW(s *Snapshot) error {
	registry.mu.Lock()
	defer registry.mu.Unlock()
	id := s.cow.ID()
	if registry.cows[id] != nil {
		return ErrCOWInUse
	}
	if registry.cows == nil {
		registry.cows = make(map[backing.ID]*Snapshot)
	}
	registry.cows[id] = s
	return nil
}

func releaseCOW(s *Snapshot) {
	registry.mu.Lock()
	defer registry.mu.Unlock()
	if registry.cows[s.cow.ID()] == s {
		delete(registry.cows, s.cow.ID())
	}
}

// Stacked devices get IDs no file or block device has (Dev = all ones is
// backing.Mem's; this is the next value down).
const stackedDev = ^uint64(0) - 1

var stackedIno atomic.Uint64

func newStackedID() backing.ID { return backing.ID{Dev: stackedDev, Ino: stackedIno.Add(1)} }
