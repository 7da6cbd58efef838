package main

import (
	"bufio"
	"bytes"
	"math/rand/v2"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/nbdmapper/nbdmapper/internal/testing/nbdtest"
)

// TestServeSplice reads a megabyte of a written file through `serve` and
// `serve --splice=false`: the same bytes either way, sent by splice(2) only
// without the flag, as nbdmapper_read_spliced_bytes_total tells.
func TestServeSplice(t *testing.T) {
	dir := t.TempDir()
	data := make([]byte, 2<<20)
	for i := range data {
		data[i] = byte(rand.Uint32())
	}
	if err := os.WriteFile(filepath.Join(dir, "data.img"), data, 0o644); err != nil {
		t.Fatal(err)
	}
	os.WriteFile(filepath.Join(dir, "x.table"), []byte("0 4096 linear data.img 0\n"), 0o644)
	for _, tc := range []struct {
		flags   []string
		spliced float64
	}{
		{nil, 1 << 20},
		{[]string{"--splice=false"}, 0},
	} {
		s := serve(t, dir, append(tc.flags, "x=x.table")...)
		if got := readExport(t, s.Socket, "x", 1<<20); !bytes.Equal(got, data[:1<<20]) {
			t.Fatalf("serve %v: the read returned other bytes than the file holds", tc.flags)
		}
		spliced := func() float64 { return scrapeValue(t, s.metrics, `nbdmapper_read_spliced_bytes_total{export="x"}`) }
		// A spliced reply is counted once it has all gone into the socket,
		// which can be after the client has it.
		nbdtest.Until(t, "the read to be counted", func() bool { return spliced() >= tc.spliced })
		if got := spliced(); got != tc.spliced {
			t.Errorf("serve %v: nbdmapper_read_spliced_bytes_total = %v, want %v", tc.flags, got, tc.spliced)
		}
		s.Stop(t)
	}
}

// scrapeValue returns the value of the sample named series (name and
// labels, as the text format writes them) in a scrape of addr/metrics.
func scrapeValue(t *testing.T, addr, series string) float64 {
	t.Helper()
	resp, err := http.Get("http://" + addr + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), series+" "); ok {
			f, err := strconv.ParseFloat(v, 64)
			if err != nil {
				t.Fatal(err)
			}
			return f
		}
	}
	t.Fatalf("no sample %s in the scrape", series)
	return 0
}
