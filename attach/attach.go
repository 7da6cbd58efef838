package attach

import (
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"time"

	"github.com/pojntfx/go-nbd/pkg/ioctl"
	"golang.org/x/sys/unix"

	"github.com/nbdmapper/nbdmapper/wire"
)

// Kernel nbd ioctls, _IO(0xab, n) (include/uapi/linux/nbd.h). go-nbd's
// ioctl package takes them from the kernel headers through cgo, or from its
// own table on amd64 without cgo; it has all but NBD_SET_FLAGS, which its
// client never sends (_IO(0xab, 10) wherever _IOC_NONE is 0, as on x86 and
// arm).
const (
	ioctlSetSock       = ioctl.NEGOTIATION_IOCTL_SET_SOCK        // arg: socket fd
	ioctlSetBlksize    = ioctl.NEGOTIATION_IOCTL_SET_BLOCKSIZE   // arg: bytes
	ioctlDoIt          = ioctl.NEGOTIATION_IOCTL_DO_IT           // blocks until disconnect
	ioctlClearSock     = ioctl.TRANSMISSION_IOCTL_CLEAR_SOCK     // no arg
	ioctlClearQue      = ioctl.TRANSMISSION_IOCTL_CLEAR_QUE      // no arg
	ioctlSetSizeBlocks = ioctl.NEGOTIATION_IOCTL_SET_SIZE_BLOCKS // arg: size in blocks
	ioctlDisconnect    = ioctl.TRANSMISSION_IOCTL_DISCONNECT     // no arg
	ioctlSetTimeout    = ioctl.NEGOTIATION_IOCTL_SET_TIMEOUT     // arg: seconds
	ioctlSetFlags      = 0xab0a                                  // NBD_SET_FLAGS; arg: transmission flags
)

// Options say what to attach where.
type Options struct {
	Device  string // /dev/nbdX
	Network string // "unix" or "tcp"
	Addr    string // socket path or host:port
	Export  string // export name; "" is the server's default

	// Connections is how many sockets to give the kernel; more than one
	// needs CAN_MULTI_CONN. Zero means one.
	Connections int
	// BlockSize is the logical block size, a power of two in 512..4096.
	// Zero picks the server's preferred size clamped to that range, or
	// 4096, halved until it divides the export size.
	BlockSize int64
	// Timeout is the kernel's per-request timeout; zero leaves the default.
	Timeout time.Duration
	// Ready, if set, is called once the kernel runs the device.
	Ready func(Export)
	// Follow is how often to ask the server for the export's size, so that
	// the device follows a reload that grows or shrinks it (the kernel's
	// nbd driver takes a new size while connected). Zero means every
	// second; negative, never. NBD has no way for a server to announce a
	// new size, so this asks, over a connection of its own.
	Follow time.Duration
	// Resized, if set, is called after the device took a new size.
	Resized func(bytes uint64)
}

