package table

import "github.com/nbdmapper/nbdmapper/snapshot"

// snapshot-merge <origin> <cow> <P|PO> <chunk> [<#features> [discard_zeroes_cow] [discard_passdown_origin]]
//
// newSnapshotMerge takes the snapshot target's arguments and merges the
// COW back into the origin (dm's snapshot-merge): once the table is active
// a background merge copies the COW's chunks to the origin, at most at the
// process's merge rate (snapshot.Configure, serve --merge-rate), while the
// line serves the snapshot's contents. It takes the place of the origin's
// snapshot-origin line; loaded on the COW of a snapshot in use, it takes
// that snapshot's store over when resumed (lvconvert --merge). A P store
// being merged resumes the merge when served again. Transient (N) stores
// cannot be merged. Status falls as the merge proceeds and is done when
// sectors_allocated equals metadata_sectors.
func newSnapshotMerge(open Opener, start, length Sector, args []string) (Target, error) {
	return openSnapshot("snapshot-merge", open, start, length, args, snapshot.Options{Merge: true})
}
