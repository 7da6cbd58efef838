package signal

import "testing"

// A channel taken before Fire is closed by it; one taken after waits for
// the next.
func TestSignal(t *testing.T) {
	var s Signal
	before := s.C()
	s.Fire()
	select {
	case <-before:
	default:
		t.Fatal("a channel taken before Fire is still open")
	}
	after := s.C()
	select {
	case <-after:
		t.Fatal("a channel taken after Fire is closed")
	default:
	}
	s.Fire()
	<-after
	s.Fire() // no channel taken: nothing to close
}
