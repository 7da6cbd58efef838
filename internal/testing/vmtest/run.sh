#!/usr/bin/env bash
# internal/testing/vmtest/run.sh boots a throw-away Linux guest under QEMU and runs one script
# in it, so that nbdmapper can be tested through the real kernel nbd driver,
# dm-linear and ext4, which the host kernel may not have.
#
#   internal/testing/vmtest/run.sh [-o OUTDIR] [-d DISK_MiB] [-m MEM_MiB] [-t TIMEOUT_S] [-k] [-s SOCKET] SCRIPT [ARGS...]
#
# The guest:
#   - runs Debian's linux-image-amd64 (downloaded with apt-get download and
#     unpacked into internal/testing/vmtest/cache, never installed on the host) under TCG;
#     nested KVM hangs at boot on the machines this was written for;
#   - boots a busybox initramfs that loads virtio, 9p, nbd, dm-mod,
#     dm-snapshot and ext4 (with their dependencies), mounts the host's root
#     read-only over virtio-9p and chroots into it, so the host's fio,
#     nbd-client, dmsetup and mkfs are the guest's;
#   - has a scratch raw disk OUTDIR/disk.img (DISK_MiB, default 256) on
#     virtio-blk with cache=writeback, so guest flushes reach the host as
#     fdatasync: it is /dev/vda in the guest; -k keeps the one a previous
#     run left in OUTDIR (a boot after a power cut);
#   - has OUTDIR shared read-write at /tmp/vmout ($VMOUT), with the freshly
#     built nbdmapper (or a copy of $NBDMAPPER_BIN) at $VMOUT/nbdmapper
#     ($NBDMAPPER);
#   - has no network; /tmp, /run and /var/tmp are tmpfs;
#   - with -s, has one stream to the host's unix socket SOCKET (a server
#     there, listening before the boot): the virtio-serial port named
#     "host" (/sys/class/virtio-ports/*/name), the guest's only way out.
# QEMU's pid is in OUTDIR/qemu.pid while it runs (power cuts kill it). The
# kernel's own log goes to OUTDIR/kernel.log, not to the console. A boot that
# hangs before /init runs is tried again (see the watchdog below).
# SCRIPT (a host path) runs under bash in the guest with ARGS, cwd $VMOUT.
# Its exit status becomes run.sh's, and is printed as a marker line
#   VMTEST-EXIT <status>
# on the console, which run.sh copies to stdout and OUTDIR/console.log.
#
# Exit 77 means QEMU could not be run at all (callers skip on it).
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../../.." && pwd)
cache=${VMTEST_CACHE:-$here/cache}
out="" disk_mb=256 mem_mb=2048 timeout_s=1200 keep_disk=0 host_sock=""
while getopts "o:d:m:t:ks:" opt; do
	case $opt in
	o) out=$OPTARG ;;
	d) disk_mb=$OPTARG ;;
	m) mem_mb=$OPTARG ;;
	t) timeout_s=$OPTARG ;;
	k) keep_disk=1 ;;
	s) host_sock=$(realpath "$OPTARG") ;;
	*) exit 2 ;;
	esac
