package main

import (
	"fmt"
	"net"
	"os"
	"strconv"
	"syscall"
)

// defaultSocketMode lets the owner and the socket's group connect: file
// permissions are what guard a unix socket.
const defaultSocketMode socketMode = 0o660

// socketMode is --socket-mode, an octal permission mode.
type socketMode os.FileMode

func (m *socketMode) String() string { return fmt.Sprintf("%#o", os.FileMode(*m)) }

func (m *socketMode) Set(s string) error {
	v, err := strconv.ParseUint(s, 8, 32)
	if err != nil || v&^0o777 != 0 {
		return fmt.Errorf("%q: want an octal mode such as 0660", s)
	}
	*m = socketMode(v)
	return nil
}

// listenUnix creates the socket at path with exactly mode. bind(2) creates
// the file with 0777 less the umask, so the umask is narrowed around it:
// the socket is never reachable more widely than asked, not even between
// bind and a chmod.
func listenUnix(path string, mode socketMode) (net.Listener, error) {
	os.Remove(path)
	old := syscall.Umask(0o777 &^ int(mode))
	l, err := net.Listen("unix", path)
	syscall.Umask(old)
	if err != nil {
		return nil, err
	}
	if err := os.Chmod(path, os.FileMode(mode)); err != nil {
		l.Close()
		return nil, err
	}
	return l, nil
}
