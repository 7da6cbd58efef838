package table

import (
	"errors"
	"fmt"
	"strconv"
	"strings"

	"github.com/nbdmapper/nbdmapper/backing"
	"github.com/nbdmapper/nbdmapper/snapshot"
)

// ErrSnapshot wraps the snapshot targets' argument and store errors (the
// snapshot package's sentinels are wrapped too: errors.Is works for both).
var ErrSnapshot = errors.New("snapshot")

// snapshot <origin> <cow> <P|PO|N> <chunk> [<#features> [discard_zeroes_cow] [discard_passdown_origin]]
//
// newSnapshot stacks a copy-on-write snapshot.Snapshot on the origin and
// COW devices and maps the whole line to it. The line's sectors are the
// origin's sectors: dm passes the bio's sector through unchanged, so a line
// at sector S reads origin sector S, and chunk numbers in the COW count
// from the origin's start (a snapshot line normally starts at 0 and covers
// the origin). An existing persistent COW keeps its on-disk chunk size,
// which Args then prints, as dmsetup does.
func newSnapshot(open Opener, start, length Sector, args []string) (Target, error) {
	return openSnapshot("snapshot", open, start, length, args, snapshot.Options{})
}

// openSnapshot parses the arguments the snapshot and snapshot-merge targets
// share and opens the snapshot device; opt carries what the target adds.
func openSnapshot(typ string, open Opener, start, length Sector, args []string, opt snapshot.Options) (Target, error) {
	if len(args) < 4 {
		return nil, fmt.Errorf("%w: want <origin> <cow> <P|PO|N> <chunk> [<#features> <feature>...], got %d arguments", ErrArgCount, len(args))
	}
	if len(args) > 4 {
		n, err := parseUint32("#features", args[4])
		if err != nil {
			return nil, err
		}
		if n > 2 {
			return nil, fmt.Errorf("%w: invalid number of feature arguments %d", ErrSnapshot, n)
		}
		if len(args) != 5+int(n) {
			return nil, fmt.Errorf("%w: %d feature arguments announced, %d given", ErrArgCount, n, len(args)-5)
		}
		for _, f := range args[5:] {
			switch strings.ToLower(f) {
			case "discard_zeroes_cow":
				opt.DiscardZeroesCOW = true
			case "discard_passdown_origin":
				opt.DiscardPassdownOrigin = true
			default:
				return nil, fmt.Errorf("%w: unrecognised feature %q", ErrSnapshot, f)
			}
		}
	}
	typ0, err := snapshot.ParseType(args[2])
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrSnapshot, err)
	}
	opt.Type = typ0
	chunk, err := parseUint32("chunk size", args[3])
	if err != nil {
		return nil, err
	}
	if chunk != 0 || opt.Type == snapshot.Transient {
		if err := snapshot.CheckChunk(chunk); err != nil {
			return nil, fmt.Errorf("%w: %w", ErrSnapshot, err)
		}
	}
	opt.ChunkSectors = chunk
	opt.Size = (start + length).Bytes()
	origin, originName, err := openArea(open, args[0], 0, start+length)
	if err != nil {
		return nil, err
	}
	cow, cowName, err := openArea(open, args[1], 0, 0)
	if err != nil {
		return nil, err
	}
	s, err := snapshot.Open(typ+" "+originName+" "+cowName, origin, cow, opt)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrSnapshot, err)
	}
	return &snapshotTarget{typ: typ, s: s, base: start.Bytes(), origin: originName, cow: cowName}, nil
}

// snapshotTarget is the snapshot and snapshot-merge targets: they differ
// only in what the stacked device does.
type snapshotTarget struct {
	typ         string
	s           *snapshot.Snapshot
	base        int64 // the line's start in bytes: its offset 0 is the device's base
	origin, cow string
}

func (t *snapshotTarget) Type() string   { return t.typ }
func (t *snapshotTarget) Status() string { return t.s.Status() }

func (t *snapshotTarget) Args() []string {
	args := []string{t.origin, t.cow, t.s.Type().String(), strconv.FormatUint(uint64(t.s.ChunkSectors()), 10)}
	return append(args, t.s.Features()...)
}

// Map sends the whole line to the stacked device, at the same sectors,
// and the device does the copy-on-write work itself.
func (t *snapshotTarget) Map(off, n int64, yield func(Extent) bool) bool {
	return yield(Extent{Kind: KindMapped, Dev: t.s, Off: t.base + off, VOff: off, Len: n})
}

// Devices are the COW and origin devices as opened, a mapped device among
// them left as it is: a flush expands it then, so that it reaches the
// devices its table maps at the time, not those it mapped when this line
// was parsed. Snapshot.Sync itself syncs the COW.
func (t *snapshotTarget) Devices() []backing.Device { return t.s.Devices() }

// RequestMemory is the copy buffer a first write holds (see
// snapshot.CopyMemory).
func (t *snapshotTarget) RequestMemory() int64 { return snapshot.CopyMemory }

// Made is the snapshot device the line maps to.
func (t *snapshotTarget) Made() backing.Device { return t.s }

// Activate and Deactivate follow the table's resume and suspend: a
// handover destination takes its store, a merge starts or stops.
func (t *snapshotTarget) Activate()   { t.s.Activate() }
func (t *snapshotTarget) Deactivate() { t.s.Deactivate() }

// Close unregisters the snapshot from its origin and frees its COW device
// for another table.
func (t *snapshotTarget) Close() error { return t.s.Close() }
