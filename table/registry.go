package table

import "slices"

// Constructor builds the target of one table line, like the ctr of dm's
// target_type. start and length are the line's start and length in
// sectors (most targets map relative to start; the snapshot targets, as in
// dm, map the device's sectors unchanged); args are the fields after the
// target name. A constructor may keep the strings in args but not
// the slice, which Parse reuses.
//
// Devices are opened through open, which for a parsed table hands out one
// backing.Device per name (and, behind it, a *backing.Pool hands out one
// per underlying disk). A constructor validates everything it can (argument
// count, numbers, geometry, the mapped area against the device size) and
// returns errors wrapping the sentinels in errors.go; Parse adds file, line
// and target name.
//
// The signature is meant to hold the snapshot targets too:
//
//	snapshot-origin <dev>
//	snapshot <origin> <cow> <P|PO|N> <chunk>
//
// Their constructors open the origin and COW devices through open, stack a
// copy-on-write backing.Device on them (shared through the origin's
// backing.ID so that an origin and its snapshots see each other), and
// return a Target whose Map emits one KindMapped extent on that stacked
// device. Nothing in Table or Parse needs to change for them.
type Constructor func(open Opener, start, length Sector, args []string) (Target, error)

// registry maps each target name, as written in tables, to its constructor.
// One explicit map, like the kernel's list of registered target_types: a new
// target type is one new file and one line here.
var registry = map[string]Constructor{
	"linear":  newLinear,
	"striped": newStriped,
	"zero":    newZero,
	"error":   newError,

	"snapshot":        newSnapshot,
	"snapshot-origin": newSnapshotOrigin,
	"snapshot-merge":  newSnapshotMerge,
}

// Targets lists the registered target names, sorted.
func Targets() []string {
	names := make([]string, 0, len(registry))
	for name := range registry {
		names = append(names, name)
	}
	slices.Sort(names)
	return names
}
