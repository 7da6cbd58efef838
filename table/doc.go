// Package table parses device-mapper tables in dmsetup syntax and maps byte
// ranges of the virtual device they describe onto backing devices.
//
//	client -> nbdtarget -> table -> flush / discard -> backing
//
// A table is a list of lines `<start> <length> <target> <args...>` in 512-byte
// sectors; each line's Target maps its part of the virtual device to Extents
// on backing devices (linear, striped), or to nothing (zero, error). Sectors
// are a distinct type from bytes; Sector.Bytes is the one conversion, done
// where a target turns its geometry into byte extents.
//
// Parse reads a table, opening devices through an Opener (a *backing.Pool),
// and reports every problem as an *Error naming file and line and wrapping a
// sentinel from errors.go. Target types are constructed by name from the one
// map in registry.go, one type per file (linear.go, striped.go, zero.go,
// error.go), like dm's target_type.
package table
