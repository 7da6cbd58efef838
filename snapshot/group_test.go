package snapshot

import (
	"testing"

	"github.com/nbdmapper/nbdmapper/backing"
)

// groupCount is how many origin groups the registry holds.
func groupCount() int {
	registry.mu.Lock()
	defer registry.mu.Unlock()
	return len(registry.groups)
}

// A group lives while a snapshot or snapshot-origin of its origin does:
// mapped origins get a new ID each time they are made, so groups kept for
// good would pile up with every create and remove of an origin.
func TestGroupFreedWithItsLastUser(t *testing.T) {
	before := groupCount()
	for range 3 {
		origin := backing.NewMem("origin", 1<<20)
		s, err := Open("snap", origin, backing.NewMem("cow", 1<<20), Options{Type: Transient, ChunkSectors: 8})
		if err != nil {
			t.Fatal(err)
		}
		o, err := NewOrigin("origin", origin, 0)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := o.WriteAt([]byte("x"), 0); err != nil {
			t.Fatal(err)
		}
		if got := groupCount(); got != before+1 {
			t.Fatalf("%d groups with one origin in use, want %d", got, before+1)
		}
		if err := s.Close(); err != nil {
			t.Fatal(err)
		}
		if got := groupCount(); got != before+1 {
			t.Fatalf("%d groups with its snapshot-origin still open, want %d", got, before+1)
		}
		if err := o.Close(); err != nil {
			t.Fatal(err)
		}
		if err := o.Close(); err != nil {
			t.Fatal(err)
		}
	}
	if got := groupCount(); got != before {
		t.Fatalf("%d groups after every user of 3 origins closed, want %d", got, before)
	}
}
