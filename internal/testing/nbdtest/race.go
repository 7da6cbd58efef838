//go:build race

package nbdtest

// Race reports whether the race detector is on.
const Race = true
