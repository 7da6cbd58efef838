package table

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"math"
	"strings"

	"github.com/nbdmapper/nbdmapper/backing"
)

// MaxTargets is the most lines one table may have: the kernel's DM_MAX_TARGETS.
const MaxTargets = 1 << 20

// maxLineBytes bounds one table line, so that a file with no newline cannot
// make Parse buffer it whole. It leaves room for tens of thousands of stripes.
const maxLineBytes = 1 << 20

// maxSector is the largest sector count whose size in bytes fits an int64,
// so that Sector.Bytes never overflows for any number a table accepts.
const maxSector = Sector(math.MaxInt64 / SectorSize)

// Opener gives constructors the backing device a table names (a path or
// major:minor). *backing.Pool satisfies it, so that each distinct device is
// opened once however many lines, tables or paths name it.
type Opener interface {
	Open(name string) (backing.Device, error)
}

// Releaser is an Opener that counts the devices it hands out, as
// *backing.Pool does: Release gives back what one Open returned. A table
// releases every device it opened when it is closed, and Parse those of a
// table that failed, so that a device no table names is closed.
type Releaser interface {
	Release(backing.Device) error
}

// Parse reads a table in dmsetup syntax:
//
//	# comment
//	<start> <length> <target> [<args>...]   # trailing comment
//
// in 512-byte sectors. Lines must start at 0 and follow each other without a
// gap or overlap. Fields are separated by spaces or tabs; a field that starts
// with '#' starts a comment. Devices are opened through open, each name once
// per Parse call. The table holds them until it is closed; on error Parse
// closes the targets it built before the failing line and, if open is a
// Releaser, releases the devices it opened.
//
// Every error is an *Error naming file and 1-based line, wrapping one of the
// sentinels in errors.go.
//
// Parse does one allocation per line for the arguments (none for targets
// without arguments) plus what the target keeps; device names are interned.
func Parse(file string, r io.Reader, open Opener) (*Table, error) {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 64<<10), maxLineBytes)
	devs := &devCache{open: open, m: make(map[string]devEntry)}
	var (
		lines  = make([]Line, 0, 64)
		done   [][]Line // full chunks of lines, before lines
		count  int
		next   Sector
		bounds [][2]int
		args   []string
		lineNo int
	)
	fail := func(err error) (*Table, error) {
		// Release what the lines built so far hold (a snapshot's claim on
		// its COW device and its registration with the origin), as the
		// kernel tears down a table whose load failed.
		for _, c := range done {
			closeTargets(c)
		}
		closeTargets(lines)
		devs.release()
		return nil, &Error{File: file, Line: lineNo, Err: err}
	}
	for sc.Scan() {
		lineNo++
		b := sc.Bytes()
		bounds = fields(bounds[:0], b)
		if len(bounds) == 0 {
			continue
		}
		if count == MaxTargets {
			return fail(fmt.Errorf("%w: more than %d", ErrTooMany, MaxTargets))
		}
		if len(bounds) < 3 {
			return fail(fmt.Errorf("%w: want <start> <length> <target> [<args>...], got %d fields", ErrArgCount, len(bounds)))
		}
		field := func(i int) []byte { return b[bounds[i][0]:bounds[i][1]] }
		start, err := parseSector("start", field(0))
		if err != nil {
			return fail(err)
		}
		length, err := parseSector("length", field(1))
		if err != nil {
			return fail(err)
		}
		if length == 0 {
			return fail(ErrZeroLength)
		}
		if start != next {
			switch {
			case count == 0:
				return fail(fmt.Errorf("%w: the first line starts at %d, not 0", ErrGap, start))
			case start > next:
				return fail(fmt.Errorf("%w: starts at %d, leaving a gap after the previous line's end at %d", ErrGap, start, next))
			default:
				return fail(fmt.Errorf("%w: starts at %d, overlapping the previous line, which ends at %d", ErrGap, start, next))
			}
		}
		if length > maxSector-start {
			return fail(fmt.Errorf("%w: line ends past sector %d", ErrNumber, maxSector))
		}
		name := field(2)
		ctor, ok := registry[string(name)]
		if !ok {
			return fail(fmt.Errorf("%w %q", ErrUnknownTarget, name))
		}
		args = args[:0]
		if len(bounds) > 3 {
			// One string for all arguments; each argument is a slice of it.
			lo, hi := bounds[3][0], bounds[len(bounds)-1][1]
			s := string(b[lo:hi])
			for _, f := range bounds[3:] {
				args = append(args, s[f[0]-lo:f[1]-lo])
			}
		}
		t, err := ctor(devs, start, length, args)
		if err != nil {
			return fail(fmt.Errorf("%s: %w", name, err))
		}
		if len(lines) == cap(lines) && len(lines) > 0 {
			// Fill chunks (doubling up to 64Ki lines) and join them once at
			// the end: growing one slice by append to a million lines
			// allocates about five times the final size, chunks about twice.
			done = append(done, lines)
			lines = make([]Line, 0, min(2*cap(lines), 64<<10))
		}
		lines = append(lines, Line{Start: start, Length: length, Target: t})
		count++
		next = start + length
	}
	if err := sc.Err(); err != nil {
		lineNo++ // the line being read when it failed
		if errors.Is(err, bufio.ErrTooLong) {
			return fail(fmt.Errorf("%w: more than %d bytes", ErrLineTooLong, maxLineBytes))
		}
		return fail(err)
	}
	if count == 0 {
		return nil, &Error{File: file, Err: ErrEmpty} // nothing opened
	}
	if len(done) > 0 {
		all := make([]Line, 0, count)
		for _, c := range done {
			all = append(all, c...)
		}
		lines = append(all, lines...)
	}
	t := newTable(file, lines)
	t.held, t.release = devs.held, devs.open
	return t, nil
}

