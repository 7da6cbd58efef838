package main

import (
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"strings"

	"github.com/nbdmapper/nbdmapper/flush"
	"github.com/nbdmapper/nbdmapper/nbdtarget"
	"github.com/nbdmapper/nbdmapper/remote"
)

// statusRoutes serves what `dmsetup status` and `dmsetup table` print for
// every device of a running server, as /status and /table on its HTTP
// listener: `NAME: <start> <length> <target> <status or args>`. /status
// also has one line for each failed backing device of an export, after its
// table's lines: `NAME: failed <device>: <first error>` (see failedLines),
// and one per remote export its table uses: `NAME: remote <URI>: up
// connections 4/4 ...` (see remoteLines).
func statusRoutes(exports func() []*nbdtarget.Export, f *flush.Engine, r *remote.Scheme) map[string]http.Handler {
	page := func(lines func(*nbdtarget.Export) string) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Type", "text/plain; charset=utf-8")
			for _, x := range exports() {
				for _, line := range strings.SplitAfter(lines(x), "\n") {
					if line != "" {
						fmt.Fprintf(w, "%s: %s", x.Name, line)
					}
				}
			}
		})
	}
	return map[string]http.Handler{
		"/status": page(func(x *nbdtarget.Export) string {
			return x.Dev.Table().Status() + failedLines(x, f) + remoteLines(x.Dev.Devices(), r)
		}),
		"/table": page(func(x *nbdtarget.Export) string { return x.Dev.Table().String() }),
	}
}

// failedLines lists the backing devices of x's table that the flush
// engine f has failed, one `failed <device>: <error>` line each: every
// flush of x fails until the server restarts (docs/flush.md, "Failing
// devices").
func failedLines(x *nbdtarget.Export, f *flush.Engine) string {
	failed := make(map[string]string)
	for _, d := range f.Stats().Devices {
		if d.Failed {
			failed[d.Name] = d.FailedError
		}
	}
	var b strings.Builder
	for _, d := range x.Dev.Devices() {
		if msg, ok := failed[d.Name()]; ok {
			fmt.Fprintf(&b, "failed %s: %s\n", d.Name(), strings.ReplaceAll(msg, "\n", " "))
		}
	}
	return b.String()
}

// runStatus asks a running `nbdmapper serve` for its devices' status lines
// (or, with --table, their tables), like dmsetup status / dmsetup table.
func runStatus(args []string) error {
	fs := newFlagSet("status")
	addr := fs.String("metrics", defaultMetricsAddr, "the server's --metrics HOST:PORT, or a URL (https://HOST:PORT)")
	tableOut := fs.Bool("table", false, "print the tables instead of their status")
	var hf httpClientFlags
	hf.register(fs)
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() != 0 {
		return errors.New("status takes no arguments")
	}
	path := "/status"
	if *tableOut {
		path = "/table"
	}
	client, base, err := hf.client(*addr)
	if err != nil {
		return err
	}
	req, err := http.NewRequest(http.MethodGet, base+path, nil)
	if err != nil {
		return err
	}
	if err := hf.auth(req); err != nil {
		return err
	}
	resp, err := client.Do(req)
	if err != nil {
		return fmt.Errorf("is nbdmapper serve running with --metrics %s? %w", *addr, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("%s%s: %s", base, path, resp.Status)
	}
	page, err := io.ReadAll(resp.Body)
	if err != nil {
		return err
	}
	if !*tableOut {
		page = []byte(mergePercentLines(string(page)))
	}
	_, err = os.Stdout.Write(page)
	return err
}
