package attach

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nbdmapper/nbdmapper/backing"
	"github.com/nbdmapper/nbdmapper/discard"
	"github.com/nbdmapper/nbdmapper/flush"
	"github.com/nbdmapper/nbdmapper/internal/testing/nbdtest"
	"github.com/nbdmapper/nbdmapper/mapped"
	"github.com/nbdmapper/nbdmapper/nbdtarget"
	"github.com/nbdmapper/nbdmapper/table"
	"github.com/nbdmapper/nbdmapper/wire"
)

// serveNbdmapper serves two exports of a real table over a sparse file on a
// unix socket and returns the socket path.
func serveNbdmapper(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	img := filepath.Join(dir, "disk.img")
	f, err := os.Create(img)
	if err != nil {
		t.Fatal(err)
	}
	f.Truncate(8 << 20)
	f.Close()
	pool := &backing.Pool{}
	t.Cleanup(func() { pool.Close() })
	var exports []*nbdtarget.Export
	for _, x := range []struct{ name, text string }{
		{"whole", "0 16384 linear " + img + " 0\n"},
		{"tail", "0 100 zero\n100 3900 linear " + img + " 8\n"},
	} {
		tb, err := table.Parse(x.name+".table", strings.NewReader(x.text), pool)
		if err != nil {
			t.Fatal(err)
		}
		exports = append(exports, &nbdtarget.Export{Name: x.name, Dev: mapped.New(x.name, tb, flush.New(), discard.New())})
	}
	sock := filepath.Join(dir, "nbd.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	srv := &nbdtarget.Server{Exports: exports}
	go srv.Serve(l)
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		srv.Shutdown(ctx)
	})
	return sock
}

// serveNbdkit runs nbdkit's memory plugin (1 MiB) on a unix socket.
func serveNbdkit(t *testing.T) string {
	t.Helper()
	if _, err := exec.LookPath("nbdkit"); err != nil {
		t.Skip("nbdkit not installed (Debian package nbdkit)")
	}
	sock := filepath.Join(t.TempDir(), "nbdkit.sock")
	cmd := exec.Command("nbdkit", "-f", "-U", sock, "memory", "1M")
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan struct{})
	go func() { cmd.Wait(); close(exited) }()
	t.Cleanup(func() { cmd.Process.Kill(); <-exited })
	// nbdkit creates the socket (bind) before it listens on it, so the
	// file existing is not enough: wait until a connection is accepted.
	nbdtest.Until(t, "nbdkit to accept connections", func() bool {
		select {
		case <-exited:
			t.Fatalf("nbdkit exited before accepting connections: %v", cmd.ProcessState)
		default:
		}
		c, err := net.Dial("unix", sock)
		if err != nil {
			return false
		}
		c.Close()
		return true
	})
	return sock
}

