#!/usr/bin/env bash
# Runs nbdmapper's whole test suite on a fresh Debian 12 machine: installs the
# real peers the tests drive (libnbd tools, fio, qemu, nbdkit, prometheus),
# fetches Go modules, vets, and runs every test with the race detector,
# including the guest-VM tests of the kernel's nbd driver.
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(
	libnbd-bin      # nbdinfo, nbdsh, nbdcopy
	python3-libnbd  # nbdsh needs the nbd Python module
	fio             # its nbd engine drives the server
	qemu-utils      # qemu-img, qemu-io, qemu-nbd
	nbdkit          # benchmark peer
	nbd-client
	nbd-server      # a remote host in the multi-host tests (cmd/nbdmapper/hosts_test.go)
	iproute2        # ip netns, veth: the multi-host tests' namespaces
	prometheus      # promtool and a real Prometheus server
	qemu-system-x86 # guest VM for the kernel nbd tests
	busybox-static
	e2fsprogs
	dmsetup
	util-linux      # blkdiscard
	cpio
	kmod            # depmod, for vmtest's initramfs
	systemd         # systemd-socket-activate, systemd-analyze (no systemd PID 1 needed)
	openssl         # certificates for the guest's nbd-client TLS test and the certificate matrix
	gnutls-bin      # certtool, for the certificate matrix (cmd/nbdmapper/certmatrix_test.go)
	lintian         # checks the Debian package (scripts/package.sh)
	go-md2man       # renders docs/man
	man-db          # man --warnings on the rendered pages
	groff-base
	zsh             # parses the zsh completion
	thin-provisioning-tools # thin_restore, thin_dump, thin_check: thin/metadata checks our reader against them
	ceph-mon        # a throwaway Ceph cluster for the rbd: device tests
	ceph-mgr
	ceph-osd
	ceph-common     # ceph, rbd, monmaptool
	librbd-dev      # go-ceph (cgo) for -tags ceph
	librados-dev
	gcc             # cgo, for go-ceph
	qemu-block-extra # qemu-nbd rbd:, bench/ceph.sh's peer
	socat           # the guest's bridge to the host's server (internal/testing/vmtest/guest/ceph.sh)
)
sudo=""
[ "$(id -u)" = 0 ] || sudo=sudo
missing=()
for p in "${packages[@]}"; do
	dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
	echo "scripts/test.sh: installing ${missing[*]}"
	$sudo apt-get update -q
	DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q --no-install-recommends "${missing[@]}"
fi
# vmtest downloads (never installs) the guest kernel package, so apt must
# know it; updating here keeps apt-get out of the tests.
if ! apt-cache show linux-image-amd64 >/dev/null 2>&1; then
	$sudo apt-get update -q
fi

go mod download
# go.mod and go.sum must be as `go mod tidy` leaves them.
if ! diff=$(go mod tidy -diff); then
	echo "scripts/test.sh: go mod tidy would change go.mod/go.sum:" >&2
	echo "$diff" >&2
	exit 1
fi
go vet ./...
go test -race -count=1 -timeout 60m ./...
# rbd: devices need cgo and librbd, so they build only with -tags ceph (and
# go-ceph's pacific for Debian 12's Ceph 16); TestServeCeph starts a cluster
# of its own (scripts/ceph-cluster.sh) and stops it at the end.
go vet -tags ceph,pacific ./rbd/ ./cmd/nbdmapper/ ./internal/testing/vmtest/
go test -race -count=1 -tags ceph,pacific ./rbd/
go test -race -count=1 -tags ceph,pacific -run Ceph ./cmd/nbdmapper/ ./internal/testing/vmtest/
# The race detector makes sync.Pool drop items at random, so allocation
# counts of pooled paths are checked without it (nbdtest.AllocsPerRun).
go test -count=1 -run Allocs ./...
