package backing

import (
	"math"
	"sync/atomic"

	"github.com/nbdmapper/nbdmapper/internal/signal"
)

// A File's system calls can block for as long as the disk likes: a pread
// of data not in the page cache, a pwrite throttled by dirty-page write-back,
// fdatasync, fallocate, BLKDISCARD. Each blocked call holds an OS thread,
// and the Go runtime ends the process when it needs more than 10,000
// (debug.SetMaxThreads). A disk that hangs, or only slows down, would
// otherwise let the server's clients, with requests that are all legal (256
// connections of 64 requests each are 16,384 calls), take every export
// down with it, and each blocked thread holds its stacks besides. So a
// File lets at most DeviceCalls calls into the kernel at once, and the
// process at most ProcessCalls across all of its Files; a call past either
// bound waits, as a parked goroutine holding no thread, until one returns.
//
// The device's bound comes first, so that a hung device's waiting calls
// wait on it without taking any of the process's slots: one hung device
// holds at most DeviceCalls threads, and the others keep their calls.
// Sixteen hung devices hold every slot of the process's, though; so that
// the other devices live on then, a device whose call finds none free may
// still make one call at a time, from a reserve of ReserveCalls kept for
// that. However many devices hang, the threads in File calls number at
// most ProcessCalls + ReserveCalls, and until more than ReserveCalls of
// them hang, every device that answers goes on answering (a call at a
// time while the process's slots are all taken). Nothing is waited for
// while a slot is held but the system call itself, so the bounds cannot
// deadlock.
const (
	// DeviceCalls is how many system calls one File makes at once: deeper
	// than any one client's queue that the benchmarks drive (fio's 32),
	// and as deep as qemu-nbd's whole thread pool.
	DeviceCalls = 64
	// ProcessCalls is how many system calls the Files of the process make
	// at once, but for the reserve: a tenth of the runtime's thread limit,
	// so that sixteen hung devices use 1,024 threads and the process lives
	// on.
	ProcessCalls = 1024
	// ReserveCalls is how many Files may each make one call more when
	// ProcessCalls are all in the kernel: with them, the threads in File
	// calls number under a third of the runtime's limit.
	ReserveCalls = 2048
)

// processCalls holds a token for each File system call in progress but
// those on the reserve, which reserveCalls holds a token for.
var processCalls = make(chan struct{}, ProcessCalls)
var reserveCalls = make(chan struct{}, ReserveCalls)

// callWaits counts the waits for a slot, for CallStats.
var callWaits atomic.Uint64

// CallStats is what the bounds on File system calls show.
type CallStats struct {
	InProgress int64  // File system calls in the kernel now
	Waits      uint64 // waits of calls for a slot (the device's, the process's), since start
}

// ReadCallStats returns the counts now.
func ReadCallStats() CallStats {
	return CallStats{InProgress: int64(len(processCalls) + len(reserveCalls)), Waits: callWaits.Load()}
}

// callGate bounds one File's system calls: a slot of dev for each in
// progress, and a token in own while a call is on the reserve.
type callGate struct {
	dev *deviceSlots
	own chan struct{}
}

func newCallGate() callGate {
	return callGate{dev: &deviceSlots{wake: make(chan struct{}, math.MaxInt32)}, own: make(chan struct{}, 1)}
}

// deviceSlots are a File's DeviceCalls slots. n counts the calls that hold
// one and those waiting for one: a call whose count passes DeviceCalls
// waits, and a call that ends while any wait hands its slot to one of them
// through wake. A call that finds a slot free so takes it with one atomic
// add and gives it back with another, where a channel of tokens took its
// lock each way (docs/decisions/bounded-device-calls.md).
// wake's elements take no memory, so its capacity (more than goroutines
// can wait) costs none, and a hand-over never blocks.
type deviceSlots struct {
	n    atomic.Int64
	wake chan struct{}
}

// take takes a slot, waiting for one if all are held.
func (d *deviceSlots) take() {
	if d.n.Add(1) > DeviceCalls {
		callWaits.Add(1)
		<-d.wake
	}
}

// give gives a slot back, or to a call waiting for one.
func (d *deviceSlots) give() {
	if d.n.Add(-1) >= DeviceCalls {
		d.wake <- struct{}{}
	}
}

// A callSlot is which of the process's slots a call holds.
type callSlot bool

const (
	processSlot callSlot = false
	reserveSlot callSlot = true
)

// enter takes a slot of the device's and then one of the process's, or,
// if those are all taken, the device's one on the reserve, waiting for
// whichever comes first if it must (and, with the reserve spent, trying it
// again whenever a call on it ends); it returns the one it took, for exit.
func (g callGate) enter() callSlot {
	g.dev.take()
	select {
	case processCalls <- struct{}{}:
		return processSlot
	default:
	}
	callWaits.Add(1)
	for {
		freed := reserveFreed.C() // before trying, so that no release is missed
		select {
		case processCalls <- struct{}{}:
			return processSlot
		case g.own <- struct{}{}:
		}
		select {
		case reserveCalls <- struct{}{}:
			return reserveSlot
		default:
		}
		// The reserve is spent: wait for the process's, or for a call on
		// the reserve to end.
		<-g.own
		select {
		case processCalls <- struct{}{}:
			return processSlot
		case <-freed:
		}
	}
}

// exit gives back the slots enter took.
func (g callGate) exit(s callSlot) {
	if s == reserveSlot {
		<-reserveCalls
		<-g.own
		reserveFreed.Fire()
	} else {
		<-processCalls
	}
	g.dev.give()
}

// reserveFreed fires whenever a call on the reserve ends: the calls
// waiting with the reserve spent then try it again.
var reserveFreed signal.Signal
