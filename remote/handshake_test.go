package remote

import (
	"bytes"
	"errors"
	"io"
	"testing"

	"github.com/nbdmapper/nbdmapper/wire"
)

// scripted is a server that says script, whatever the client sends.
type scripted struct{ r io.Reader }

func (s scripted) Read(p []byte) (int, error)  { return s.r.Read(p) }
func (s scripted) Write(p []byte) (int, error) { return len(p), nil }

func optReply(opt, typ uint32, body ...[]byte) []byte {
	b := bytes.Join(body, nil)
	return bytes.Join([][]byte{be64(wire.MagicOptReply), be32(opt), be32(typ), be32(uint32(len(b))), b}, nil)
}

var greeting = bytes.Join([][]byte{be64(wire.MagicNBD), be64(wire.MagicOpt), be16(wire.FlagFixedNewstyle | wire.FlagNoZeroes)}, nil)

// TestHandshakeStructured: structured replies, base:allocation and block
// sizes as a server offers them, and what is made of servers that refuse
// them or send what proto.md forbids.
func TestHandshakeStructured(t *testing.T) {
	meta := optReply(wire.OptSetMetaContext, wire.RepMetaContext, be32(9), []byte(wire.MetaBaseAllocation))
	goOK := bytes.Join([][]byte{
		optReply(wire.OptGo, wire.RepInfo, be16(wire.InfoExport), be64(1<<30), be16(0x1ed)),
		optReply(wire.OptGo, wire.RepInfo, be16(wire.InfoBlockSize), be32(512), be32(4096), be32(1<<20)),
		optReply(wire.OptGo, wire.RepAck),
	}, nil)
	for _, tc := range []struct {
		name    string
		script  [][]byte
		want    Export
		wantErr error
	}{
		{"everything", [][]byte{greeting, optReply(wire.OptStructuredReply, wire.RepAck), meta,
			optReply(wire.OptSetMetaContext, wire.RepAck), goOK},
			Export{Size: 1 << 30, Flags: 0x1ed, MinBlock: 512, PrefBlock: 4096, MaxBlock: 1 << 20, Structured: true, Meta: true, MetaID: 9}, nil},
		{"no structured replies", [][]byte{greeting, optReply(wire.OptStructuredReply, wire.RepErrUnsup), goOK},
			Export{Size: 1 << 30, Flags: 0x1ed, MinBlock: 512, PrefBlock: 4096, MaxBlock: 1 << 20}, nil},
		{"no meta context", [][]byte{greeting, optReply(wire.OptStructuredReply, wire.RepAck),
			optReply(wire.OptSetMetaContext, wire.RepAck), goOK},
			Export{Size: 1 << 30, Flags: 0x1ed, MinBlock: 512, PrefBlock: 4096, MaxBlock: 1 << 20, Structured: true}, nil},
		{"meta refused", [][]byte{greeting, optReply(wire.OptStructuredReply, wire.RepAck),
			optReply(wire.OptSetMetaContext, wire.RepErrInvalid), goOK},
			Export{Size: 1 << 30, Flags: 0x1ed, MinBlock: 512, PrefBlock: 4096, MaxBlock: 1 << 20, Structured: true}, nil},
		{"minimum block not a power of two", [][]byte{greeting, optReply(wire.OptStructuredReply, wire.RepErrUnsup),
			optReply(wire.OptGo, wire.RepInfo, be16(wire.InfoBlockSize), be32(3000), be32(4096), be32(1<<20))}, Export{}, ErrProtocol},
		{"minimum block too big", [][]byte{greeting, optReply(wire.OptStructuredReply, wire.RepErrUnsup),
			optReply(wire.OptGo, wire.RepInfo, be16(wire.InfoBlockSize), be32(1<<17), be32(1<<17), be32(1<<20))}, Export{}, ErrProtocol},
		{"maximum below minimum", [][]byte{greeting, optReply(wire.OptStructuredReply, wire.RepErrUnsup),
			optReply(wire.OptGo, wire.RepInfo, be16(wire.InfoBlockSize), be32(4096), be32(4096), be32(512))}, Export{}, ErrProtocol},
		{"TLS required", [][]byte{greeting, optReply(wire.OptStructuredReply, wire.RepErrTLSReqd), optReply(wire.OptGo, wire.RepErrTLSReqd)},
			Export{}, ErrRefused},
		{"reply for another option", [][]byte{greeting, optReply(wire.OptGo, wire.RepAck)}, Export{}, ErrProtocol},
		{"huge option reply", [][]byte{greeting, bytes.Join([][]byte{be64(wire.MagicOptReply), be32(wire.OptStructuredReply), be32(wire.RepAck), be32(1 << 30)}, nil)},
			Export{}, ErrProtocol},
	} {
		t.Run(tc.name, func(t *testing.T) {
			x, err := Handshake(scripted{bytes.NewReader(bytes.Join(tc.script, nil))}, HandshakeOptions{Export: "e", Structured: true})
			if !errors.Is(err, tc.wantErr) || (err != nil && tc.wantErr == nil) {
				t.Fatalf("err %v, want %v", err, tc.wantErr)
			}
			if x != tc.want {
				t.Fatalf("export %+v, want %+v", x, tc.want)
			}
		})
	}
}

// FuzzHandshake: whatever a server says during the handshake, the client
// ends it with an export or an error, without panicking or reading more
// than the script. The seeds run as a normal test.
func FuzzHandshake(f *testing.F) {
	f.Add(bytes.Join([][]byte{greeting, optReply(wire.OptStructuredReply, wire.RepAck),
		optReply(wire.OptSetMetaContext, wire.RepMetaContext, be32(1), []byte(wire.MetaBaseAllocation)),
		optReply(wire.OptSetMetaContext, wire.RepAck),
		optReply(wire.OptGo, wire.RepInfo, be16(wire.InfoExport), be64(1<<20), be16(1)), optReply(wire.OptGo, wire.RepAck)}, nil))
	f.Add(bytes.Join([][]byte{greeting, optReply(wire.OptStructuredReply, wire.RepErrUnsup), optReply(wire.OptGo, wire.RepErrUnsup), be64(1 << 20), be16(1)}, nil))
	f.Add(greeting)
	f.Fuzz(func(t *testing.T, script []byte) {
		x, err := Handshake(scripted{bytes.NewReader(script)}, HandshakeOptions{Export: "e", Structured: true})
		if err == nil && x.MinBlock != 0 && checkBlockSizes(x) != nil {
			t.Fatalf("accepted bad block sizes %+v", x)
		}
	})
}
