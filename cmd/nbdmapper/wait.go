package main

import (
	"errors"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/nbdmapper/nbdmapper/control"
)

// mergeLine is one snapshot-merge line's status, as `dmsetup status`
// prints it after `<start> <length> snapshot-merge`:
// `<sectors_allocated>/<total_sectors> <metadata_sectors>`, or a word
// (Invalid, Merge failed, Overflow) when the merge cannot go on.
type mergeLine struct {
	start              int64
	alloc, total, meta int64
	failed             string // the word, if any
}

// remaining is the COW's sectors still to merge; capacity, its data
// sectors. The merge is done when nothing remains.
func (m mergeLine) remaining() int64 { return m.alloc - m.meta }
func (m mergeLine) capacity() int64  { return m.total - m.meta }

// mergeLines picks the snapshot-merge lines out of a device's status
// lines (`<start> <length> <target> <status>`, one per table line).
func mergeLines(status string) ([]mergeLine, error) {
	var ms []mergeLine
	for _, line := range strings.Split(strings.TrimSpace(status), "\n") {
		f := strings.Fields(line)
		if len(f) < 3 || f[2] != "snapshot-merge" {
			continue
		}
		start, err := strconv.ParseInt(f[0], 10, 64)
		if err != nil {
			return nil, fmt.Errorf("status line %q: %w", line, err)
		}
		m := mergeLine{start: start}
		st := f[3:]
		if len(st) != 2 || !strings.Contains(st[0], "/") {
			m.failed = strings.Join(st, " ")
			ms = append(ms, m)
			continue
		}
		a, t, _ := strings.Cut(st[0], "/")
		var errs [3]error
		m.alloc, errs[0] = strconv.ParseInt(a, 10, 64)
		m.total, errs[1] = strconv.ParseInt(t, 10, 64)
		m.meta, errs[2] = strconv.ParseInt(st[1], 10, 64)
		if err := errors.Join(errs[:]...); err != nil || m.alloc < m.meta || m.total < m.alloc {
			return nil, fmt.Errorf("status line %q: not <allocated>/<total> <metadata>", line)
		}
		ms = append(ms, m)
	}
	return ms, nil
}

// mergedPercent is how far the merges of ms are: the share of the COWs' data space that holds nothing left to merge. A
// snapshot that changed 10% of its COW starts at 90%; every merge ends at
// 100%.
func mergedPercent(ms []mergeLine) float64 {
	var rem, capa int64
	for _, m := range ms {
		rem += m.remaining()
		capa += m.capacity()
	}
	if capa == 0 {
		return 100
	}
	return 100 * (1 - float64(rem)/float64(capa))
}

// runWait follows NAME's snapshot-merge until it ends, as `lvconvert
// --merge -i` does: on a terminal one line redrawn with a bar, the rate and
// the time left; otherwise `NAME: merged: 42.0%` once per interval. It
// returns an error if the merge fails or NAME has no snapshot-merge line.
func runWait(args []string) error {
	fs := newFlagSet("wait")
	path := fs.String("control", defaultControl, "the server's control socket (serve --control)")
	interval := fs.Duration("interval", time.Second, "how often to ask the server how far the merge is")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() != 1 {
		return errors.New("wait takes one NAME")
	}
	if *interval <= 0 {
		return fmt.Errorf("--interval %v: must be positive", *interval)
	}
	name := fs.Arg(0)
	var p progress
	if _, err := unix.IoctlGetTermios(int(os.Stdout.Fd()), unix.TCGETS); err == nil {
		p.bar = true
	}
	for {
		st, err := control.Call(*path, control.Request{Op: "status", Name: name})
		if err != nil {
			if errors.Is(err, os.ErrNotExist) {
				return fmt.Errorf("%w (is nbdmapper serve running with --control %s?)", err, *path)
			}
			return err
		}
		ms, err := mergeLines(st)
		if err != nil {
			return err
		}
		if len(ms) == 0 {
			return fmt.Errorf("%s has no snapshot-merge line in its live table", name)
		}
		for _, m := range ms {
			if m.failed != "" {
				p.end(os.Stdout)
				return fmt.Errorf("%s: snapshot-merge at sector %d: %s", name, m.start, m.failed)
			}
		}
		p.show(os.Stdout, name, ms, time.Now())
		if mergedPercent(ms) == 100 {
			p.end(os.Stdout)
			return nil
		}
		time.Sleep(*interval)
	}
}

// progress draws wait's output. The rate is the sectors merged since the
// first sample over the time since.
//
// The percentage shown never goes back. The status's numbers can, by a
// chunk: when the merge empties a metadata area, the store shows one area
// fewer (metadata_sectors falls by a chunk) before the allocation pointer
// has stepped back over that area's metadata chunk, so for a moment
// allocated - metadata counts it as data still to merge.
type progress struct {
	bar       bool
	shown     float64 // the highest percentage shown
	first     time.Time
	firstLeft int64
	drawn     bool
}

func (p *progress) show(w io.Writer, name string, ms []mergeLine, now time.Time) {
	pct := max(p.shown, mergedPercent(ms))
	p.shown = pct
	var left int64
	for _, m := range ms {
		left += m.remaining()
	}
	if !p.bar {
		fmt.Fprintf(w, "%s: merged: %.1f%%\n", name, pct)
		return
	}
	if p.first.IsZero() {
		p.first, p.firstLeft = now, left
	}
	const width = 30
	fill := int(pct / 100 * width)
	line := fmt.Sprintf("%s: [%s%s] %5.1f%%", name, strings.Repeat("#", fill), strings.Repeat(".", width-fill), pct)
	if el := now.Sub(p.first); el > 0 && p.firstLeft > left {
		rate := float64(p.firstLeft-left) * 512 / el.Seconds() // bytes per second
		eta := time.Duration(float64(left) * 512 / rate * float64(time.Second)).Round(time.Second)
		line += fmt.Sprintf("  %s/s  %s left", humanBytes(rate), eta)
	}
	fmt.Fprintf(w, "\r\033[K%s", line)
	p.drawn = true
}

// end finishes a drawn bar's line.
func (p *progress) end(w io.Writer) {
	if p.drawn {
		fmt.Fprintln(w)
		p.drawn = false
	}
}

func humanBytes(b float64) string {
	for _, u := range []string{"B", "KiB", "MiB", "GiB"} {
		if b < 1024 {
			return fmt.Sprintf("%.1f %s", b, u)
		}
		b /= 1024
	}
	return fmt.Sprintf("%.1f TiB", b)
}

// mergePercentLines adds, after each device's snapshot-merge status line
// in a /status page (`NAME: <start> <length> snapshot-merge <status>`),
// a line saying how far it is: `NAME: snapshot-merge <start>: merged: 42.0%`.
func mergePercentLines(page string) string {
	var b strings.Builder
	for _, line := range strings.SplitAfter(page, "\n") {
		b.WriteString(line)
		name, rest, ok := strings.Cut(line, ": ")
		if !ok {
			continue
		}
		ms, err := mergeLines(rest)
		if err != nil || len(ms) != 1 || ms[0].failed != "" {
			continue
		}
		fmt.Fprintf(&b, "%s: snapshot-merge %d: merged: %.1f%%\n", name, ms[0].start, mergedPercent(ms))
	}
	return b.String()
}
