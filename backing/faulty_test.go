package backing

import (
	"bytes"
	"errors"
	"slices"
	"testing"

	"golang.org/x/sys/unix"
)

func TestFaultyVolatileUntilSync(t *testing.T) {
	a := bytes.Repeat([]byte{0xaa}, 4096)
	b := bytes.Repeat([]byte{0xbb}, 4096)
	zero := make([]byte, 4096)
	type step struct {
		op   string // write-a, write-b, discard, sync, crash
		off  int64
		want []byte // what reading back 4096 bytes at want-off gives, after the step
	}
	cases := []struct {
		name string
		// steps run in order; after all of them the inner device at 0 must
		// hold innerWant and the wrapper must read readWant.
		steps     []step
		innerWant []byte
		readWant  []byte
	}{
		{"write then crash loses it", []step{{op: "write-a"}, {op: "crash"}}, zero, zero},
		{"write sync crash keeps it", []step{{op: "write-a"}, {op: "sync"}, {op: "crash"}}, a, a},
		{"unsynced overwrite is lost", []step{{op: "write-a"}, {op: "sync"}, {op: "write-b"}, {op: "crash"}}, a, a},
		{"cache is read back", []step{{op: "write-a"}, {op: "sync"}, {op: "write-b"}}, a, b},
		{"writes apply in order", []step{{op: "write-a"}, {op: "write-b"}, {op: "sync"}}, b, b},
		{"discard reads zero and survives sync", []step{{op: "write-a"}, {op: "sync"}, {op: "discard"}, {op: "sync"}, {op: "crash"}}, zero, zero},
		{"discard lost in crash", []step{{op: "write-a"}, {op: "sync"}, {op: "discard"}, {op: "crash"}}, a, a},
	}
	for name, inner := range devices(t) {
		for _, tc := range cases {
			t.Run(name+"/"+tc.name, func(t *testing.T) {
				if err := inner.Zero(0, 4096, true); err != nil {
					t.Fatal(err)
				}
				f := NewFaulty(inner)
				for _, s := range tc.steps {
					var err error
					switch s.op {
					case "write-a":
						_, err = f.WriteAt(a, 0)
					case "write-b":
						_, err = f.WriteAt(b, 0)
					case "discard":
						err = f.Discard(0, 4096)
					case "sync":
						err = f.Sync()
					case "crash":
						f.Crash()
					}
					if err != nil {
						t.Fatalf("%s: %v", s.op, err)
					}
				}
				got := make([]byte, 4096)
				if _, err := inner.ReadAt(got, 0); err != nil || !bytes.Equal(got, tc.innerWant) {
					t.Errorf("inner holds %x..., want %x... (err %v)", got[:4], tc.innerWant[:4], err)
				}
				if _, err := f.ReadAt(got, 0); err != nil || !bytes.Equal(got, tc.readWant) {
					t.Errorf("wrapper reads %x..., want %x... (err %v)", got[:4], tc.readWant[:4], err)
				}
			})
		}
	}
}

func TestFaultyPartialOverlay(t *testing.T) {
	inner := NewMem("m", 1<<16)
	f := NewFaulty(inner)
	if _, err := inner.WriteAt(bytes.Repeat([]byte{1}, 300), 100); err != nil {
		t.Fatal(err)
	}
	if _, err := f.WriteAt([]byte{9, 9, 9}, 198); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, 6)
	if _, err := f.ReadAt(got, 196); err != nil {
		t.Fatal(err)
	}
	if want := []byte{1, 1, 9, 9, 9, 1}; !bytes.Equal(got, want) {
		t.Fatalf("read %v, want %v", got, want)
	}
	if _, err := f.WriteAt([]byte{1}, 1<<16); err == nil {
		t.Fatal("write past the end succeeded")
	}
}

