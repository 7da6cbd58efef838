// Package fault is test support for failing devices: the ways a device call
// fails (an errno or a panic) as hooks for backing.Faulty.Inject, a log of
// what an engine's OnPanic reported, and waits that fail the test after a
// generous deadline instead of hanging the suite.
//
// Only test files import it.
//
//	for _, flt := range fault.All {
//		f.Inject(backing.OpSync, flt.Hook())
//		err := e.Flush(devs)
//		if !flt.Is(err) { ... }
//	}
package fault

import (
	"errors"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/nbdmapper/nbdmapper/backing"
	"github.com/nbdmapper/nbdmapper/internal/testing/sparse"
)

// Deadline bounds every wait. It only fires when something hangs.
const Deadline = 30 * time.Second

// Within waits for a value from ch, failing t after Deadline.
func Within[T any](t testing.TB, what string, ch <-chan T) T {
	t.Helper()
	timer := time.NewTimer(Deadline)
	defer timer.Stop()
	select {
	case v := <-ch:
		return v
	case <-timer.C:
		t.Fatalf("%s: still waiting after %v", what, Deadline)
		panic("unreachable")
	}
}

// WaitFor waits until cond holds, failing t after Deadline. It is for
// states only a counter shows (a request registered with an engine); it
// yields between checks and decides nothing by time.
func WaitFor(t testing.TB, what string, cond func() bool) {
	t.Helper()
	end := time.Now().Add(Deadline)
	for !cond() {
		if time.Now().After(end) {
			t.Fatalf("%s: still waiting after %v", what, Deadline)
		}
		runtime.Gosched()
		time.Sleep(100 * time.Microsecond)
	}
}

// Files creates a sparse file of size bytes for each of names in a
// temporary directory, opens it and puts it behind a backing.Faulty: real
// files with faults on top. They are closed when t ends. A device's Name is
// its file's path.
func Files(t testing.TB, size int64, names ...string) []*backing.Faulty {
	t.Helper()
	dir := t.TempDir()
	out := make([]*backing.Faulty, len(names))
	for i, name := range names {
		f, err := backing.OpenFile(sparse.Create(t, filepath.Join(dir, name), size), false)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { f.Close() })
		out[i] = backing.NewFaulty(f)
	}
	return out
}

// Fault is one way a device call fails: an errno, or a panic (Err nil).
type Fault struct {
	Name string
	Err  error
}

// All are the faults every path is tested with.
var All = []Fault{Errno(unix.EIO), Errno(unix.ENOSPC), Errno(unix.EROFS), Panic}

// Panic is a device call that panics.
var Panic = Fault{Name: "panic"}

// Errno is a device call that fails with err, named by its errno (EIO).
func Errno(err unix.Errno) Fault { return Fault{Name: unix.ErrnoName(err), Err: err} }

// Hook is what a backing.Faulty runs in place of the failing call.
func (f Fault) Hook() func() error {
	if f.Err == nil {
		return func() error { panic("device bug: " + f.Name) }
	}
	return func() error { return f.Err }
}

// Is says whether err is what the fault must come back as: the errno, or an
// error wrapping backing.ErrPanic.
func (f Fault) Is(err error) bool {
	if f.Err == nil {
		return errors.Is(err, backing.ErrPanic)
	}
	return errors.Is(err, f.Err)
}

// Panics is 1 for a panicking fault, else 0: how many panics an engine
// reports for one failing call.
func (f Fault) Panics() int {
	if f.Err == nil {
		return 1
	}
	return 0
}

// PanicLog collects what an engine's OnPanic reports.
type PanicLog struct {
	mu     sync.Mutex
	values []any
	stacks []string
}

// OnPanic is the function to install as an engine's OnPanic.
func (l *PanicLog) OnPanic(v any, stack []byte) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.values = append(l.values, v)
	l.stacks = append(l.stacks, string(stack))
}

// Check fails t unless exactly want panics were reported, each with the
// stack of the goroutine that panicked: one that ran Hook.
func (l *PanicLog) Check(t testing.TB, want int) {
	t.Helper()
	l.mu.Lock()
	defer l.mu.Unlock()
	if len(l.values) != want {
		t.Fatalf("OnPanic saw %d panics (%v), want %d", len(l.values), l.values, want)
	}
	for _, s := range l.stacks {
		if !strings.Contains(s, "internal/testing/fault/fault.go") {
			t.Fatalf("reported stack is not the panicking goroutine's:\n%s", s)
		}
	}
}
