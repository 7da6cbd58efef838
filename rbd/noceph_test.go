//go:build !ceph

package rbd

import (
	"errors"
	"testing"
)

// TestOpenWithoutCeph: a binary built without the tag names the tag, for
// serve and for check alike.
func TestOpenWithoutCeph(t *testing.T) {
	for _, unconnected := range []bool{false, true} {
		s := Scheme{Unconnected: unconnected}
		if _, err := s.Open("rbd:p/i", false); !errors.Is(err, ErrNoCeph) {
			t.Errorf("unconnected %v: Open = %v, want ErrNoCeph", unconnected, err)
		}
	}
}