// Attach connects opts.Export to opts.Device and serves it until the device
// is disconnected (Detach, nbd-client -d) or ctx is cancelled, which
// disconnects it. It returns nil after a requested disconnect.
func Attach(ctx context.Context, opts Options) error {
	n := max(opts.Connections, 1)
	socks := make([]*os.File, 0, n)
	defer func() {
		for _, f := range socks {
			f.Close()
		}
	}()
	var x Export
	for i := range n {
		f, xi, err := dial(opts)
		if err != nil {
			return err
		}
		socks = append(socks, f)
		if i == 0 {
			x = xi
			if n > 1 && x.Flags&wire.TfCanMultiConn == 0 {
				return fmt.Errorf("%d connections to %q: %w", n, opts.Export, ErrMultiConn)
			}
		}
	}
	bs, err := blockSize(opts.BlockSize, x)
	if err != nil {
		return err
	}
	blocks := x.Size / uint64(bs)
	if blocks == 0 {
		return fmt.Errorf("export %q of %d bytes, block size %d: %w", opts.Export, x.Size, bs, ErrNoSize)
	}

	dev, err := os.OpenFile(opts.Device, os.O_RDWR, 0)
	if err != nil {
		return err
	}
	defer dev.Close()
	fd := int(dev.Fd())
	steps := []step{
		{"NBD_SET_BLKSIZE", ioctlSetBlksize, int(bs)},
		{"NBD_SET_SIZE_BLOCKS", ioctlSetSizeBlocks, int(blocks)},
		{"NBD_CLEAR_SOCK", ioctlClearSock, 0},
		{"NBD_SET_FLAGS", ioctlSetFlags, int(x.Flags)},
	}
	if opts.Timeout > 0 {
		secs := max(int(opts.Timeout/time.Second), 1)
		steps = append(steps, step{"NBD_SET_TIMEOUT", ioctlSetTimeout, secs})
	}
	for _, f := range socks {
		steps = append(steps, step{"NBD_SET_SOCK", ioctlSetSock, int(f.Fd())})
	}

	setup := make(chan error, 1)
	done := make(chan error, 1)
	go func() { done <- run(fd, steps, setup) }()
	if err := <-setup; err != nil {
		<-done
		return fmt.Errorf("%s: %w", opts.Device, err)
	}
	stopWatch := make(chan struct{})
	defer close(stopWatch)
	if opts.Ready != nil {
		go func() {
			if waitRunning(opts.Device, stopWatch) {
				opts.Ready(x)
			}
		}()
	}
	if opts.Follow >= 0 {
		go follow(opts, fd, bs, x.Size, stopWatch)
	}
	select {
	case err = <-done:
	case <-ctx.Done():
		unix.IoctlRetInt(fd, ioctlDisconnect)
		err = <-done
	}
	// as nbd-client does after NBD_DO_IT returns
	unix.IoctlRetInt(fd, ioctlClearQue)
	unix.IoctlRetInt(fd, ioctlClearSock)
	if err != nil {
		return fmt.Errorf("%s: %w", opts.Device, err)
	}
	return nil
}

// step is one configuration ioctl.
type step struct {
	name string
	req  uint
	arg  int
}

// run configures the device and then serves it with NBD_DO_IT, all on one
// OS thread with every signal blocked. One thread, because the kernel
// remembers the task that added the first socket and refuses sockets from
// any other ("Device being setup by another task", EBUSY), and a goroutine
// may move between threads from one syscall to the next. Signals blocked,
// because NBD_DO_IT waits interruptibly and tears the device down when a
// signal arrives, and the Go runtime signals threads freely (preemption,
// SIGCHLD, SIGINT). The thread stays locked, so it exits with the
// goroutine instead of carrying the mask back into the scheduler.
//
// run sends the setup result on setup (nil once NBD_DO_IT is about to
// start) and returns NBD_DO_IT's result.
func run(fd int, steps []step, setup chan<- error) error {
	runtime.LockOSThread()
	var all unix.Sigset_t
	for i := range all.Val {
		all.Val[i] = ^uint64(0)
	}
	if err := unix.PthreadSigmask(unix.SIG_BLOCK, &all, nil); err != nil {
		err = fmt.Errorf("blocking signals: %w", err)
		setup <- err
		return err
	}
	for _, s := range steps {
		if err := unix.IoctlSetInt(fd, s.req, s.arg); err != nil {
			unix.IoctlRetInt(fd, ioctlClearSock)
			err = fmt.Errorf("%s: %w", s.name, err)
			setup <- err
			return err
		}
	}
	setup <- nil
	if _, err := unix.IoctlRetInt(fd, ioctlDoIt); err != nil {
		return fmt.Errorf("NBD_DO_IT: %w", err)
	}
	return nil
}

// follow asks the server for the export's size every opts.Follow and gives
// the kernel any new one (NBD_SET_SIZE_BLOCKS, which a running device
// takes: the driver sets the disk's capacity and tells udev). A size the
// block size does not divide is rounded down, as at attach. Failed asks
// are retried on the next tick: the server may be restarting.
func follow(opts Options, fd int, bs int64, size uint64, stop <-chan struct{}) {
	every := opts.Follow
	if every == 0 {
		every = time.Second
	}
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-stop:
			return
		case <-t.C:
		}
		c, err := net.Dial(opts.network(), opts.Addr)
		if err != nil {
			continue
		}
		x, err := Handshake(c, opts.Export)
		c.Close()
		if err != nil || x.Size == size || x.Size/uint64(bs) == 0 {
			continue
		}
		if err := unix.IoctlSetInt(fd, ioctlSetSizeBlocks, int(x.Size/uint64(bs))); err != nil {
			continue
		}
		size = x.Size
		if opts.Resized != nil {
			opts.Resized(size)
		}
	}
}

