package main

import (
	"slices"
	"testing"
)

func TestProcsFor(t *testing.T) {
	var set []int
	hook := procsFor(4, func(n int) int { set = append(set, n); return 0 })
	for _, conns := range []int{1, 2, 3, 2, 5, 6, 4, 1, 0, 1} {
		hook(conns)
	}
	// Only changes are set, clamped to [1, 4].
	if want := []int{1, 2, 3, 2, 4, 1}; !slices.Equal(set, want) {
		t.Errorf("GOMAXPROCS set to %v, want %v", set, want)
	}
}

func TestProcsFlag(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want int
		ok   bool
	}{{"auto", 0, true}, {"1", 1, true}, {"8", 8, true}, {"0", 0, false}, {"-2", 0, false}, {"many", 0, false}} {
		var p procsFlag
		err := p.Set(tc.in)
		if (err == nil) != tc.ok || (tc.ok && p.n != tc.want) {
			t.Errorf("Set(%q): n %d, err %v; want n %d, ok %v", tc.in, p.n, err, tc.want, tc.ok)
		}
	}
}
