package nbdtest

import (
	"context"
	"io"
	"net"
	"net/http"
	"strings"
	"syscall"
	"testing"
)

// TestServeUnix serves an http.Server (it has the same Serve/Shutdown shape
// as nbdtarget.Server) and fetches a page over the socket.
func TestServeUnix(t *testing.T) {
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.WriteString(w, "hello")
	})}
	sock := ServeUnix(t, srv, http.ErrServerClosed)
	c := http.Client{Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		return (&net.Dialer{}).DialContext(ctx, "unix", sock)
	}}}
	resp, err := c.Get("http://unix/")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil || string(b) != "hello" {
		t.Fatalf("GET over %s: %q, %v", sock, b, err)
	}
	c.CloseIdleConnections()
}

// TestStartNbdsh builds the binary, serves its demo export, reads its size
// with nbdsh and stops the server with SIGTERM; then a second server is
// killed with SIGKILL.
func TestStartNbdsh(t *testing.T) {
	bin := Binary(t)
	s := Start(t, bin, t.TempDir(), "--metrics=off")
	out, err := Nbdsh(t, "-u", s.URI("demo"), "-c", "print(h.get_size())").CombinedOutput()
	if err != nil || strings.TrimSpace(string(out)) != "67108864" {
		t.Fatalf("nbdsh: %v\n%s", err, out)
	}
	s.Stop(t)
	if !strings.Contains(s.Stdout(), "nbd-client") {
		t.Errorf("demo did not print how to connect:\n%s", s.Stdout())
	}

	k := Start(t, bin, t.TempDir(), "--metrics=off")
	k.Signal(syscall.SIGKILL)
	if err := k.Wait(); err == nil || !strings.Contains(err.Error(), "killed") {
		t.Fatalf("after SIGKILL Wait = %v, want killed", err)
	}
}

func TestTool(t *testing.T) {
	if p := Tool(t, "sh"); !strings.HasSuffix(p, "/sh") {
		t.Errorf("Tool(sh) = %q, want a path to sh", p)
	}
	t.Run("missing tool skips", func(t *testing.T) {
		Tool(t, "nbdmapper-no-such-tool")
		t.Error("Tool returned for a missing tool instead of skipping")
	})
}
