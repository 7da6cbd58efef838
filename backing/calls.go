package backing

import "sync/atomic"

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
// Nothing is waited for while a slot is held but the system call itself,
// so the bounds cannot deadlock.
const (
	// DeviceCalls is how many system calls one File makes at once: deeper
	// than any one client's queue that the benchmarks drive (fio's 32),
	// and as deep as qemu-nbd's whole thread pool.
	DeviceCalls = 64
	// ProcessCalls is how many system calls the Files of the process make
	// at once: a tenth of the runtime's thread limit, so that sixteen
	// hung devices use 1,024 threads and the process lives on.
	ProcessCalls = 1024
)

// processCalls holds a token for each File system call in progress.
var processCalls = make(chan struct{}, ProcessCalls)

// callWaits counts the waits for a slot, for CallStats.
var callWaits atomic.Uint64

// CallStats is what the bounds on File system calls show.
type CallStats struct {
	InProgress int64  // File system calls in the kernel now
	Waits      uint64 // waits of calls for a slot (the device's, the process's), since start
}

// ReadCallStats returns the counts now.
func ReadCallStats() CallStats {
	return CallStats{InProgress: int64(len(processCalls)), Waits: callWaits.Load()}
}

// callGate bounds one File's system calls: a token for each in progress.
type callGate chan struct{}

func newCallGate() callGate { return make(callGate, DeviceCalls) }

// enter takes a slot of the device's and one of the process's, waiting
// for each in that order if it must.
func (g callGate) enter() {
	select {
	case g <- struct{}{}:
	default:
		callWaits.Add(1)
		g <- struct{}{}
	}
	select {
	case processCalls <- struct{}{}:
	default:
		callWaits.Add(1)
		processCalls <- struct{}{}
	}
}

// exit gives the slots back.
func (g callGate) exit() {
	<-processCalls
	<-g
}
