package sparse

import (
	"os"
	"path/filepath"
	"syscall"
	"testing"
)

func TestCreate(t *testing.T) {
	path := filepath.Join(t.TempDir(), "d.img")
	if err := os.WriteFile(path, []byte("old contents"), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, size := range []int64{1 << 20, 4096} {
		if got := Create(t, path, size); got != path {
			t.Fatalf("Create returned %q, want %q", got, path)
		}
		fi, err := os.Stat(path)
		if err != nil {
			t.Fatal(err)
		}
		if fi.Size() != size {
			t.Fatalf("size %d, want %d", fi.Size(), size)
		}
		if st, ok := fi.Sys().(*syscall.Stat_t); ok && st.Blocks != 0 {
			t.Errorf("size %d: %d blocks allocated, want a hole", size, st.Blocks)
		}
	}
}
