//go:build !nbdmapper_broken_snapshot

package snapshot

import "github.com/nbdmapper/nbdmapper/backing"

// syncBeforeMetadata makes the data chunks of a commit durable before the
// metadata that points at them is written. A test-only build
// (order_broken.go, tag nbdmapper_broken_snapshot) skips it, to show that
// the crash tests catch metadata reaching the disk before its data
// (docs/crash.md).
func syncBeforeMetadata(cow backing.Device) error { return cow.Sync() }

// syncMerged makes a merge step's copies on the origin durable before the
// step clears their exceptions from the COW's metadata; the broken build
// skips it too.
func syncMerged(origin backing.Device) error { return origin.Sync() }
