package main

import (
	"flag"
	"fmt"
	"os"
	"runtime"
	"strconv"

	"github.com/nbdmapper/nbdmapper/nbdtarget"
)

// procsFlag is serve's --procs: how many CPUs run Go code at once
// (GOMAXPROCS), a number or "auto".
//
// auto sizes it to the clients: one per connection in the transmission
// phase, between 1 and the CPUs the process may use. A connection's
// requests are decoded one at a time and spend their time in system calls
// (pread, pwrite, fdatasync, the socket), which run on threads of their
// own without a P; the Go code around them is short. For small requests a
// second P buys one connection nothing but idle Ps spinning for work and
// threads woken to find none, on every request, which on a small machine
// is CPU taken from the client and latency added to each request
// (docs/decisions/procs-auto.md). A connection writing in bulk (large writes one
// after another) does get two: its reader copies the next payload out of
// the socket while the last one is copied into the page cache
// (nbdtarget's conn.bulk). So does a lone connection whose client waits
// for each reply with flushes between, whose socket then waits out of the
// network poller: an idle second P keeps the scheduler from handing its P
// to another thread during every fdatasync (nbdtarget's ownSocket).
// Several connections do run Go code in parallel, so they get more.
// GOMAXPROCS in the environment wins over auto, as it does for any Go
// program.
type procsFlag struct{ n int } // 0: auto

func (p *procsFlag) String() string {
	if p.n == 0 {
		return "auto"
	}
	return strconv.Itoa(p.n)
}

func (p *procsFlag) Set(s string) error {
	if s == "auto" {
		p.n = 0
		return nil
	}
	n, err := strconv.Atoi(s)
	if err != nil || n < 1 {
		return fmt.Errorf("want auto or a positive number, got %q", s)
	}
	p.n = n
	return nil
}

func (p *procsFlag) register(fs *flag.FlagSet) {
	fs.Var(p, "procs", "CPUs running Go code at once (GOMAXPROCS): N, or auto for one per connection (two for one writing in bulk or syncing alone) up to the CPUs available")
}

// apply sets GOMAXPROCS for a fixed --procs, or makes srv adjust it to its
// connections.
func (p *procsFlag) apply(srv *nbdtarget.Server) {
	switch {
	case p.n > 0:
		runtime.GOMAXPROCS(p.n)
	case os.Getenv("GOMAXPROCS") == "":
		srv.OnActive = procsFor(runtime.GOMAXPROCS(0), runtime.GOMAXPROCS)
	}
}

// procsFor returns an OnActive hook that calls set with one P per
// connection (as OnActive counts them), between 1 and most, whenever that
// number changes.
func procsFor(most int, set func(int) int) func(conns int) {
	cur := 0
	return func(conns int) {
		if n := min(max(conns, 1), most); n != cur {
			set(n)
			cur = n
		}
	}
}
