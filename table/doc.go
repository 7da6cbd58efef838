// Package table parses device-mapper tables in dmsetup syntax and maps byte
// ranges of the virtual device they describe onto backing devices.
//
//	client -> nbdtarget -> table -> flush / discard -> backing
//
// A table is a list of lines `<start> <length> <target> <args...>` in 512-byte
// sectors; each line's Target maps its part of the virtual device to Extents
// on backing devices (linear, striped), or to nothing (zero, error). Sectors
// are a distinct type from bytes and are converted once, when a line is built.
package table