func TestFaultyInjectedErrors(t *testing.T) {
	inner := NewMem("m", 1<<16)
	f := NewFaulty(inner)
	f.FailWrites(unix.EIO)
	if _, err := f.WriteAt([]byte{1}, 0); !errors.Is(err, unix.EIO) {
		t.Fatalf("write with FailWrites: %v, want EIO", err)
	}
	if err := f.Zero(0, 512, false); !errors.Is(err, unix.EIO) {
		t.Fatalf("zero with FailWrites: %v, want EIO", err)
	}
	f.FailWrites(nil)
	if _, err := f.WriteAt([]byte{7}, 0); err != nil {
		t.Fatal(err)
	}
	f.FailSync(unix.EIO)
	if err := f.Sync(); !errors.Is(err, unix.EIO) {
		t.Fatalf("sync with FailSync: %v, want EIO", err)
	}
	if f.Pending() != 1 {
		t.Fatalf("pending after failed sync %d, want 1", f.Pending())
	}
	f.FailSync(nil)
	if err := f.Sync(); err != nil {
		t.Fatal(err)
	}
	if f.Syncs() != 2 || f.Pending() != 0 {
		t.Fatalf("syncs %d pending %d, want 2 and 0", f.Syncs(), f.Pending())
	}
	got := []byte{0}
	inner.ReadAt(got, 0)
	if got[0] != 7 {
		t.Fatalf("inner byte %d after sync, want 7", got[0])
	}
}

// A write that completes while a Sync is applying the cache stays volatile:
// only what was cached when Sync was called is covered.
func TestFaultyWriteDuringSync(t *testing.T) {
	inner := NewMem("m", 1<<16)
	f := NewFaulty(inner)
	f.WriteAt([]byte{1}, 0)
	f.BeforeSync(func() {
		f.BeforeSync(nil)
		// Runs before Sync snapshots the cache, so it is covered.
		f.WriteAt([]byte{2}, 1)
	})
	if err := f.Sync(); err != nil {
		t.Fatal(err)
	}
	f.WriteAt([]byte{3}, 2)
	f.Crash()
	got := make([]byte, 3)
	f.ReadAt(got, 0)
	if want := []byte{1, 2, 0}; !bytes.Equal(got, want) {
		t.Fatalf("after crash %v, want %v", got, want)
	}
}

// What Inject installs runs instead of the call: an error fails it with
// nothing cached; removing it lets the next call through.
func TestFaultyInject(t *testing.T) {
	for _, op := range []Op{OpWrite, OpDiscard, OpZero, OpSync, OpDSync} {
		t.Run(string(op), func(t *testing.T) {
			f := NewFaulty(NewMem("a", 1<<16))
			call := map[Op]func() error{
				OpWrite:   func() error { _, err := f.WriteAt([]byte{1}, 0); return err },
				OpDiscard: func() error { return f.Discard(0, 4096) },
				OpZero:    func() error { return f.Zero(0, 4096, false) },
				OpSync:    f.Sync,
				OpDSync:   func() error { _, err := f.WriteAtDSync([]byte{1}, 0); return err },
			}[op]
			f.Inject(op, func() error { return unix.ENOSPC })
			if err := call(); !errors.Is(err, unix.ENOSPC) || f.Pending() != 0 {
				t.Fatalf("injected call: %v with %d pending, want ENOSPC and nothing cached", err, f.Pending())
			}
			f.Inject(op, nil)
			if err := call(); err != nil {
				t.Fatalf("after removing the fault: %v", err)
			}
		})
	}
}

// BeforeSync(nil) removes what BeforeSync installed.
func TestFaultyBeforeSyncNil(t *testing.T) {
	f := NewFaulty(NewMem("a", 4096))
	var calls int
	f.BeforeSync(func() { calls++ })
	f.Sync()
	f.BeforeSync(nil)
	if err := f.Sync(); err != nil || calls != 1 {
		t.Fatalf("Sync after BeforeSync(nil): %v, hook ran %d times, want once", err, calls)
	}
}

// TestFaultyHoles: volatile writes hide the holes below them until a Sync
// applies them; a volatile discard reads as data until then.
func TestFaultyHoles(t *testing.T) {
	inner := NewMem("m", 64<<10)
	inner.WriteAt(make([]byte, 4096), 32<<10) // data at 32K+4K
	f := NewFaulty(inner)
	f.WriteAt([]byte("x"), 4096+10)
	f.Discard(32<<10, 4096)
	got, err := f.Holes(0, 64<<10)
	want := []Range{{0, 4106}, {4107, 32<<10 - 4107}, {36 << 10, 28 << 10}}
	if err != nil || !slices.Equal(got, want) {
		t.Fatalf("holes %v, %v; want %v", got, err, want)
	}
	if err := f.Sync(); err != nil {
		t.Fatal(err)
	}
	got, _ = f.Holes(0, 64<<10)
	if want := []Range{{0, 4096}, {8192, 56 << 10}}; !slices.Equal(got, want) {
		t.Fatalf("after sync: holes %v; want %v", got, want)
	}
}
