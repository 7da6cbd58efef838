package snapshot

// handover is a snapshot's part in dm's exception handover: a snapshot
// loaded on a COW device that another loaded snapshot uses does not read
// the store; when it is activated (its table resumed) it takes the other
// one's store, exceptions and all, and the other one becomes invalid.
// That is how lvconvert --merge hands a snapshot's COW to the
// snapshot-merge table that replaces its origin's, and how a reloaded
// snapshot table takes over from the one it replaces.
//
//	load B on A's COW      B: destination, I/O fails, copy-outs skip it
//	suspend A (and B's device, if it has one)
//	resume B's device      B.Activate: A's I/O in flight drains and new I/O
//	                       on A fails; B gets A's store; A reports Invalid
//	remove A
//
// dm refuses the handover unless A is suspended; here A's I/O is drained
// instead, so the order above is the documented one but not enforced.
// Closing A before B is activated cancels the handover: B is invalid.
type handover struct {
	src, dest *Snapshot // guarded by registry.mu
	cancelled bool      // guarded by registry.mu: src went before Activate

	handedOver bool // guarded by the snapshot's mu: its store went to dest
}

// Activate starts the snapshot's work as its table becomes active (dm's
// resume): a handover destination takes its source's store, and a
// snapshot-merge device starts (or resumes) merging in the background.
// Activating an active snapshot only restarts a stopped merge.
func (s *Snapshot) Activate() {
	registry.mu.Lock()
	src, cancelled := s.src, s.cancelled
	if src != nil {
		src.dest, s.src = nil, nil
	}
	registry.mu.Unlock()
	switch {
	case src != nil:
		s.takeOver(src)
	case cancelled:
		s.mu.Lock()
		s.active = true // with the stub store's valid = false: Invalid
		s.mu.Unlock()
	}
	s.startMerge()
}

// Deactivate stops a merge, waiting for the step in progress, as dm's
// presuspend of snapshot-merge does; Activate resumes it.
func (s *Snapshot) Deactivate() { s.stopMerge() }

// takeOver moves src's store to s (dm's __handover_exceptions).
func (s *Snapshot) takeOver(src *Snapshot) {
	src.stopMerge()
	src.mu.Lock()
	src.handedOver = true
	for src.inflight > 0 || len(src.pending) > 0 || src.committing {
		src.cond.Wait()
	}
	st, overflowed := src.st, src.overflowed
	src.mu.Unlock()

	registry.mu.Lock()
	id := s.cow.ID()
	ok := registry.cows[id] == src || registry.cows[id] == nil
	if ok {
		registry.cows[id] = s
	}
	registry.mu.Unlock()

	s.mu.Lock()
	if ok {
		s.st, s.overflowed = st, overflowed
		stats.handovers.Add(1)
	}
	s.active = true
	s.mu.Unlock()
}
