package wire

import (
	"bytes"
	"testing"
)

// TestRoundTrips: what the encoders write, the decoders read back, in the
// byte layouts proto.md gives.
func TestRoundTrips(t *testing.T) {
	r := Request{Flags: CfFUA, Type: CmdWrite, Handle: 0x0102030405060708, Offset: 1 << 40, Length: 4096}
	b := AppendRequest(nil, r)
	want := []byte{0x25, 0x60, 0x95, 0x13, 0, 1, 0, 1, 1, 2, 3, 4, 5, 6, 7, 8, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0x10, 0}
	if !bytes.Equal(b, want) {
		t.Fatalf("request % x\nwant    % x", b, want)
	}
	if back, ok := DecodeRequest(b); !ok || back != r {
		t.Fatalf("decoded %+v, %v", back, ok)
	}
	if _, ok := DecodeRequest(make([]byte, RequestSize)); ok {
		t.Fatal("a request with a bad magic decoded")
	}

	s := AppendSimpleReply(nil, 9, EIO)
	if n := DecodeReplyMagic(s); n != SimpleReplySize || len(s) != n {
		t.Fatalf("simple reply header of %d bytes, magic says %d", len(s), n)
	}
	if got := DecodeReply(s); got != (Reply{Handle: 9, Errno: EIO}) || !got.Done() {
		t.Fatalf("simple reply %+v", got)
	}
	c := AppendChunkHeader(nil, 7, ReplyFlagDone, ChunkOffsetData, 4104)
	if n := DecodeReplyMagic(c); n != ChunkHeaderSize || len(c) != n {
		t.Fatalf("chunk header of %d bytes, magic says %d", len(c), n)
	}
	if got := DecodeReply(c); got != (Reply{Structured: true, Handle: 7, Flags: ReplyFlagDone, Type: ChunkOffsetData, Length: 4104}) || !got.Done() {
		t.Fatalf("chunk %+v", got)
	}
	if DecodeReplyMagic([]byte{1, 2, 3, 4}) != 0 {
		t.Fatal("a bad reply magic was taken")
	}
	o := AppendOption(nil, OptGo, []byte("xy"))
	if !bytes.Equal(o, []byte{'I', 'H', 'A', 'V', 'E', 'O', 'P', 'T', 0, 0, 0, 7, 0, 0, 0, 2, 'x', 'y'}) {
		t.Fatalf("option % x", o)
	}
}