done
shift $((OPTIND - 1))
if [ $# -lt 1 ]; then
	sed -n '2,/^set -e/p' "$0" | sed 's/^# \{0,1\}//;/^set -e/d' >&2
	exit 2
fi
script=$(realpath "$1")
shift
[ -n "$out" ] || out=$(mktemp -d /tmp/vmtest.XXXXXX)
mkdir -p "$out" "$cache"
out=$(realpath "$out")

log() { echo "vmtest: $*" >&2; }

# need checks that commands are installed and names the Debian packages of
# those that are not. It installs nothing: scripts/test.sh installs every
# package the suite needs, and a test that ran apt-get could fail on
# another apt-get's lock.
need() {
	local missing=() cmd pkg
	for spec in "$@"; do
		cmd=${spec%%:*} pkg=${spec#*:}
		command -v "$cmd" >/dev/null 2>&1 || [ -x "$cmd" ] || missing+=("$pkg")
	done
	((${#missing[@]})) || return 0
	log "missing packages ${missing[*]} (scripts/test.sh installs them)"
	return 1
}

need depmod:kmod /bin/busybox:busybox-static fio:fio nbd-client:nbd-client \
	dmsetup:dmsetup mkfs.ext4:e2fsprogs blkdiscard:util-linux || true
if ! need qemu-system-x86_64:qemu-system-x86; then
	echo "VMTEST-SKIP qemu-system-x86_64 is not available" >&2
	exit 77
fi

# kernel: the newest linux-image-<version>-amd64 that linux-image-amd64 pulls in.
kdir=$cache/kernel
if [ ! -f "$kdir/ok" ]; then
	pkg=$(apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-/{print $2; exit}')
	if [ -z "$pkg" ]; then
		apt-get update -q >&2
		pkg=$(apt-cache depends linux-image-amd64 | awk '/Depends: linux-image-/{print $2; exit}')
	fi
	log "fetching kernel package $pkg"
	rm -rf "$kdir" "$cache"/linux-image-*.deb
	(cd "$cache" && apt-get download -q -o APT::Sandbox::User=root "$pkg" >&2)
	mkdir -p "$kdir"
	dpkg-deb -x "$cache"/linux-image-*.deb "$kdir"
	rm -f "$cache"/linux-image-*.deb
	touch "$kdir/ok"
fi
kver=$(ls "$kdir/lib/modules" | head -1)
vmlinuz=$kdir/boot/vmlinuz-$kver

# initramfs: busybox, the modules below with their dependencies, /init.
modules=(virtio_pci virtio_blk virtio_console 9pnet_virtio 9p crc32c_generic crc32c-intel ext4 nbd dm-mod dm-snapshot dm-zero)
initrd=$cache/initramfs-$kver.cpio.gz
stamp=$(cat "$here/guest/init" "$0" | sha256sum | cut -c1-16)
if [ ! -f "$initrd" ] || [ "$(cat "$initrd.stamp" 2>/dev/null)" != "$stamp" ]; then
	log "building initramfs for $kver"
	[ -f "$kdir/lib/modules/$kver/modules.dep" ] || depmod -b "$kdir" "$kver"
	stage=$(mktemp -d "$cache/stage.XXXXXX")
	mkdir -p "$stage"/{bin,dev,proc,sys,newroot,lib/modules/$kver}
	cp /bin/busybox "$stage/bin/busybox"
	ln -s busybox "$stage/bin/sh"
	mdir=$kdir/lib/modules/$kver
	: >"$stage/load-order"
	declare -A seen=()
	# add appends a module's dependencies, then the module, to load-order.
	add() {
		local rel deps d
		rel=$(find "$mdir/kernel" -name "$1.ko*" -printf '%P\n' | head -1)
		[ -n "$rel" ] || rel=$(find "$mdir/kernel" -name "$(echo "$1" | tr _- -_).ko*" -printf '%P\n' | head -1)
		[ -n "$rel" ] || { grep -q "/$1.ko" "$mdir/modules.builtin" || log "no module $1"; return 0; }
		rel=kernel/$rel
		[ -z "${seen[$rel]:-}" ] || return 0
		seen[$rel]=1
		deps=$(awk -v m="$rel:" '$1 == m {$1=""; print}' "$mdir/modules.dep")
		for d in $deps; do add "$(basename "${d%%.ko*}")"; done
		mkdir -p "$stage/lib/modules/$kver/$(dirname "$rel")"
		cp "$mdir/$rel" "$stage/lib/modules/$kver/$rel"
		echo "$rel" >>"$stage/load-order"
	}
	for m in "${modules[@]}"; do add "$m"; done
	cp "$mdir"/modules.{order,builtin,builtin.modinfo} "$stage/lib/modules/$kver/"
	depmod -b "$stage" "$kver"
	cp "$here/guest/init" "$stage/init"
	chmod +x "$stage/init"
	(cd "$stage" && find . -mindepth 1 | busybox cpio -o -H newc 2>/dev/null | gzip -1) >"$initrd.tmp"
	mv "$initrd.tmp" "$initrd"
	echo "$stamp" >"$initrd.stamp"
	rm -rf "$stage"
fi

# the binary under test: $NBDMAPPER_BIN, or built from this checkout.
if [ -n "${NBDMAPPER_BIN:-}" ]; then
	cp "$NBDMAPPER_BIN" "$out/nbdmapper"
elif command -v go >/dev/null && [ -d "$repo/cmd/nbdmapper" ]; then
	if ! (cd "$repo" && CGO_ENABLED=0 go build -o "$out/nbdmapper" ./cmd/nbdmapper) >&2; then
		log "go build ./cmd/nbdmapper failed; the guest gets no nbdmapper"
		rm -f "$out/nbdmapper"
	fi
fi

if [ "$keep_disk" = 0 ] || [ ! -f "$out/disk.img" ]; then
	rm -f "$out/disk.img"
	truncate -s "${disk_mb}M" "$out/disk.img"
fi
# The guest's /tmp, /run and /var/tmp are its own, and the checkout may live
# there (CI clones into a temporary folder): always bring the script along,
# with the guest library beside it, in the shared folder.
mkdir -p "$out/guest"
cp "$here/guest/lib.sh" "$out/guest/lib.sh"
cp "$script" "$out/guest/$(basename "$script")"
script=/tmp/vmout/guest/$(basename "$script")
{
	printf 'export VMOUT=/tmp/vmout NBDMAPPER=/tmp/vmout/nbdmapper VMTEST_REPO=%q\n' "$repo"
	printf 'export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin\n'
	printf 'cd /tmp/vmout\n'
	printf 'exec bash %q' "$script"
	for a in "$@"; do printf ' %q' "$a"; done
	printf '\n'
} >"$out/job.sh"

host_port=()
[ -z "$host_sock" ] || host_port=(-device virtio-serial-pci -chardev socket,id=host,path="$host_sock"
	-device virtserialport,chardev=host,name=host)

cpus=$(nproc)
[ "$cpus" -le 2 ] || cpus=2

# boot runs QEMU once, its console (the guest's ttyS0) to stdout and
# OUTDIR/console.log, the kernel's log (ttyS1) to OUTDIR/kernel.log. It
# returns QEMU's exit status, or 124 for the overall timeout.
#
# cryptomgr.notests: the kernel's crypto self-tests add nothing here, and
# under TCG one of them once spun on a vCPU until the guest's timeout (a soft
# lockup in cryptomgr_test for the whole 1200 s of a CI run).
boot() {
	local hang=""
	[ "$1" -gt "${VMTEST_HANG_BOOTS:-0}" ] || hang=" vmtest.hang=1"
	rm -f "$out/qemu.pid"
	timeout --foreground -k 10 "$timeout_s" qemu-system-x86_64 \
		-nodefaults -no-user-config -no-reboot -display none -pidfile "$out/qemu.pid" \
		-accel tcg,thread=multi -cpu max -smp "$cpus" -m "$mem_mb" \
		-kernel "$vmlinuz" -initrd "$initrd" \
		-append "console=ttyS1 loglevel=7 panic=-1 random.trust_cpu=on cryptomgr.notests$hang" \
		-serial stdio -serial file:"$out/kernel.log" \
		-virtfs local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap \
		-virtfs local,path="$out",mount_tag=vmout,security_model=none,multidevs=remap \
		-drive file="$out/disk.img",if=virtio,format=raw,cache=writeback,discard=unmap \
		"${host_port[@]}" </dev/null 2>&1 | tee "$out/console.log"
	return "${PIPESTATUS[0]}"
}

# A guest under TCG on a loaded host has, rarely, hung before its /init
# printed its first line: nothing on the console until the timeout.
# Nothing of the job has run then and the disk is untouched, so the boot
# is tried again. The watchdog waits boot_limit seconds (default
# 240; a boot takes 5-15 s) for init's VMTEST-BOOTED line; VMTEST_HANG_BOOTS=N
# makes the first N boots' init hang at that point, to test it.
boot_limit=${VMTEST_BOOT_LIMIT:-240} boots=3
for attempt in $(seq "$boots"); do
	log "booting $kver (TCG, $cpus vCPUs, ${mem_mb} MiB), console in $out/console.log, kernel log in $out/kernel.log"
	start=$(date +%s)
	: >"$out/console.log"
	: >"$out/kernel.log"
	boot "$attempt" &
	guest=$!
	booted=0
	for ((waited = 0; waited < boot_limit; waited++)); do
		if grep -q '^VMTEST-BOOTED' "$out/console.log"; then
			booted=1
			break
		fi
		kill -0 "$guest" 2>/dev/null || break
		sleep 1
	done
	if [ "$booted" = 1 ] || ! kill -0 "$guest" 2>/dev/null || [ "$attempt" = "$boots" ]; then
		set +e
		wait "$guest"
		qrc=$?
		set -e
		break
	fi
	log "boot $attempt of $boots: no VMTEST-BOOTED in ${boot_limit} s; the kernel's log ends:"
	tail -n 5 "$out/kernel.log" | sed 's/^/vmtest:   /' >&2 || true
	cp "$out/kernel.log" "$out/kernel.hung$attempt.log"
	pid=$(cat "$out/qemu.pid" 2>/dev/null || true)
	[ -z "$pid" ] || kill -KILL "$pid" 2>/dev/null || true
	{ wait "$guest"; } 2>/dev/null || true
done
log "guest ran $(($(date +%s) - start)) s, qemu exit $qrc"
rc=$(sed -n 's/^VMTEST-EXIT \([0-9]*\).*/\1/p' "$out/console.log" | tail -1)
if [ -z "$rc" ]; then
	if [ ! -s "$out/console.log" ] && [ ! -s "$out/kernel.log" ]; then
		echo "VMTEST-SKIP qemu-system-x86_64 could not run (exit $qrc, no console output)" >&2
		exit 77
	fi
	log "guest gave no exit status (qemu exit $qrc); the kernel's log ends:"
	tail -n 20 "$out/kernel.log" | sed 's/^/vmtest:   /' >&2 || true
	exit 1
fi
exit "$rc"
