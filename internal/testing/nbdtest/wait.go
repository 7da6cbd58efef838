package nbdtest

import (
	"sync"
	"testing"
	"time"
)

// Bound is how long a test waits for anything before it fails. It only
// turns a hang into a reported failure: nothing a correct program does comes
// near it, so it is not a timing assertion.
const Bound = 60 * time.Second

// Recv waits for a value on ch and returns it, or fails the test with what
// it was waiting for once Bound has passed.
func Recv[T any](t testing.TB, ch <-chan T, what string) T {
	t.Helper()
	timer := time.NewTimer(Bound)
	defer timer.Stop()
	select {
	case v := <-ch:
		return v
	case <-timer.C:
		t.Fatalf("waited %v for %s", Bound, what)
		panic("unreachable")
	}
}

// Until calls cond until it returns true, or fails the test with what it
// was waiting for once Bound has passed. It is for states that no channel
// announces (a counter in Stats, a file appearing); the polling interval is
// not a timing assumption.
func Until(t testing.TB, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(Bound)
	for delay := 50 * time.Microsecond; !cond(); delay = min(2*delay, 10*time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("waited %v for %s", Bound, what)
		}
		time.Sleep(delay)
	}
}

// Wait waits for wg, or fails the test with what it was waiting for once
// Bound has passed.
func Wait(t testing.TB, wg *sync.WaitGroup, what string) {
	t.Helper()
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	Recv(t, done, what)
}
