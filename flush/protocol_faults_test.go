package flush_test

import (
	"context"
	"net"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/nbdmapper/nbdmapper/backing"
	"github.com/nbdmapper/nbdmapper/discard"
	"github.com/nbdmapper/nbdmapper/flush"
	"github.com/nbdmapper/nbdmapper/internal/testing/fault"
	"github.com/nbdmapper/nbdmapper/mapped"
	"github.com/nbdmapper/nbdmapper/nbdtarget"
	"github.com/nbdmapper/nbdmapper/table"
)

// Over the wire: a FUA write whose durable write fails gets the NBD errno
// of the device's error, every later FLUSH of the export fails, and the
// server goes on serving: a new connection's writes to the healthy device
// succeed. The devices are real files behind backing.Faulty.
func TestProtocolFailedFUAWrite(t *testing.T) {
	const eio, eperm, enospc = 5, 1, 28
	cases := []struct {
		flt   fault.Fault
		errno uint32
	}{
		{fault.Errno(unix.EIO), eio},
		{fault.Errno(unix.ENOSPC), enospc},
		{fault.Errno(unix.EROFS), eperm},
		{fault.Panic, eio},
	}
	for _, tc := range cases {
		t.Run(tc.flt.Name, func(t *testing.T) {
			engine := flush.New()
			panics := &fault.PanicLog{}
			engine.OnPanic = panics.OnPanic
			devs := fault.Files(t, 1<<20, "a.img", "b.img")
			pool := &backing.Pool{Wrap: engine.Track}
			for _, d := range devs {
				pool.Add(d.Name(), d)
			}
			text := "0 1024 linear " + devs[0].Name() + " 0\n1024 1024 linear " + devs[1].Name() + " 0\n"
			tab, err := table.Parse("faults", strings.NewReader(text), pool)
			if err != nil {
				t.Fatal(err)
			}
			x := &nbdtarget.Export{Dev: mapped.New("x", tab, engine, discard.New())}
			srv := &nbdtarget.Server{Exports: []*nbdtarget.Export{x}}
			socket := filepath.Join(t.TempDir(), "nbd.sock")
			l, err := net.Listen("unix", socket)
			if err != nil {
				t.Fatal(err)
			}
			served := make(chan error, 1)
			go func() { served <- srv.Serve(l) }()
			t.Cleanup(func() {
				ctx, cancel := context.WithCancel(context.Background())
				cancel()
				srv.Shutdown(ctx)
				fault.Within(t, "Serve returns", served)
			})

			nc, err := dialNBD(socket)
			if err != nil {
				t.Fatal(err)
			}
			defer nc.Close()
			block := make([]byte, 4096)
			if errno, err := nc.do(cmdWrite, 0, 0, block); err != nil || errno != 0 {
				t.Fatalf("plain write: errno %d, %v", errno, err)
			}
			devs[0].Inject(backing.OpDSync, tc.flt.Hook())
			if errno, err := nc.do(cmdWrite, flagFUA, 4096, block); err != nil || errno != tc.errno {
				t.Fatalf("FUA write on the failing device: errno %d, %v; want %d", errno, err, tc.errno)
			}
			devs[0].Inject(backing.OpDSync, nil) // the disk is back; the data may not be
			// Later flushes fail because of that earlier failure: EIO,
			// whatever its errno was (and so do later FUA writes).
			for i := range 2 {
				if errno, err := nc.do(cmdFlush, 0, 0, nil); err != nil || errno != 5 {
					t.Fatalf("flush %d after the failed FUA write: errno %d, %v; want EIO", i, errno, err)
				}
			}
			if errno, err := nc.do(cmdWrite, flagFUA, 8192, block); err != nil || errno != 5 {
				t.Fatalf("FUA write after the failed one: errno %d, %v; want EIO", errno, err)
			}
			panics.Check(t, tc.flt.Panics())

			nc2, err := dialNBD(socket)
			if err != nil {
				t.Fatalf("server stopped accepting after the fault: %v", err)
			}
			defer nc2.Close()
			for _, flags := range []uint16{0, flagFUA} {
				if errno, err := nc2.do(cmdWrite, flags, 1024*512, block); err != nil || errno != 0 {
					t.Fatalf("write (flags %d) to the healthy device: errno %d, %v", flags, errno, err)
				}
			}
			if s := engine.Stats(); !s.Devices[0].Failed || s.Devices[1].Failed {
				t.Fatalf("stats %+v: want a failed, b not", s)
			}
		})
	}
}
