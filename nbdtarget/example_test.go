package nbdtarget_test

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"io"
	"log"
	"net"
	"os"
	"path/filepath"
	"strings"

	"github.com/pojntfx/go-nbd/pkg/protocol"

	"github.com/nbdmapper/nbdmapper/attach"
	"github.com/nbdmapper/nbdmapper/backing"
	"github.com/nbdmapper/nbdmapper/discard"
	"github.com/nbdmapper/nbdmapper/flush"
	"github.com/nbdmapper/nbdmapper/mapped"
	"github.com/nbdmapper/nbdmapper/nbdtarget"
	"github.com/nbdmapper/nbdmapper/table"
	"github.com/nbdmapper/nbdmapper/wire"
)

// Serve a table in-process on a unix socket, then write and read it back
// as an NBD client: attach.Handshake negotiates the export (NBD_OPT_GO),
// and requests and replies are go-nbd's wire structs.
func Example() {
	dir, err := os.MkdirTemp("", "nbdtarget-example")
	if err != nil {
		log.Fatal(err)
	}
	defer os.RemoveAll(dir)
	disk := filepath.Join(dir, "disk.img")
	if err := os.WriteFile(disk, make([]byte, 1<<20), 0o644); err != nil {
		log.Fatal(err)
	}

	// The server: one export of a table whose second half reads as zeros.
	pool := &backing.Pool{}
	defer pool.Close()
	t, err := table.Parse("example.table", strings.NewReader("0 1024 linear "+disk+" 0\n1024 1024 zero\n"), pool)
	if err != nil {
		log.Fatal(err)
	}
	defer t.Close()
	srv := &nbdtarget.Server{Exports: []*nbdtarget.Export{
		{Name: "example", Dev: mapped.New("example", t, flush.New(), discard.New())},
	}}
	sock := filepath.Join(dir, "nbd.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		log.Fatal(err)
	}
	go srv.Serve(l)
	defer srv.Shutdown(context.Background())

	// The client.
	c, err := net.Dial("unix", sock)
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()
	x, err := attach.Handshake(c, "example")
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("size", x.Size, "read-only", x.Flags&wire.TfReadOnly != 0)
	request := func(typ uint16, off uint64, n uint32, payload []byte) []byte {
		hdr := protocol.TransmissionRequestHeader{
			RequestMagic: protocol.TRANSMISSION_MAGIC_REQUEST, Type: typ, Handle: off, Offset: off, Length: n,
		}
		if err := binary.Write(c, binary.BigEndian, hdr); err != nil {
			log.Fatal(err)
		}
		c.Write(payload)
		var reply protocol.TransmissionReplyHeader
		if err := binary.Read(c, binary.BigEndian, &reply); err != nil {
			log.Fatal(err)
		}
		if reply.ReplyMagic != protocol.TRANSMISSION_MAGIC_REPLY || reply.Error != 0 || reply.Handle != off {
			log.Fatalf("reply %+v", reply)
		}
		var data []byte
		if typ == protocol.TRANSMISSION_TYPE_REQUEST_READ {
			data = make([]byte, n)
			if _, err := io.ReadFull(c, data); err != nil {
				log.Fatal(err)
			}
		}
		return data
	}
	msg := []byte("hello, nbd")
	request(protocol.TRANSMISSION_TYPE_REQUEST_WRITE, 4096, uint32(len(msg)), msg)
	fmt.Printf("read back: %q\n", request(protocol.TRANSMISSION_TYPE_REQUEST_READ, 4096, uint32(len(msg)), nil))
	zero := request(protocol.TRANSMISSION_TYPE_REQUEST_READ, 1<<19, 4096, nil)
	fmt.Println("zero target reads zeros:", bytes.Equal(zero, make([]byte, 4096)))

	onDisk, err := os.ReadFile(disk)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Printf("disk.img at 4096: %q\n", onDisk[4096:4096+len(msg)])
	// Output:
	// size 1048576 read-only false
	// read back: "hello, nbd"
	// zero target reads zeros: true
	// disk.img at 4096: "hello, nbd"
}
