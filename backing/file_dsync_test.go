package backing

import (
	"bytes"
	"testing"
)

func TestWriteAtDSync(t *testing.T) {
	cases := []struct {
		name string
		off  int64
		size int
	}{
		{"one sector", 0, 512},
		{"unaligned", 1000, 3},
		{"large", 4096, 256 << 10},
	}
	f, err := OpenFile(sparseFile(t, 1<<20), false)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			p := bytes.Repeat([]byte{byte(tc.size)}, tc.size)
			n, err := f.WriteAtDSync(p, tc.off)
			if err != nil || n != tc.size {
				t.Fatalf("WriteAtDSync: %d, %v", n, err)
			}
			got := make([]byte, tc.size)
			if _, err := f.ReadAt(got, tc.off); err != nil || !bytes.Equal(got, p) {
				t.Fatalf("read back differs (err %v)", err)
			}
		})
	}
}
