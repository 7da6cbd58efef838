package nbdtarget

import (
	"bufio"
	"encoding/binary"
	"io"
	"net"
	"testing"

	"github.com/nbdmapper/nbdmapper/backing"
	"github.com/nbdmapper/nbdmapper/internal/testing/nbdtest"
	"github.com/nbdmapper/nbdmapper/wire"
)

// benchServe serves a 64 MiB in-memory export, its pages all allocated if
// written, and returns the server and a connection in its transmission
// phase, closed when b ends.
func benchServe(b testing.TB, written bool) (*Server, net.Conn) {
	mem := backing.NewMem("m", 64<<20)
	if written {
		mem.WriteAt(make([]byte, 64<<20), 0)
	}
	srv := &Server{Exports: []*Export{newExport(b, "m", seg{len: 64 << 20, dev: mem})}}
	sock := nbdtest.ServeUnix(b, srv, ErrServerClosed)
	nc, err := net.Dial("unix", sock)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { nc.Close() })
	c := &rawClient{t: b, nc: nc}
	c.connect("m", false, false)
	return srv, nc
}

// BenchmarkPipelined4K measures 4 KiB requests with 32 in flight on one
// connection to an in-memory device; allocs/op shows what the server
// allocates per request in steady state (the client allocates nothing).
func BenchmarkPipelined4K(b *testing.B) {
	for _, bc := range []struct {
		name string
		typ  uint16
	}{{"read", wire.CmdRead}, {"write", wire.CmdWrite}} {
		b.Run(bc.name, func(b *testing.B) {
			_, nc := benchServe(b, true)

			const depth = 32
			sem := make(chan struct{}, depth)
			done := make(chan struct{})
			go func() {
				defer close(done)
				br := bufio.NewReaderSize(nc, 1<<20)
				var hdr [16]byte
				for range b.N {
					if _, err := io.ReadFull(br, hdr[:]); err != nil || binary.BigEndian.Uint32(hdr[4:]) != 0 {
						panic("bad reply")
					}
					if bc.typ == wire.CmdRead {
						br.Discard(4096)
					}
					<-sem
				}
			}()
			req := wire.AppendRequest(nil, wire.Request{Type: bc.typ, Length: 4096})
			if bc.typ == wire.CmdWrite {
				req = append(req, make([]byte, 4096)...)
			}
			bw := bufio.NewWriterSize(nc, 1<<20)
			b.SetBytes(4096)
			b.ReportAllocs()
			b.ResetTimer()
			for i := range b.N {
				off := uint64(i%(16<<10)) * 4096
				binary.BigEndian.PutUint64(req[8:], uint64(i))
				binary.BigEndian.PutUint64(req[16:], off)
				select {
				case sem <- struct{}{}:
				default:
					bw.Flush()
					sem <- struct{}{}
				}
				bw.Write(req)
			}
			bw.Flush()
			<-done
		})
	}
}

// BenchmarkSerial4K measures a client at queue depth 1 that flushes after
// each 4 KiB write, as fio's --fsync=1 does: the connection runs in serial
// mode, and allocs/op is what the server allocates per write and flush.
func BenchmarkSerial4K(b *testing.B) {
	srv, nc := benchServe(b, false)

	write := append(wire.AppendRequest(nil, wire.Request{Type: wire.CmdWrite, Length: 4096}), make([]byte, 4096)...)
	flush := wire.AppendRequest(nil, wire.Request{Type: wire.CmdFlush})
	var reply [16]byte
	roundTrip := func(req []byte) {
		if _, err := nc.Write(req); err != nil {
			b.Fatal(err)
		}
		if _, err := io.ReadFull(nc, reply[:]); err != nil || binary.BigEndian.Uint32(reply[4:]) != 0 {
			b.Fatalf("reply %x: %v", reply, err)
		}
	}
	b.SetBytes(4096)
	b.ReportAllocs()
	b.ResetTimer()
	for i := range b.N {
		binary.BigEndian.PutUint64(write[16:], uint64(i%(16<<10))*4096)
		roundTrip(write)
		roundTrip(flush)
	}
	b.StopTimer()
	if n := srv.Stats().Exports[0].SerialRequests; b.N > 8 && n < int64(b.N) {
		b.Fatalf("only %d of the %d requests ran in serial mode", n, 2*b.N)
	}
}

// TestPipelinedRequestAllocs: in steady state the server allocates
// nothing per request (the request header is read into the connection,
// jobs and buffers are pooled): 32 reads or writes of 4 KiB sent together,
// answered and taken, 50 times over, allocate less than once per four
// requests on both sides together (the client's calls allocate nothing).
// Not zero: a garbage collection empties the pools, which then refill,
// 1-2 allocations per batch on average here. One allocation per request
// would be 32. BenchmarkPipelined4K has the time.
func TestPipelinedRequestAllocs(t *testing.T) {
	for _, tc := range []struct {
		name     string
		typ      uint16
		replyLen int
	}{{"read", wire.CmdRead, 16 + 4096}, {"write", wire.CmdWrite, 16}} {
		t.Run(tc.name, func(t *testing.T) {
			_, nc := benchServe(t, true)
			const depth = 32
			var batch []byte
			for i := range depth {
				batch = wire.AppendRequest(batch, wire.Request{Type: tc.typ, Handle: uint64(i), Offset: uint64(i) * 4096, Length: 4096})
				if tc.typ == wire.CmdWrite {
					batch = append(batch, make([]byte, 4096)...)
				}
			}
			replies := make([]byte, depth*tc.replyLen)
			round := func() {
				if _, err := nc.Write(batch); err != nil {
					t.Fatal(err)
				}
				if _, err := io.ReadFull(nc, replies); err != nil {
					t.Fatal(err)
				}
			}
			round() // the pool of goroutines and the buffers grow here
			if n := nbdtest.AllocsPerRun(50, round); n >= depth/4 {
				t.Errorf("%v allocations per %d pipelined %ss, want fewer than %d", n, depth, tc.name, depth/4)
			}
		})
	}
}
