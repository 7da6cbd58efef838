package nbdtest

import (
	"os"
	"os/exec"
	"path/filepath"
	"testing"
)

// Python returns the path of a python3 that can import libnbd's nbd module,
// or skips the test. The first python3 in PATH may be a private
// interpreter (pyenv, a virtualenv) without the Debian package's module, so
// the system one is tried next.
func Python(t testing.TB) string {
	t.Helper()
	for _, name := range []string{"python3", "/usr/bin/python3"} {
		py, err := exec.LookPath(name)
		if err != nil {
			continue
		}
		if exec.Command(py, "-c", "import nbd").Run() == nil {
			return py
		}
	}
	t.Skip("no python3 with the nbd module (Debian package python3-libnbd)")
	return ""
}

// Tool returns the path of an external program the test runs, or skips the
// test, naming the Debian package to install, if it is not in PATH. The CI
// installs them all; a developer's machine may lack some.
func Tool(t testing.TB, name string) string {
	t.Helper()
	p, err := exec.LookPath(name)
	if err != nil {
		pkg := debianPackage[name]
		if pkg == "" {
			pkg = name
		}
		t.Skipf("%s not installed (Debian package %s)", name, pkg)
	}
	return p
}

// debianPackage names the Debian package that installs each tool the tests
// run, where it differs from the tool's name.
var debianPackage = map[string]string{
	"go":       "golang-go",
	"nbdcopy":  "libnbd-bin",
	"nbdinfo":  "libnbd-bin",
	"nbdsh":    "libnbd-bin",
	"promtool": "prometheus",
	"qemu-img": "qemu-utils",
	"qemu-io":  "qemu-utils",
	"qemu-nbd": "qemu-utils",

	"systemd-analyze":         "systemd",
	"systemd-socket-activate": "systemd",
}

// Nbdsh returns a command running libnbd's nbdsh with args (for example
// "-u", uri, "-c", script), or skips the test if nbdsh or its Python
// module is missing. nbdsh runs `python3 -m nbd` with the first python3 in
// PATH, so PATH starts with the directory of the one Python found.
func Nbdsh(t testing.TB, args ...string) *exec.Cmd {
	t.Helper()
	nbdsh := Tool(t, "nbdsh")
	py := Python(t)
	cmd := exec.Command(nbdsh, args...)
	cmd.Env = append(os.Environ(), "PATH="+filepath.Dir(py)+string(filepath.ListSeparator)+os.Getenv("PATH"))
	return cmd
}

// URI is the NBD URI of an export served on a unix socket, as libnbd,
// nbdinfo and qemu take it.
func URI(socket, export string) string {
	return "nbd+unix:///" + export + "?socket=" + socket
}
