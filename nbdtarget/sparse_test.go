package nbdtarget

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/nbdmapper/nbdmapper/backing"
	"github.com/nbdmapper/nbdmapper/internal/testing/nbdtest"
	"github.com/nbdmapper/nbdmapper/table"
	"github.com/nbdmapper/nbdmapper/wire"
)

// Layout of the "sparse" export: a device with a hole map (data at 0K+4K
// and 12K+4K, holes elsewhere), a zero target, an error target, and a long
// sparse device for reads longer than MaxPayload.
//
//	0    4K      12K   16K          64K     80K     84K
//	| data | hole | data | hole      | zero  | error | long (2*MaxPayload+4K, data at its end)
func newSparseFix(t *testing.T) (sock string, x *Export) {
	m := backing.NewMem("m", 64*kb)
	m.WriteAt(pattern(4*kb, 1), 0)
	m.WriteAt(pattern(4*kb, 2), 12*kb)
	long := backing.NewMem("long", 2*MaxPayload+4*kb)
	long.WriteAt(pattern(4*kb, 3), 2*MaxPayload)
	x = newExport(t, "sparse", seg{len: 64 * kb, dev: backing.NewHoleMap(m)}, seg{len: 16 * kb, kind: table.KindZero},
		seg{len: 4 * kb, kind: table.KindError}, seg{len: 2*MaxPayload + 4*kb, dev: backing.NewHoleMap(long)})
	return nbdtest.ServeUnix(t, &Server{Exports: []*Export{x}}, ErrServerClosed), x
}

// readChunks sends one READ and collects its reply's chunks.
func readChunks(c *rawClient, flags uint16, handle, off uint64, n uint32) []chunk {
	c.request(wire.CmdRead, flags, handle, off, n, nil)
	var chunks []chunk
	for {
		ch := c.chunk()
		if ch.handle != handle {
			c.t.Fatalf("chunk for handle %d, want %d", ch.handle, handle)
		}
		chunks = append(chunks, ch)
		if ch.flags&wire.ReplyFlagDone != 0 {
			return chunks
		}
	}
}

// describe prints chunks as "DATA off+len HOLE off+len ... ERROR", with
// "!" after the one flagged done, checking each chunk's length field.
func describe(t *testing.T, chunks []chunk) string {
	var parts []string
	for _, ch := range chunks {
		s := ""
		switch ch.typ {
		case wire.ChunkOffsetData:
			s = fmt.Sprintf("DATA %d+%d", binary.BigEndian.Uint64(ch.payload), len(ch.payload)-8)
		case wire.ChunkOffsetHole:
			if len(ch.payload) != 12 {
				t.Fatalf("hole chunk of %d bytes", len(ch.payload))
			}
			s = fmt.Sprintf("HOLE %d+%d", binary.BigEndian.Uint64(ch.payload), binary.BigEndian.Uint32(ch.payload[8:]))
		case wire.ChunkErrorOffset:
			errno, _, off, _ := chunkErrno(ch)
			s = fmt.Sprintf("ERROR %d at %d", errno, off)
		default:
			s = fmt.Sprintf("type %d", ch.typ)
		}
		if ch.flags&wire.ReplyFlagDone != 0 {
			s += "!"
		}
		parts = append(parts, s)
	}
	return strings.Join(parts, " ")
}