func TestHandshake(t *testing.T) {
	mapper := serveNbdmapper(t)
	tests := []struct {
		name      string
		sock      func(*testing.T) string
		export    string
		size      uint64
		wantFlags uint16 // all of these must be set
		err       error
	}{
		{"nbdmapper default export", func(*testing.T) string { return mapper }, "", 8 << 20,
			wire.TfHasFlags | wire.TfSendFlush | wire.TfSendFUA | wire.TfSendTrim, nil},
		{"nbdmapper named export", func(*testing.T) string { return mapper }, "tail", 4000 * 512,
			wire.TfHasFlags | wire.TfSendFlush | wire.TfSendTrim, nil},
		{"nbdmapper unknown export", func(*testing.T) string { return mapper }, "nope", 0, 0, ErrRefused},
		{"nbdkit memory", serveNbdkit, "", 1 << 20,
			wire.TfHasFlags | wire.TfSendFlush | wire.TfSendTrim | wire.TfCanMultiConn, nil},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			c, err := net.Dial("unix", tc.sock(t))
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			x, err := Handshake(c, tc.export)
			if tc.err != nil {
				if !errors.Is(err, tc.err) {
					t.Fatalf("err = %v, want %v", err, tc.err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if x.Size != tc.size {
				t.Errorf("size = %d, want %d", x.Size, tc.size)
			}
			if x.Flags&tc.wantFlags != tc.wantFlags {
				t.Errorf("flags = %#x, want at least %#x", x.Flags, tc.wantFlags)
			}
			if x.Flags&wire.TfReadOnly != 0 {
				t.Errorf("flags = %#x: read-only", x.Flags)
			}
			// the connection is in the transmission phase: a clean
			// NBD_CMD_DISC is accepted and the server closes.
			var req [28]byte
			binary.BigEndian.PutUint32(req[0:], 0x25609513)
			binary.BigEndian.PutUint16(req[6:], 2)
			if _, err := c.Write(req[:]); err != nil {
				t.Fatal(err)
			}
			c.SetReadDeadline(time.Now().Add(30 * time.Second))
			if n, err := c.Read(make([]byte, 1)); err != io.EOF {
				t.Errorf("after NBD_CMD_DISC: read %d bytes, err %v, want EOF", n, err)
			}
		})
	}
}

// scripted plays a server that sends script whatever it is told.
func scripted(script []byte) io.ReadWriter {
	return struct {
		io.Reader
		io.Writer
	}{bytes.NewReader(script), io.Discard}
}

func u64(v uint64) []byte { return binary.BigEndian.AppendUint64(nil, v) }
func u32(v uint32) []byte { return binary.BigEndian.AppendUint32(nil, v) }
func u16(v uint16) []byte { return binary.BigEndian.AppendUint16(nil, v) }

func reply(opt, typ uint32, data ...[]byte) []byte {
	body := bytes.Join(data, nil)
	return bytes.Join([][]byte{u64(wire.MagicOptReply), u32(opt), u32(typ), u32(uint32(len(body))), body}, nil)
}

func TestHandshakeScripted(t *testing.T) {
	greeting := bytes.Join([][]byte{u64(wire.MagicNBD), u64(wire.MagicOpt), u16(wire.FlagFixedNewstyle | wire.FlagNoZeroes)}, nil)
	tests := []struct {
		name   string
		script []byte
		want   Export
		err    error
	}{
		{"not NBD", []byte("SSH-2.0-OpenSSH_9.2 hello there"), Export{}, ErrNotNBD},
		{"oldstyle", bytes.Join([][]byte{u64(wire.MagicNBD), u64(0x00420281861253), u64(1 << 20)}, nil), Export{}, ErrOldstyle},
		{"not fixed newstyle", bytes.Join([][]byte{u64(wire.MagicNBD), u64(wire.MagicOpt), u16(0)}, nil), Export{}, ErrOldstyle},
		{"GO with block sizes", bytes.Join([][]byte{greeting,
			reply(wire.OptGo, wire.RepInfo, u16(wire.InfoBlockSize), u32(512), u32(4096), u32(32<<20)),
			reply(wire.OptGo, wire.RepInfo, u16(wire.InfoExport), u64(1<<30), u16(0x12d)),
			reply(wire.OptGo, wire.RepAck)}, nil),
			Export{Size: 1 << 30, Flags: 0x12d, MinBlock: 512, PrefBlock: 4096, MaxBlock: 32 << 20}, nil},
		{"GO unsupported: EXPORT_NAME", bytes.Join([][]byte{greeting,
			reply(wire.OptGo, wire.RepErrUnsup),
			u64(5 << 20), u16(0x3)}, nil),
			Export{Size: 5 << 20, Flags: 0x3}, nil},
		{"ACK without export info", bytes.Join([][]byte{greeting, reply(wire.OptGo, wire.RepAck)}, nil), Export{}, ErrProtocol},
		{"short export info", bytes.Join([][]byte{greeting, reply(wire.OptGo, wire.RepInfo, u16(wire.InfoExport), u64(1))}, nil), Export{}, ErrProtocol},
		{"policy error", bytes.Join([][]byte{greeting, reply(wire.OptGo, wire.RepErr|2, []byte("go away"))}, nil), Export{}, ErrRefused},
		{"wrong reply magic", bytes.Join([][]byte{greeting, u64(1), u32(wire.OptGo), u32(wire.RepAck), u32(0)}, nil), Export{}, ErrProtocol},
		{"truncated greeting", u64(wire.MagicNBD), Export{}, io.ErrUnexpectedEOF},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			x, err := Handshake(scripted(tc.script), "d")
			if tc.err != nil {
				if !errors.Is(err, tc.err) {
					t.Fatalf("err = %v, want %v", err, tc.err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if x != tc.want {
				t.Errorf("export = %+v, want %+v", x, tc.want)
			}
		})
	}
}

func FuzzHandshake(f *testing.F) {
	greeting := bytes.Join([][]byte{u64(wire.MagicNBD), u64(wire.MagicOpt), u16(wire.FlagFixedNewstyle)}, nil)
	f.Add(greeting)
	f.Add(bytes.Join([][]byte{greeting, reply(wire.OptGo, wire.RepInfo, u16(wire.InfoExport), u64(1<<30), u16(1)), reply(wire.OptGo, wire.RepAck)}, nil))
	f.Add(bytes.Join([][]byte{greeting, reply(wire.OptGo, wire.RepErrUnsup), u64(1), u16(1)}, nil))
	f.Fuzz(func(t *testing.T, script []byte) {
		x, err := Handshake(scripted(script), "d")
		if err == nil && x.Flags == 0 && x.Size == 0 && len(script) < 18 {
			t.Fatalf("accepted a %d-byte handshake", len(script))
		}
	})
}

func TestBlockSize(t *testing.T) {
	tests := []struct {
		name string
		want int64
		x    Export
		bs   int64
		err  error
	}{
		{"default 4096", 0, Export{Size: 1 << 20}, 4096, nil},
		{"size not a multiple of 4096", 0, Export{Size: 1<<20 + 1024}, 1024, nil},
		{"odd size falls to 512", 0, Export{Size: 1000}, 512, nil},
		{"server prefers 512", 0, Export{Size: 1 << 20, PrefBlock: 512}, 512, nil},
		{"server prefers 64 KiB: clamped", 0, Export{Size: 1 << 20, PrefBlock: 65536}, 4096, nil},
		{"server minimum 4096 wins", 0, Export{Size: 1<<20 + 512, MinBlock: 4096}, 4096, nil},
		{"explicit 512", 512, Export{Size: 1 << 20}, 512, nil},
		{"explicit 2048", 2048, Export{Size: 1 << 20}, 2048, nil},
		{"too small", 256, Export{Size: 1 << 20}, 0, ErrBlockSize},
		{"too big", 8192, Export{Size: 1 << 20}, 0, ErrBlockSize},
		{"not a power of two", 3072, Export{Size: 1 << 20}, 0, ErrBlockSize},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			bs, err := blockSize(tc.want, tc.x)
			if !errors.Is(err, tc.err) || bs != tc.bs {
				t.Fatalf("blockSize = %d, %v; want %d, %v", bs, err, tc.bs, tc.err)
			}
		})
	}
}

