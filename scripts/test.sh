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
	prometheus      # promtool and a real Prometheus server
	qemu-system-x86 # guest VM for the kernel nbd tests
	busybox-static
	e2fsprogs
	dmsetup
	util-linux      # blkdiscard
	cpio
	openssl         # certificates for the guest's nbd-client TLS test
)
missing=()
for p in "${packages[@]}"; do
	dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
	sudo=""
	[ "$(id -u)" = 0 ] || sudo=sudo
	echo "scripts/test.sh: installing ${missing[*]}"
	$sudo apt-get update -q
	DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

go mod download
go vet ./...
go test -race -count=1 -timeout 60m ./...