// TestSparseReadReplies: reads over holes and zero targets are answered
// with OFFSET_HOLE chunks, in order, only the last flagged done, when
// structured replies are negotiated and DF is not set; DF reads and simple
// replies carry the zeros as data; Stats counts the chunks.
func TestSparseReadReplies(t *testing.T) {
	sock, x := newSparseFix(t)
	want := make([]byte, 84*kb)
	copy(want, pattern(4*kb, 1))
	copy(want[12*kb:], pattern(4*kb, 2))

	c := dialRaw(t, sock)
	c.connect("sparse", true, false)
	for _, tc := range []struct {
		name      string
		flags     uint16
		off, n    uint64
		want      string
		dataBytes int
	}{
		{"data, holes and the zero target", 0, 0, 80 * kb, "DATA 0+4096 HOLE 4096+8192 DATA 12288+4096 HOLE 16384+65536!", 8 * kb},
		{"one hole", 0, 4 * kb, 4 * kb, "HOLE 4096+4096!", 0},
		{"less than a granule, all hole", 0, 5 * kb, 100, "HOLE 5120+100!", 0},
		{"a hole shorter than MinHole is sent as data", 0, 10 * kb, 4 * kb, "DATA 10240+4096!", 4 * kb},
		{"DF: one data chunk", wire.CfDF, 0, 80 * kb, "DATA 0+81920!", 80 * kb},
		{"holes, then the error target", 0, 60 * kb, 24 * kb, "ERROR 5 at 81920!", 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c.t = t
			before := x.st.readChunks[1].Load()
			chunks := readChunks(c, tc.flags, 7, tc.off, uint32(tc.n))
			if got := describe(t, chunks); got != tc.want {
				t.Fatalf("reply %s\nwant  %s", got, tc.want)
			}
			holes := 0
			for _, ch := range chunks {
				switch ch.typ {
				case wire.ChunkOffsetData:
					off := binary.BigEndian.Uint64(ch.payload)
					if !bytes.Equal(ch.payload[8:], want[off:off+uint64(len(ch.payload)-8)]) {
						t.Fatalf("data at %d differs", off)
					}
				case wire.ChunkOffsetHole:
					holes++
				}
			}
			if got := x.st.readChunks[1].Load() - before; got != int64(holes) {
				t.Fatalf("Stats counted %d hole chunks, sent %d", got, holes)
			}
		})
	}
	c.t = t
	t.Run("longer than MaxPayload: hole chunks per piece", func(t *testing.T) {
		c.t = t
		const base = 84 * kb
		chunks := readChunks(c, 0, 8, base, 2*MaxPayload+4*kb)
		var sum uint64
		for i, ch := range chunks {
			if ch.typ != wire.ChunkOffsetHole && i != len(chunks)-1 {
				t.Fatalf("chunk %d of %s", i, describe(t, chunks))
			}
			if ch.typ == wire.ChunkOffsetHole {
				sum += uint64(binary.BigEndian.Uint32(ch.payload[8:]))
			}
		}
		last := chunks[len(chunks)-1]
		if sum != 2*MaxPayload || last.typ != wire.ChunkOffsetData || !bytes.Equal(last.payload[8:], pattern(4*kb, 3)) {
			t.Fatalf("long read: holes cover %d bytes; reply %s", sum, describe(t, chunks))
		}
	})
	t.Run("simple replies carry zeros", func(t *testing.T) {
		s := dialRaw(t, sock)
		s.connect("sparse", false, false)
		s.request(wire.CmdRead, 0, 9, 0, 80*kb, nil)
		if h, errno, data := s.simple(80 * kb); h != 9 || errno != 0 || !bytes.Equal(data, want[:80*kb]) {
			t.Fatalf("simple read: handle %d errno %d", h, errno)
		}
	})
	es := (&Server{Exports: []*Export{x}}).Stats().Exports[0]
	if es.ReadHoleChunks == 0 || es.ReadDataChunks == 0 || es.ReadHoleBytes < 2*MaxPayload {
		t.Fatalf("stats %+v", es)
	}
}

