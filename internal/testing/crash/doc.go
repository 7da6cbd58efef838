// Package crash checks crash consistency the way xfstests replays
// dm-log-writes logs and CrashMonkey explores crash states: a workload runs
// through the real server onto real files wrapped in a backing.WriteLog,
// and afterwards a Replayer rebuilds the disks as a power cut could have
// left them at every crash point, while a Model of what the clients were
// promised checks each image.
//
//	clients -> nbdtarget.Server -> table -> flush -> backing.WriteLog -> files
//	                                                      |
//	                 entries (writes with data, syncs) <--+
//	                       |
//	Replayer: for each sync (and each flush reply), the durable writes,
//	          then none / all / random subsets of the volatile ones,
//	          reordered and torn at sector granularity  -> image files
//	                       |
//	check: table.ParseSet over the images (as `nbdmapper check` would),
//	       snapshot stores load as the kernel's dm-snapshot reads them,
//	       every write acknowledged before a completed flush (or with FUA)
//	       reads back through the table (Model.Check)
//
// It sits beside the data flow, not in it: nothing in the server imports
// it. The workloads are in crash_test.go; docs/crash.md has the figures.
package crash
