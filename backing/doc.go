// Package backing is the bottom of nbdmapper's data flow: the files and block
// devices that table segments map onto.
//
//	client -> nbdtarget -> table -> flush / discard -> backing
//
// A Device is the one interface everything above talks to. File (regular files
// and block devices) is the real thing; Mem is an in-memory device for tests;
// wrappers such as Faulty and Recorder embed another Device and override only
// what they change. A Pool opens each distinct underlying file or block device
// exactly once, however many paths, segments or tables name it, so that the
// flush and discard engines see one Device per disk and can deduplicate work.
package backing
