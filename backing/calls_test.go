package backing

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/nbdmapper/nbdmapper/internal/testing/nbdtest"
)

// hangingDisk makes Files hang on cue, as a disk that stops answering
// does: every call of a File it stalls blocks in read(2) of an empty pipe,
// a real system call holding its thread as a pread of a hung disk would,
// until release, after which calls go through again.
type hangingDisk struct {
	r, w   int
	inside atomic.Int64 // calls blocked in the hang now
	once   sync.Once
}

func newHangingDisk(t *testing.T) *hangingDisk {
	t.Helper()
	var fds [2]int
	if err := unix.Pipe2(fds[:], unix.O_CLOEXEC); err != nil { // blocking, unlike os.Pipe's
		t.Fatal(err)
	}
	h := &hangingDisk{r: fds[0], w: fds[1]}
	t.Cleanup(func() {
		h.release()
		unix.Close(h.r)
	})
	return h
}

// stall makes f's calls hang.
func (h *hangingDisk) stall(f *File) {
	f.stall = func() {
		h.inside.Add(1)
		defer h.inside.Add(-1)
		var b [1]byte
		for {
			if _, err := unix.Read(h.r, b[:]); err != unix.EINTR {
				return // EOF once released
			}
		}
	}
}

func (h *hangingDisk) release() { h.once.Do(func() { unix.Close(h.w) }) }

// dataFile opens a fresh file holding size bytes of a pattern.
func dataFile(t *testing.T, name string, size int) (*File, []byte) {
	t.Helper()
	data := bytes.Repeat([]byte(name), size/len(name)+1)[:size]
	path := filepath.Join(t.TempDir(), name)
	if err := os.WriteFile(path, data, 0o600); err != nil {
		t.Fatal(err)
	}
	f, err := OpenFile(path, false)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	return f, data
}

// threads is the process's thread count (/proc/self/status).
func threads(t *testing.T) int {
	t.Helper()
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "Threads:"); ok {
			n, err := strconv.Atoi(strings.TrimSpace(v))
			if err != nil {
				t.Fatal(err)
			}
			return n
		}
	}
	t.Fatal("no Threads line in /proc/self/status")
	return 0
}

// readers starts n goroutines each reading 4 KiB of f at block i and
// checking it against data; wait waits for them.
func readers(t *testing.T, f *File, data []byte, n int) (wait func()) {
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			off := int64(i%(len(data)/4096)) * 4096
			p := make([]byte, 4096)
			if _, err := f.ReadAt(p, off); err != nil {
				t.Errorf("read at %d: %v", off, err)
			} else if !bytes.Equal(p, data[off:off+4096]) {
				t.Errorf("read at %d: wrong data", off)
			}
		}()
	}
	return wg.Wait
}

// A hung device holds at most DeviceCalls threads however many calls it is
// given, and the other devices' calls go on meanwhile; once it answers
// again every call completes with the right data.
func TestHungFileHoldsBoundedThreads(t *testing.T) {
	const callers = 300
	hung, data := dataFile(t, "hung", 1<<20)
	other, otherData := dataFile(t, "other", 1<<20)
	disk := newHangingDisk(t)
	disk.stall(hung)
	before, threads0 := ReadCallStats(), threads(t)

	done := readers(t, hung, data, callers)
	nbdtest.Until(t, "every caller past the bound to wait, or more to get in than should", func() bool {
		return ReadCallStats().Waits-before.Waits == callers-DeviceCalls || disk.inside.Load() > DeviceCalls
	})
	if n := disk.inside.Load(); n != DeviceCalls {
		t.Errorf("%d calls in the hung device, want %d", n, DeviceCalls)
	}
	if got := ReadCallStats().InProgress - before.InProgress; got != DeviceCalls {
		t.Errorf("CallStats.InProgress grew by %d, want %d", got, DeviceCalls)
	}
	// The runtime keeps some threads spare, and earlier tests' idle
	// threads are reused: the bound is on how many more there are.
	if grew := threads(t) - threads0; grew > DeviceCalls+16 {
		t.Errorf("%d more threads with %d calls on a hung device, want at most %d", grew, callers, DeviceCalls+16)
	}
	readers(t, other, otherData, 8)() // not held up by the hung device

	disk.release()
	done()
	if n := ReadCallStats().InProgress; n != before.InProgress {
		t.Errorf("%d calls in progress after all returned, want %d", n, before.InProgress)
	}
}

// hangDevices stalls n fresh Files on disk with readers each, and waits
// until inside of disk's calls are in the hang; it returns what waits for
// the readers.
func hangDevices(t *testing.T, disk *hangingDisk, name string, n, readersEach int, inside int64) (wait func()) {
	t.Helper()
	var waits []func()
	for i := range n {
		f, data := dataFile(t, name+strconv.Itoa(i), 1<<20)
		disk.stall(f)
		waits = append(waits, readers(t, f, data, readersEach))
	}
	nbdtest.Until(t, "the hung calls to get in", func() bool { return disk.inside.Load() >= inside })
	return func() {
		for _, wait := range waits {
			wait()
		}
	}
}

