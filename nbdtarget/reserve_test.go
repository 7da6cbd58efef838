package nbdtarget

import (
	"bytes"
	"sync"
	"testing"

	"github.com/nbdmapper/nbdmapper/backing"
	"github.com/nbdmapper/nbdmapper/internal/testing/nbdtest"
	"github.com/nbdmapper/nbdmapper/wire"
)

// The reserve is a quarter of the memory, less where the rest would not
// hold the largest request, and everything is the rest's at that.
func TestSplitMemory(t *testing.T) {
	for _, c := range []struct{ memory, common, reserve int64 }{
		{maxCost, maxCost, 0},
		{40 << 20, maxCost, 40<<20 - maxCost},
		{4 * maxCost, 3 * maxCost, maxCost},
		{DefaultMemory, 192 << 20, 64 << 20},
	} {
		if common, reserve := splitMemory(c.memory); common != c.common || reserve != c.reserve {
			t.Errorf("splitMemory(%d) = %d, %d; want %d, %d", c.memory, common, reserve, c.common, c.reserve)
		}
	}
}

// TestHungExportsLeaveEveryExportARequest: with an export's budget as
// large as the server's, an export whose device hangs holds all of Memory
// but the reserve, and one request on the reserve; a second one gets a
// request through on the reserve too, and hangs it there; a third's
// request, more than what is left of the reserve, waits. Another export's
// client is still answered, a request at a time on the reserve, and once
// the devices answer every request is.
func TestHungExportsLeaveEveryExportARequest(t *testing.T) {
	const piece, size = 4 << 20, 64 << 20
	release := make(chan struct{})
	hung := func(name string) *hungDev {
		return &hungDev{Device: backing.NewMem(name, size), release: release}
	}
	h1, h2, h3 := hung("h1"), hung("h2"), hung("h3")
	data := bytes.Repeat([]byte("the export that answers "), size/24+1)[:size]
	ok := backing.NewMem("ok", size)
	if _, err := ok.WriteAt(data, 0); err != nil {
		t.Fatal(err)
	}
	srv := &Server{Memory: 2 * maxCost, ExportMemory: 2 * maxCost, Exports: []*Export{
		newExport(t, "h1", seg{len: size, dev: h1}),
		newExport(t, "h2", seg{len: size, dev: h2}),
		newExport(t, "h3", seg{len: size, dev: h3}),
		newExport(t, "ok", seg{len: size, dev: ok}),
	}}
	sock := nbdtest.ServeUnix(t, srv, ErrServerClosed)
	var unhang sync.Once
	t.Cleanup(func() { unhang.Do(func() { close(release) }) }) // before the server's: its shutdown waits for the reads

	// Each step's requests settle before the next is sent; a request that
	// finds the common memory taken counts a wait in MemoryWaits, whether
	// the reserve then takes it or not.
	send := func(name string, reads int, length uint32) *rawClient {
		c := dialRaw(t, sock)
		c.connect(name, false, false)
		for h := range reads {
			c.request(wire.CmdRead, 0, uint64(h+1), uint64(h)*piece, length, nil)
		}
		return c
	}
	const cost = requestBase + piece
	common, reserve := splitMemory(srv.memory())
	fit := common / cost // 11
	c1 := send("h1", int(fit)+3, piece)
	waitFor(t, "h1 to fill the common memory and a read of the reserve, and its next read to wait", func() bool {
		return h1.held.Load() == fit+1 && srv.Stats().MemoryWaits == 2
	})
	c2 := send("h2", 2, piece)
	waitFor(t, "h2's first read to hang on the reserve and its second to wait", func() bool {
		return h2.held.Load() == 1 && srv.Stats().MemoryWaits == 4
	})
	long := uint32(reserve - 2*cost + 1) // more than the reserve has left, less than all of it
	c3 := send("h3", 1, long)
	waitFor(t, "h3's read to wait", func() bool { return srv.Stats().MemoryWaits == 5 })

	d := dialRaw(t, sock)
	d.connect("ok", false, false)
	for h := range 3 {
		off := uint64(h) * piece
		d.request(wire.CmdRead, 0, uint64(h+1), off, piece, nil)
		handle, errno, got := d.simple(piece)
		if handle != uint64(h+1) || errno != 0 || !bytes.Equal(got, data[off:off+piece]) {
			t.Fatalf("read %d of the export that answers: handle %d errno %d, right data %v", h, handle, errno, bytes.Equal(got, data[off:off+piece]))
		}
	}
	if n1, n2, n3 := h1.held.Load(), h2.held.Load(), h3.held.Load(); n1 != fit+1 || n2 != 1 || n3 != 0 {
		t.Fatalf("reads in the hung devices: %d, %d, %d; want %d, 1, 0", n1, n2, n3, fit+1)
	}
	if got := srv.Stats().MemoryInUse; got > srv.memory() {
		t.Fatalf("%d bytes held, more than Memory (%d)", got, srv.memory())
	}

	unhang.Do(func() { close(release) })
	var wg sync.WaitGroup
	for _, c := range []struct {
		c      *rawClient
		reads  int
		length int
	}{{c1, int(fit) + 3, piece}, {c2, 2, piece}, {c3, 1, int(long)}} {
		wg.Go(func() {
			for range c.reads {
				if _, errno, _ := c.c.simple(c.length); errno != 0 {
					t.Errorf("read of a hung export, once released: errno %d", errno)
				}
			}
		})
	}
	wg.Wait()
	waitFor(t, "every request's memory to come back", func() bool { return srv.Stats().MemoryInUse == 0 })
}