// spaces marks the bytes that separate fields: space, tab, and the
// carriage return of CRLF files, plus vertical tab and form feed.
var spaces = [256]bool{' ': true, '\t': true, '\r': true, '\v': true, '\f': true}

func isSpace(c byte) bool { return spaces[c] }

// fields appends the [start, end) bounds of each field of line to dst and
// stops at a field that starts with '#' (a comment). A '#' inside a field,
// as in a path "disk#2", is part of it.
func fields(dst [][2]int, line []byte) [][2]int {
	i := 0
	for {
		for i < len(line) && isSpace(line[i]) {
			i++
		}
		if i == len(line) || line[i] == '#' {
			return dst
		}
		j := i
		for j < len(line) && !isSpace(line[j]) {
			j++
		}
		dst = append(dst, [2]int{i, j})
		i = j
	}
}

// parseDec parses a plain decimal number no larger than max: ASCII digits
// only, no sign, no base prefix. Leading zeros are allowed (as the kernel's
// parsers allow them); canonical output drops them.
func parseDec[S string | []byte](s S, max uint64) (uint64, string) {
	if len(s) == 0 {
		return 0, "empty"
	}
	var v uint64
	for i := 0; i < len(s); i++ {
		c := s[i]
		if c < '0' || c > '9' {
			return 0, "not a decimal number"
		}
		d := uint64(c - '0')
		if v > (max-d)/10 {
			return 0, fmt.Sprintf("out of range (max %d)", max)
		}
		v = v*10 + d
	}
	return v, ""
}

// parseSector parses a start, length or offset in sectors.
func parseSector[S string | []byte](what string, s S) (Sector, error) {
	v, why := parseDec(s, uint64(maxSector))
	if why != "" {
		return 0, fmt.Errorf("%w: %s %q: %s", ErrNumber, what, s, why)
	}
	return Sector(v), nil
}

// parseUint32 parses a count that the kernel reads with kstrtouint.
func parseUint32(what, s string) (uint32, error) {
	v, why := parseDec(s, math.MaxUint32)
	if why != "" {
		return 0, fmt.Errorf("%w: %s %q: %s", ErrNumber, what, s, why)
	}
	return uint32(v), nil
}

// devCache is the Opener Parse hands to constructors. It opens each name
// once per table, so that a million lines on one disk make one Open call,
// and interns names, so that targets keep one copy of each.
type devCache struct {
	open Opener
	m    map[string]devEntry
	held []backing.Device // what each successful Open returned
}

type devEntry struct {
	name string
	dev  backing.Device
	err  error
}

var errNoOpener = errors.New("no device opener")

func (c *devCache) lookup(name string) devEntry {
	if e, ok := c.m[name]; ok {
		return e
	}
	e := devEntry{name: strings.Clone(name)}
	e.dev, e.err = openDev(c.open, e.name)
	if e.err == nil {
		c.held = append(c.held, e.dev)
	}
	c.m[e.name] = e
	return e
}

// release gives back what the cache opened (a failed Parse's devices).
func (c *devCache) release() {
	release(c.open, c.held)
	c.held = nil
}

// release gives each of devs back to open, if open counts them.
func release(open Opener, devs []backing.Device) error {
	r, ok := open.(Releaser)
	if !ok {
		return nil
	}
	var errs []error
	for _, d := range devs {
		errs = append(errs, r.Release(d))
	}
	return errors.Join(errs...)
}

func (c *devCache) Open(name string) (backing.Device, error) {
	e := c.lookup(name)
	return e.dev, e.err
}

func openDev(open Opener, name string) (backing.Device, error) {
	if open == nil {
		return nil, errNoOpener
	}
	dev, err := open.Open(name)
	if err == nil && dev == nil {
		err = errors.New("opener returned no device")
	}
	return dev, err
}

// openArea opens the device name for a target that maps n sectors at
// sector off of it, and checks that the area lies inside the device (a
// device's size is rounded down to whole sectors, as the kernel does). It
// returns the interned name to keep for Args.
func openArea(open Opener, name string, off, n Sector) (backing.Device, string, error) {
	var dev backing.Device
	var err error
	if c, ok := open.(*devCache); ok {
		e := c.lookup(name)
		dev, name, err = e.dev, e.name, e.err
	} else {
		dev, err = openDev(open, name)
	}
	if err != nil {
		return nil, "", fmt.Errorf("%w %s: %w", ErrDevice, name, err)
	}
	size := Sector(dev.Size() / SectorSize)
	if off > size || n > size-off {
		return nil, "", fmt.Errorf("%w: %s: sectors [%d, %d) but the device has %d",
			ErrBeyondDevice, name, off, off+n, size)
	}
	return dev, name, nil
}