// Hung devices together hold every slot of the process's and one call
// each on the reserve, no more; a device that answers then gets one call
// at a time in, and the process lives on to serve every call once the
// devices answer.
func TestHungFilesLeaveEveryDeviceACall(t *testing.T) {
	disk := newHangingDisk(t)
	before := ReadCallStats()
	full := hangDevices(t, disk, "dev", ProcessCalls/DeviceCalls, DeviceCalls, ProcessCalls)
	// One device more: one of its calls gets in on the reserve, the
	// others wait for it (or for a slot of the process's).
	waitsFull := ReadCallStats().Waits
	more := hangDevices(t, disk, "more", 1, DeviceCalls, ProcessCalls+1)
	nbdtest.Until(t, "the last device's other calls to wait, or more of them to get in", func() bool {
		return ReadCallStats().Waits-waitsFull == DeviceCalls || disk.inside.Load() > ProcessCalls+1
	})
	if n := disk.inside.Load(); n != ProcessCalls+1 {
		t.Fatalf("%d calls in hung devices, want %d", n, ProcessCalls+1) // and the read below would wait for them
	}
	if got := ReadCallStats().InProgress - before.InProgress; got != ProcessCalls+1 {
		t.Errorf("CallStats.InProgress grew by %d, want %d", got, ProcessCalls+1)
	}

	other, otherData := dataFile(t, "other", 1<<20)
	readers(t, other, otherData, 8)() // one at a time, on the reserve

	disk.release()
	full()
	more()
	if n := ReadCallStats().InProgress; n != before.InProgress {
		t.Errorf("%d calls in progress after all returned, want %d", n, before.InProgress)
	}
}

// Once the reserve is spent too, a call waits, holding no thread, for a
// slot of the process's or for a call on the reserve to end: devices that
// held only calls on the reserve answering again let it in while the
// others still hang.
func TestHungFilesSpendTheReserve(t *testing.T) {
	const reserve = 2
	saved := reserveCalls
	reserveCalls = make(chan struct{}, reserve)
	t.Cleanup(func() { reserveCalls = saved })
	slots, spent := newHangingDisk(t), newHangingDisk(t)
	before := ReadCallStats()
	full := hangDevices(t, slots, "slots", ProcessCalls/DeviceCalls, DeviceCalls, ProcessCalls)
	onReserve := hangDevices(t, spent, "reserve", reserve, 1, reserve)

	other, otherData := dataFile(t, "other", 1<<20)
	done := make(chan struct{})
	go func() {
		readers(t, other, otherData, 1)()
		close(done)
	}()
	// Each call that found the process's slots taken waited once.
	nbdtest.Until(t, "the read of the device that answers to wait", func() bool {
		return ReadCallStats().Waits-before.Waits == reserve+1
	})
	select {
	case <-done:
		t.Fatal("a read got in with the process's slots and the reserve all held")
	default:
	}

	spent.release()
	onReserve()
	nbdtest.Until(t, "the read to get in on the reserve", func() bool {
		select {
		case <-done:
			return true
		default:
			return false
		}
	})
	if n := slots.inside.Load(); n != ProcessCalls {
		t.Errorf("%d calls in the devices still hung, want %d", n, ProcessCalls)
	}

	slots.release()
	full()
	if n := ReadCallStats().InProgress; n != before.InProgress {
		t.Errorf("%d calls in progress after all returned, want %d", n, before.InProgress)
	}
}

// Close leaves the descriptor open to the calls in progress, and the last
// of them closes it: they use its number directly, and the next file opened
// gets that number. Closed under them, the sync hung here would have synced
// nothing (EBADF), or some other file. Close itself returns at once, so
// that a device whose calls hang does not hang whoever closes it; calls
// after Close fail with os.ErrClosed.
func TestCloseLeavesDescriptorToCalls(t *testing.T) {
	f, _ := dataFile(t, "f", 1<<20)
	hang := newHangingDisk(t)
	hang.stall(f)
	synced := make(chan error, 1)
	go func() { synced <- f.Sync() }()
	nbdtest.Until(t, "the sync to hang", func() bool { return hang.inside.Load() == 1 })

	if err := f.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	fd := f.fd
	link := fmt.Sprintf("/proc/self/fd/%d", fd)
	if target, err := os.Readlink(link); err != nil || target != f.name {
		t.Fatalf("with a sync in progress, Close closed the descriptor: %s is %q, %v", link, target, err)
	}
	for name, call := range map[string]func() error{
		"Sync":    f.Sync,
		"Discard": func() error { return f.Discard(0, 4096) },
		"ReadAt":  func() error { _, err := f.ReadAt(make([]byte, 1), 0); return err },
		"Holes":   func() error { _, err := f.Holes(0, 4096); return err },
		"Close":   f.Close,
	} {
		if err := call(); !errors.Is(err, os.ErrClosed) {
			t.Errorf("%s after Close: %v, want os.ErrClosed", name, err)
		}
	}
	hang.release()
	if err := nbdtest.Recv(t, synced, "the sync"); err != nil {
		t.Errorf("the sync in progress at Close: %v", err)
	}
	if target, err := os.Readlink(link); err == nil && target == f.name {
		t.Errorf("the last call out left the descriptor open: %s is still %q", link, target)
	}
}