// TestSparseReadsRealClients reads a sparse table over real files with
// libnbd (which turns hole chunks into zeros), qemu-io, qemu-img and
// fio's nbd engine, checks the bytes against the files, and counts the
// hole chunks the server sent.
func TestSparseReadsRealClients(t *testing.T) {
	f := newDiskFix(t)
	x := f.srv.ExportList()[0]
	holeChunks := func() int64 { return x.st.readChunks[1].Load() }
	// Data in A at virtual 64K+8K and in B at 1M+4K+4K; all else holes
	// (and the zero target at 1.5M-2M).
	nbdsh := func(t *testing.T, script string) string {
		t.Helper()
		return output(t, nbdtest.Nbdsh(t, "-c", fmt.Sprintf("URI = %q", f.uri("disk")), "-c", script))
	}
	nbdsh(t, `
h.connect_uri(URI)
h.pwrite(bytes([0x11]) * 8192, 65536)
h.pwrite(bytes([0x22]) * 4096, 1024*1024 + 4096)
`)
	t.Run("nbdsh", func(t *testing.T) {
		before := holeChunks()
		out := nbdsh(t, `
h.connect_uri(URI)
M = 1024*1024
chunks = []
def cb(buf, off, status, err):
    chunks.append((off, len(buf), status, bytes(buf) == bytes(len(buf))))
    return 0
h.pread_structured(M, 0, cb)
print(chunks)
assert chunks == [(0, 65536, nbd.READ_HOLE, True), (65536, 8192, nbd.READ_DATA, False), (73728, M - 73728, nbd.READ_HOLE, True)], chunks
chunks.clear()
h.pread_structured(M, 0, cb, nbd.CMD_FLAG_DF)
assert len(chunks) == 1 and chunks[0][:3] == (0, M, nbd.READ_DATA), chunks
b = h.pread(4*M, 0)
assert b[:65536] == bytes(65536) and b[65536:73728] == bytes([0x11]) * 8192 and b[73728:M+4096] == bytes(M + 4096 - 73728)
assert b[M+4096:M+8192] == bytes([0x22]) * 4096 and b[M+8192:] == bytes(3*M - 8192)
print("OK")
`)
		if !strings.HasSuffix(strings.TrimSpace(out), "OK") {
			t.Fatalf("nbdsh: %s", out)
		}
		// 2 for the first structured read, 1 + 3 for the pread (the
		// zero target joins the holes around it; 4M is one request).
		if got := holeChunks() - before; got != 5 {
			t.Fatalf("%d hole chunks sent, want 5: %s", got, out)
		}
	})
	t.Run("qemu-io and qemu-img", func(t *testing.T) {
		nbdtest.Tool(t, "qemu-io")
		nbdtest.Tool(t, "qemu-img")
		before := holeChunks()
		out := run(t, "qemu-io", "-f", "raw", "-c", "read -P 0 0 64k", "-c", "read -P 0x11 64k 8k",
			"-c", "read -P 0 72k 956k", "-c", "read -P 0x22 1052672 4k", "-c", "read -P 0 2m 2m", f.uri("disk"))
		if strings.Contains(out, "error") || strings.Contains(out, "fail") || strings.Contains(out, "mismatch") {
			t.Fatalf("qemu-io: %s", out)
		}
		img := filepath.Join(t.TempDir(), "copy.raw")
		run(t, "qemu-img", "convert", "-f", "raw", "-O", "raw", f.uri("disk"), img)
		got, err := os.ReadFile(img)
		if err != nil {
			t.Fatal(err)
		}
		if want := f.backingBytes(t, 0, diskSize); !bytes.Equal(got, want) {
			t.Fatalf("qemu-img convert differs at byte %d", firstDiff(got, want))
		}
		if holeChunks() == before {
			t.Fatal("qemu read no hole chunks")
		}
	})
	t.Run("fio's nbd engine", func(t *testing.T) {
		nbdtest.Tool(t, "fio")
		if exec.Command("fio", "--enghelp=nbd").Run() != nil {
			t.Skip("fio lacks the nbd engine")
		}
		before, reads := holeChunks(), x.st.ops[wire.CmdRead].requests.Load()
		// Random reads of the sparse export, then random writes with
		// verification (fio reads back what it wrote, over a region
		// whose other blocks stay holes).
		out, err := exec.Command("fio", "--name=holes", "--ioengine=nbd", "--uri="+f.uri("disk"),
			"--rw=randread", "--bs=4k", "--iodepth=16", "--size=4m", "--io_size=8m",
			"--output-format=terse").CombinedOutput()
		if err != nil {
			t.Fatalf("fio randread: %v\n%s", err, out)
		}
		out, err = exec.Command("fio", "--name=verify", "--ioengine=nbd", "--uri="+f.uri("disk"),
			"--rw=randwrite", "--bs=4k", "--iodepth=8", "--offset=3m", "--size=1m", "--io_size=256k",
			"--verify=crc32c", "--output-format=terse").CombinedOutput()
		if err != nil {
			t.Fatalf("fio verify: %v\n%s", err, out)
		}
		n := x.st.ops[wire.CmdRead].requests.Load() - reads
		holes := holeChunks() - before
		if n < 2048 || holes < n/2 {
			t.Fatalf("fio: %d reads, %d hole chunks", n, holes)
		}
		t.Logf("fio: %d reads, %d hole chunks", n, holes)
	})
}
