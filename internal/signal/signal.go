// Package signal has Signal, which tells whoever waits that something
// changed, so that they look again.
package signal

import "sync"

// A Signal wakes every waiter each time it fires. Take the channel before
// looking at what it guards, so that a change between the look and the
// wait is not missed. The zero value is ready to use.
type Signal struct {
	mu sync.Mutex
	ch chan struct{}
}

// C returns a channel closed the next time s fires.
func (s *Signal) C() <-chan struct{} {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.ch == nil {
		s.ch = make(chan struct{})
	}
	return s.ch
}

// Fire wakes every waiter on a channel C returned.
func (s *Signal) Fire() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.ch != nil {
		close(s.ch)
		s.ch = nil
	}
}