func TestParseAddr(t *testing.T) {
	tests := []struct {
		name, socket, connect string
		network, addr         string
		ok                    bool
	}{
		{"unix", "/run/nbd.sock", "", "unix", "/run/nbd.sock", true},
		{"tcp with port", "", "127.0.0.1:10810", "tcp", "127.0.0.1:10810", true},
		{"tcp default port", "", "localhost", "tcp", "localhost:10809", true},
		{"both", "s", "h:1", "", "", false},
		{"neither", "", "", "", "", false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			n, a, err := ParseAddr(tc.socket, tc.connect)
			if (err == nil) != tc.ok || n != tc.network || a != tc.addr {
				t.Fatalf("ParseAddr = %q, %q, %v", n, a, err)
			}
		})
	}
}

// Attach's checks that need no kernel device: they fail before any ioctl.
// The kernel path itself is tested in a guest VM (vmtest TestGuest).
func TestAttachErrors(t *testing.T) {
	mapper := serveNbdmapper(t)
	tests := []struct {
		name string
		opts Options
		err  error
	}{
		{"unknown export", Options{Device: "/dev/null", Addr: mapper, Export: "nope"}, ErrRefused},
		{"bad block size", Options{Device: "/dev/null", Addr: mapper, BlockSize: 1000}, ErrBlockSize},
		{"no device", Options{Device: filepath.Join(t.TempDir(), "nbd0"), Addr: mapper}, os.ErrNotExist},
		{"not an nbd device", Options{Device: "/dev/null", Addr: mapper}, nil},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			err := Attach(context.Background(), tc.opts)
			if err == nil {
				t.Fatal("Attach succeeded")
			}
			if tc.err != nil && !errors.Is(err, tc.err) {
				t.Fatalf("err = %v, want %v", err, tc.err)
			}
			if tc.err == nil && !strings.Contains(err.Error(), "NBD_SET_BLKSIZE") {
				t.Fatalf("err = %v, want the first ioctl to fail", err)
			}
		})
	}
}
