package flush_test

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/nbdmapper/nbdmapper/internal/testing/nbdtest"
)

// A raw NBD client, just enough for durability tests: fixed newstyle with
// NO_ZEROES, EXPORT_NAME, and one request at a time with simple replies.
// Byte layouts are in REFERENCE.md and the NBD protocol's doc/proto.md.
const (
	nbdMagic      = 0x4e42444d41474943
	optMagic      = 0x49484156454F5054
	optExportName = 1
	requestMagic  = 0x25609513
	replyMagic    = 0x67446698
	cmdWrite      = 1
	cmdFlush      = 3
	flagFUA       = 1 << 0
)

type nbdClient struct {
	c      net.Conn
	br     *bufio.Reader
	size   uint64
	cookie uint64
}

func dialNBD(socket string) (*nbdClient, error) {
	c, err := net.Dial("unix", socket)
	if err != nil {
		return nil, err
	}
	nc := &nbdClient{c: c, br: bufio.NewReader(c)}
	if err := nc.handshake(); err != nil {
		c.Close()
		return nil, fmt.Errorf("handshake: %w", err)
	}
	return nc, nil
}

func (nc *nbdClient) handshake() error {
	var g struct {
		Magic, Opt uint64
		Flags      uint16
	}
	if err := binary.Read(nc.br, binary.BigEndian, &g); err != nil {
		return err
	}
	if g.Magic != nbdMagic || g.Opt != optMagic {
		return errors.New("bad greeting")
	}
	// client flags FIXED_NEWSTYLE|NO_ZEROES, then EXPORT_NAME "" (default export)
	b := binary.BigEndian.AppendUint32(nil, 3)
	b = binary.BigEndian.AppendUint64(b, optMagic)
	b = binary.BigEndian.AppendUint32(b, optExportName)
	b = binary.BigEndian.AppendUint32(b, 0)
	if _, err := nc.c.Write(b); err != nil {
		return err
	}
	var info struct {
		Size  uint64
		Flags uint16
	}
	if err := binary.Read(nc.br, binary.BigEndian, &info); err != nil {
		return err
	}
	nc.size = info.Size
	return nil
}

// do sends one request and waits for its reply; errno is the NBD error.
//
//	request: u32 magic, u16 flags, u16 type, u64 cookie, u64 offset, u32 length, data
//	reply:   u32 magic, u32 error, u64 cookie
func (nc *nbdClient) do(cmd, flags uint16, off uint64, data []byte) (errno uint32, err error) {
	nc.cookie++
	b := make([]byte, 28, 28+len(data))
	binary.BigEndian.PutUint32(b[0:], requestMagic)
	binary.BigEndian.PutUint16(b[4:], flags)
	binary.BigEndian.PutUint16(b[6:], cmd)
	binary.BigEndian.PutUint64(b[8:], nc.cookie)
	binary.BigEndian.PutUint64(b[16:], off)
	binary.BigEndian.PutUint32(b[24:], uint32(len(data)))
	b = append(b, data...)
	if _, err := nc.c.Write(b); err != nil {
		return 0, err
	}
	var r [16]byte
	if _, err := io.ReadFull(nc.br, r[:]); err != nil {
		return 0, err
	}
	if binary.BigEndian.Uint32(r[0:]) != replyMagic || binary.BigEndian.Uint64(r[8:]) != nc.cookie {
		return 0, errors.New("bad reply")
	}
	return binary.BigEndian.Uint32(r[4:]), nil
}

func (nc *nbdClient) Close() error { return nc.c.Close() }

// model records what clients wrote and which writes a completed flush or a
// FUA reply made durable, and checks what survived a crash.
//
// Blocks are owned by one worker each, so a block's history is in the order
// its writes were sent. A write acknowledged (reply received) before a flush
// was sent is covered by that flush once it succeeds, whichever connection
// carried either: the global ack counter orders them.
type model struct {
	blockSize int
	round     int
	acks      atomic.Uint64 // replies to writes received so far
	durable   atomic.Uint64 // every write with ack <= durable is durable
	blocks    []*history
}

type history struct {
	initial []byte // content after the previous crash
	entries []*entry
}

type entry struct {
	data []byte
	ack  uint64 // 0 until the write's success reply arrived
	fua  bool   // acknowledged with FUA: durable by itself
}

func newModel(blocks, blockSize int) *model {
	m := &model{blockSize: blockSize}
	for range blocks {
		m.blocks = append(m.blocks, &history{initial: make([]byte, blockSize)})
	}
	return m
}

