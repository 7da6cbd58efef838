package nbdtest

import "testing"

// AllocsPerRun is testing.AllocsPerRun for a path that goes through a
// sync.Pool. Under the race detector a pool drops a quarter of what is put
// back, at random, so such a path allocates by chance: there f still runs
// as often, for the detector to watch, and the result is 0.
// scripts/test.sh also runs the tests named *Allocs* without the race
// detector, where the count is exact.
func AllocsPerRun(runs int, f func()) float64 {
	if Race {
		for range runs + 1 {
			f()
		}
		return 0
	}
	return testing.AllocsPerRun(runs, f)
}
