package backing

import (
	"fmt"
	"sync"
)

// LogEntry is one completed device call in a WriteLog.
//
// A write is logged when it completes, with its bytes, as dm-log-writes
// logs a bio when it ends: until then the data may or may not have reached
// the disk, and a crash image may hold any of it. A sync is logged when it
// completes, but it makes durable only the writes that had completed when
// it was issued: Covers counts the log entries at that moment, and the
// writes of Dev among them are durable once the sync entry is in the log.
//
//	i  dev op      covers
//	0  0   write A
//	1  0   write B          <- completes while sync 3 runs
//	2  1   write C
//	3  0   sync    1        <- issued after A completed, before B did:
//	                           A is durable, B is not; C is another device's
type LogEntry struct {
	Dev      int   // the device's index in the log (WriteLog.Wrap order)
	Op       Op    // OpWrite, OpDiscard, OpZero or OpSync
	Off, Len int64 // the range, bytes
	Data     []byte
	Punch    bool // Zero's mayPunch
	FUA      bool // a write made durable by itself (WriteAtDSync)
	Covers   int  // OpSync: log length when the sync was issued
}

func (e LogEntry) String() string {
	switch e.Op {
	case OpSync:
		return fmt.Sprintf("dev%d sync covers=%d", e.Dev, e.Covers)
	case OpWrite:
		if e.FUA {
			return fmt.Sprintf("dev%d write %d+%d fua", e.Dev, e.Off, e.Len)
		}
	}
	return fmt.Sprintf("dev%d %s %d+%d", e.Dev, e.Op, e.Off, e.Len)
}

// WriteLog records, in one order across every device it wraps, each write
// (with its data), discard, zero and sync that completed on them: a
// userspace dm-log-writes. A replayer builds from it the disk images a
// power cut could leave at any moment (package crash). Reads are not
// logged. Calls that fail are not logged either: a failed write may still
// have changed the disk, and tests of I/O errors use Faulty instead.
type WriteLog struct {
	mu      sync.Mutex
	entries []LogEntry
	devs    []*LogWrites
}

// NewWriteLog returns an empty log.
func NewWriteLog() *WriteLog { return &WriteLog{} }

// Wrap returns d wrapped so that its calls go to the log. Wrapping the
// same device again returns the same wrapper. It can serve, composed with
// the flush engine's Track, as a Pool's Wrap function.
func (l *WriteLog) Wrap(d Device) *LogWrites {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, w := range l.devs {
		if w.Device == d {
			return w
		}
	}
	w := &LogWrites{Device: d, log: l, dev: len(l.devs)}
	l.devs = append(l.devs, w)
	return w
}

// Devices lists the wrapped devices; LogEntry.Dev indexes it.
func (l *WriteLog) Devices() []*LogWrites {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]*LogWrites(nil), l.devs...)
}

// Len is the number of entries so far. Taken right after an event a test
// observes (a flush reply), it places the event in the log: every call
// that completed before the event is at an index below it.
func (l *WriteLog) Len() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.entries)
}

// Entries returns the log so far. The entries share their Data with the
// log, which never changes it.
func (l *WriteLog) Entries() []LogEntry {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]LogEntry(nil), l.entries...)
}

func (l *WriteLog) add(e LogEntry) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.entries = append(l.entries, e)
}

// LogWrites is one device of a WriteLog.
type LogWrites struct {
	Device
	log *WriteLog
	dev int
}

var _ Device = (*LogWrites)(nil)

// Index is the device's LogEntry.Dev.
func (w *LogWrites) Index() int { return w.dev }

func (w *LogWrites) WriteAt(p []byte, off int64) (int, error) {
	n, err := w.Device.WriteAt(p, off)
	if err == nil {
		w.logWrite(p, off, false)
	}
	return n, err
}

func (w *LogWrites) logWrite(p []byte, off int64, fua bool) {
	w.log.add(LogEntry{Dev: w.dev, Op: OpWrite, Off: off, Len: int64(len(p)), Data: append([]byte(nil), p...), FUA: fua})
}

// WriteAtDSync is a FUA write: the inner device's WriteAtDSync where it
// has one (a File: pwritev2 RWF_DSYNC), else a write and a sync of the
// inner device. It is logged as a write that is durable by itself.
func (w *LogWrites) WriteAtDSync(p []byte, off int64) (int, error) {
	var n int
	var err error
	if ds, ok := w.Device.(interface {
		WriteAtDSync(p []byte, off int64) (int, error)
	}); ok {
		n, err = ds.WriteAtDSync(p, off)
	} else if n, err = w.Device.WriteAt(p, off); err == nil {
		err = w.Device.Sync()
	}
	if err == nil {
		w.logWrite(p, off, true)
	}
	return n, err
}

func (w *LogWrites) Sync() error {
	covers := w.log.Len()
	err := w.Device.Sync()
	if err == nil {
		w.log.add(LogEntry{Dev: w.dev, Op: OpSync, Covers: covers})
	}
	return err
}

func (w *LogWrites) Discard(off, n int64) error {
	err := w.Device.Discard(off, n)
	if err == nil {
		w.log.add(LogEntry{Dev: w.dev, Op: OpDiscard, Off: off, Len: n})
	}
	return err
}

func (w *LogWrites) Zero(off, n int64, mayPunch bool) error {
	err := w.Device.Zero(off, n, mayPunch)
	if err == nil {
		w.log.add(LogEntry{Dev: w.dev, Op: OpZero, Off: off, Len: n, Punch: mayPunch})
	}
	return err
}
