package main

import (
	"cmp"
	"context"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/nbdmapper/nbdmapper/attach"
)

// runAttach connects an export to a kernel nbd device; see package attach.
func runAttach(args []string) error {
	fs := newFlagSet("attach")
	socket := fs.String("socket", "", "connect to the server's unix socket PATH")
	connect := fs.String("connect", "", "connect to the server at HOST:PORT (default port 10809)")
	export := fs.String("export", "", "export name (default: the server's default export)")
	conns := fs.Int("connections", 1, "sockets to give the kernel; more than 1 needs CAN_MULTI_CONN")
	bs := fs.Int64("block-size", 0, "logical block size, a power of two in 512..4096 (default: the server's preferred, else 4096)")
	timeout := fs.Int("timeout", 0, "kernel request timeout in seconds (0: the kernel's default)")
	follow := fs.Duration("follow", time.Second, "how often to ask the server for the export's size, so the device follows a reload that resizes it (0: never)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() != 1 {
		fs.Usage()
		return flag.ErrHelp
	}
	network, addr, err := attach.ParseAddr(*socket, *connect)
	if err != nil {
		return err
	}
	dev := fs.Arg(0)
	log := slog.New(slog.NewTextHandler(os.Stderr, nil))
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	err = attach.Attach(ctx, attach.Options{
		Device:      dev,
		Network:     network,
		Addr:        addr,
		Export:      *export,
		Connections: *conns,
		BlockSize:   *bs,
		Timeout:     time.Duration(*timeout) * time.Second,
		Follow:      cmp.Or(*follow, -1),
		Resized: func(size uint64) {
			log.Info("resized", "device", dev, "bytes", size)
		},
		Ready: func(x attach.Export) {
			log.Info("attached", "device", dev, "export", *export, "bytes", x.Size,
				"flags", fmt.Sprintf("%#x", x.Flags), "connections", *conns)
		},
	})
	if err != nil {
		return err
	}
	log.Info("detached", "device", dev)
	return nil
}

// runDetach disconnects a kernel nbd device attached by nbdmapper attach or
// nbd-client.
func runDetach(args []string) error {
	fs := newFlagSet("detach")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() != 1 {
		fs.Usage()
		return flag.ErrHelp
	}
	return attach.Detach(fs.Arg(0))
}