// pattern is a unique, position-dependent block content.
func (m *model) pattern(block, worker, seq int) []byte {
	p := make([]byte, m.blockSize)
	s := uint64(m.round)<<48 ^ uint64(block)<<32 ^ uint64(worker)<<24 ^ uint64(seq) | 1
	for i := 0; i < len(p); i += 8 {
		s ^= s << 13
		s ^= s >> 7
		s ^= s << 17
		binary.LittleEndian.PutUint64(p[i:], s)
	}
	return p
}

// write sends one write of consecutive blocks from first and records it.
func (m *model) write(nc *nbdClient, worker, seq, first, n int, fua bool) error {
	var data []byte
	var es []*entry
	for b := first; b < first+n; b++ {
		e := &entry{data: m.pattern(b, worker, seq)}
		m.blocks[b].entries = append(m.blocks[b].entries, e)
		es = append(es, e)
		data = append(data, e.data...)
	}
	var flags uint16
	if fua {
		flags = flagFUA
	}
	errno, err := nc.do(cmdWrite, flags, uint64(first*m.blockSize), data)
	if err != nil || errno != 0 {
		return fmt.Errorf("write: errno %d, %v", errno, err)
	}
	ack := m.acks.Add(1)
	for _, e := range es {
		e.ack, e.fua = ack, fua
	}
	return nil
}

// flush sends a flush; on success every write acknowledged before it was
// sent is durable.
func (m *model) flush(nc *nbdClient) error {
	covers := m.acks.Load()
	errno, err := nc.do(cmdFlush, 0, 0, nil)
	if err != nil || errno != 0 {
		return fmt.Errorf("flush: errno %d, %v", errno, err)
	}
	for {
		d := m.durable.Load()
		if covers <= d || m.durable.CompareAndSwap(d, covers) {
			return nil
		}
	}
}

// check compares each block's content after a crash with what may be there:
// the last durable write or anything written after it (never anything
// older), and starts the next round from what is there.
func (m *model) check(t *testing.T, read func(block int, p []byte)) (durableBlocks int) {
	t.Helper()
	got := make([]byte, m.blockSize)
	d := m.durable.Load()
	for b, h := range m.blocks {
		read(b, got)
		var candidates [][]byte
		last := -1
		for i, e := range h.entries {
			if e.fua || (e.ack != 0 && e.ack <= d) {
				last = i
			}
		}
		if last < 0 {
			candidates = append(candidates, h.initial)
		} else {
			durableBlocks++
		}
		for _, e := range h.entries[max(last, 0):] {
			candidates = append(candidates, e.data)
		}
		found := false
		for _, c := range candidates {
			if string(c) == string(got) {
				found = true
				break
			}
		}
		if !found {
			t.Errorf("round %d block %d: content %x... is none of the %d acceptable versions (last durable write #%d of %d)",
				m.round, b, got[:8], len(candidates), last, len(h.entries))
		}
		h.initial = append([]byte(nil), got...)
		h.entries = nil
	}
	m.round++
	m.acks.Store(0)
	m.durable.Store(0)
	return durableBlocks
}

// run drives workers connections of random writes (some FUA, some spanning
// two blocks) and flushes, each worker on its own blocks, until a request
// fails (the crash came). After each successful flush it calls
// afterFlush with how many ops all workers have started; a true result
// stops that worker.
func (m *model) run(t *testing.T, socket string, workers int, afterFlush func(ops int64) bool) {
	var ops atomic.Int64
	var wg sync.WaitGroup
	per := len(m.blocks) / workers
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			nc, err := dialNBD(socket)
			if err != nil {
				t.Errorf("worker %d: %v", w, err)
				return
			}
			defer nc.Close()
			rng := uint32(w*2654435761+m.round*97) | 1
			rand := func(n int) int {
				rng ^= rng << 13
				rng ^= rng >> 17
				rng ^= rng << 5
				return int(rng % uint32(n))
			}
			for seq := 1; ; seq++ {
				total := ops.Add(1)
				var err error
				switch r := rand(100); {
				case r < 20:
					err = m.flush(nc)
					if err == nil && afterFlush(total) {
						return
					}
				case r < 30:
					err = m.write(nc, w, seq, w*per+rand(per), 1, true)
				case r < 40:
					err = m.write(nc, w, seq, w*per+rand(per-1), 2, rand(2) == 0)
				default:
					err = m.write(nc, w, seq, w*per+rand(per), 1, false)
				}
				if err != nil {
					return // the crash came
				}
			}
		}()
	}
	nbdtest.Wait(t, &wg, "the writers to see the crash")
}
