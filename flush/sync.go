//go:build !nbdmapper_broken_flush

package flush

import "github.com/nbdmapper/nbdmapper/backing"

// syncDevice is the one sync a flush issues. A test-only build
// (sync_broken.go, tag nbdmapper_broken_flush) replaces it with one that
// does nothing, to show that the crash tests catch a FLUSH that does not
// sync (docs/crash.md).
func syncDevice(d backing.Device) error { return d.Sync() }
