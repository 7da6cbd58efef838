package backing

import (
	"bytes"
	"slices"
	"sync"
	"testing"
)

// TestWriteLogOrderAndData logs two devices, a real file and a Mem, in one
// order: the data of each write, discards, zeroings, FUA writes and syncs
// with what they cover; failed calls are not logged.
func TestWriteLogOrderAndData(t *testing.T) {
	devs := devices(t)
	l := NewWriteLog()
	a, b := l.Wrap(devs["file"]), l.Wrap(devs["mem"])
	if l.Wrap(devs["file"]) != a {
		t.Fatal("wrapping a device twice gave two wrappers")
	}
	if a.Index() != 0 || b.Index() != 1 || a.ID() != devs["file"].ID() {
		t.Fatalf("indexes %d %d, ID %v", a.Index(), b.Index(), a.ID())
	}
	data := bytes.Repeat([]byte{7}, 4096)
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	_, err := a.WriteAt(data, 8192)
	must(err)
	_, err = b.WriteAt(data[:512], 0)
	must(err)
	must(a.Sync())
	must(a.Discard(8192, 4096))
	must(b.Zero(4096, 4096, true))
	_, err = a.WriteAtDSync(data[:1024], 0) // File: pwritev2 RWF_DSYNC
	must(err)
	_, err = b.WriteAtDSync(data[:512], 512) // Mem: write and sync
	must(err)
	if _, err := b.WriteAt(data, b.Size()); err == nil {
		t.Fatal("write past the end succeeded")
	}
	if err := a.Discard(0, -1); err == nil {
		t.Fatal("discard of a negative length succeeded")
	}
	data[0] = 9 // the log holds copies

	var got []string
	for _, e := range l.Entries() {
		got = append(got, e.String())
	}
	want := []string{
		"dev0 write 8192+4096", "dev1 write 0+512", "dev0 sync covers=2",
		"dev0 discard 8192+4096", "dev1 zero 4096+4096", "dev0 write 0+1024 fua", "dev1 write 512+512 fua",
	}
	if !slices.Equal(got, want) {
		t.Fatalf("log\n%q\nwant\n%q", got, want)
	}
	if e := l.Entries()[0]; e.Data[0] != 7 || len(e.Data) != 4096 {
		t.Fatalf("first write's data %d bytes starting %d", len(e.Data), e.Data[0])
	}
	if l.Len() != len(want) {
		t.Fatalf("Len %d", l.Len())
	}
}

// TestWriteLogSyncCovers: a sync covers only the writes that completed
// before it was issued; one that completes while the sync runs is logged
// before the sync entry but not covered by it.
func TestWriteLogSyncCovers(t *testing.T) {
	l := NewWriteLog()
	f := NewFaulty(NewMem("m", 1<<20))
	d := l.Wrap(f)
	if _, err := d.WriteAt(make([]byte, 512), 0); err != nil {
		t.Fatal(err)
	}
	inSync, release := make(chan struct{}), make(chan struct{})
	f.BeforeSync(func() { close(inSync); <-release })
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		if err := d.Sync(); err != nil {
			t.Error(err)
		}
	}()
	<-inSync
	if _, err := d.WriteAt(make([]byte, 512), 512); err != nil {
		t.Fatal(err)
	}
	close(release)
	wg.Wait()
	es := l.Entries()
	if len(es) != 3 || es[1].Op != OpWrite || es[2].Op != OpSync || es[2].Covers != 1 {
		t.Fatalf("log %v, want write, write, sync covering 1", es)
	}
}
