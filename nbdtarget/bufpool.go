package nbdtarget

import (
	"math/bits"
	"sync"
)

// Buffers for payloads and read data come from power-of-two size classes,
// 4 KiB to MaxPayload (32 MiB), each a sync.Pool of *[]byte, so a steady
// stream of 4 KiB requests reuses the same few buffers.
const (
	minBufShift = 12
	numBufSizes = 26 - minBufShift // 4 KiB << 13 = 32 MiB
)

var bufPools [numBufSizes]sync.Pool

func bufClass(n int) int {
	if n <= 1<<minBufShift {
		return 0
	}
	return bits.Len(uint(n-1)) - minBufShift
}

// getBuf returns a buffer of at least n bytes, n <= MaxPayload.
func getBuf(n int) *[]byte {
	k := bufClass(n)
	if p, ok := bufPools[k].Get().(*[]byte); ok {
		return p
	}
	b := make([]byte, 1<<(k+minBufShift))
	return &b
}

func putBuf(p *[]byte) {
	bufPools[bufClass(cap(*p))].Put(p)
}