// Detach disconnects device: the kernel sends NBD_CMD_DISC once in-flight
// requests are done, and the Attach holding the device returns.
func Detach(device string) error {
	dev, err := os.OpenFile(device, os.O_RDWR, 0)
	if err != nil {
		return err
	}
	defer dev.Close()
	fd := int(dev.Fd())
	if !Running(device) {
		return fmt.Errorf("%s: %w", device, ErrNotAttached)
	}
	if _, err := unix.IoctlRetInt(fd, ioctlDisconnect); err != nil {
		return fmt.Errorf("%s: NBD_DISCONNECT: %w", device, err)
	}
	if _, err := unix.IoctlRetInt(fd, ioctlClearSock); err != nil {
		return fmt.Errorf("%s: NBD_CLEAR_SOCK: %w", device, err)
	}
	return nil
}

// Running reports whether the kernel runs device, judged by the pid file
// the nbd driver adds to sysfs while NBD_DO_IT (or a netlink connect) holds
// it.
func Running(device string) bool {
	_, err := os.Stat(filepath.Join("/sys/block", filepath.Base(device), "pid"))
	return err == nil
}

func waitRunning(device string, stop <-chan struct{}) bool {
	for {
		if Running(device) {
			return true
		}
		select {
		case <-stop:
			return false
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// blockSize validates want, or picks one (see Options.BlockSize).
func blockSize(want int64, x Export) (int64, error) {
	ok := func(b int64) bool { return b >= 512 && b <= 4096 && b&(b-1) == 0 }
	if want != 0 {
		if !ok(want) {
			return 0, fmt.Errorf("block size %d: %w", want, ErrBlockSize)
		}
		return want, nil
	}
	bs := int64(4096)
	if p := int64(x.PrefBlock); ok(p) {
		bs = p
	}
	for bs > 512 && x.Size%uint64(bs) != 0 {
		bs /= 2
	}
	if m := int64(x.MinBlock); m > bs && ok(m) {
		bs = m
	}
	return bs, nil
}

// dial opens one connection, negotiates the export and returns the socket
// as a blocking file for NBD_SET_SOCK.
func dial(opts Options) (*os.File, Export, error) {
	network := opts.network()
	c, err := net.Dial(network, opts.Addr)
	if err != nil {
		return nil, Export{}, err
	}
	defer c.Close() // the kernel gets a dup
	x, err := Handshake(c, opts.Export)
	if err != nil {
		return nil, Export{}, fmt.Errorf("%s %s: %w", network, opts.Addr, err)
	}
	if tc, ok := c.(*net.TCPConn); ok {
		tc.SetNoDelay(true)
	}
	fc, ok := c.(interface{ File() (*os.File, error) })
	if !ok {
		return nil, Export{}, fmt.Errorf("%s connections cannot be attached", network)
	}
	f, err := fc.File()
	if err != nil {
		return nil, Export{}, err
	}
	if err := unix.SetNonblock(int(f.Fd()), false); err != nil {
		f.Close()
		return nil, Export{}, err
	}
	return f, x, nil
}

func (opts Options) network() string {
	if opts.Network == "" {
		return "unix"
	}
	return opts.Network
}

// ParseAddr splits a --socket/--connect pair into a network and address.
func ParseAddr(socket, connect string) (network, addr string, err error) {
	switch {
	case socket != "" && connect != "":
		return "", "", fmt.Errorf("give --socket or --connect, not both")
	case socket != "":
		return "unix", socket, nil
	case connect != "":
		if !strings.Contains(connect, ":") {
			connect += ":10809"
		}
		return "tcp", connect, nil
	}
	return "", "", fmt.Errorf("give --socket PATH or --connect HOST:PORT")
}
