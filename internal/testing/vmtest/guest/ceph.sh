# ext4 on the kernel's nbd driver over a table of Ceph RBD images, run by
# internal/testing/vmtest/run.sh -s for TestGuestCeph (internal/testing/vmtest/ceph_test.go). The cluster and
# the nbdmapper serving the table run on the host; the guest reaches that
# server through the virtio-serial port "host", bridged to a unix socket
# by socat. nbd-client attaches export d once (the port carries one
# connection), makes and mounts ext4, writes a file, and checks it again
# after an unmount, an fsck and a remount. The host then reads the
# filesystem back out of the images.
set -u
. "$(dirname "$0")/lib.sh"

result() { echo "VMTEST-RESULT $1 $2 ${*:3}"; }

run() {
	local port="" p
	for p in /sys/class/virtio-ports/*; do
		[ "$(cat "$p/name" 2>/dev/null)" = host ] && port=/dev/$(basename "$p")
	done
	[ -n "$port" ] || { say "no virtio-serial port named host"; return 1; }
	socat UNIX-LISTEN:/tmp/host.sock GOPEN:"$port" &
	local i
	for ((i = 0; i < 100; i++)); do
		[ -S /tmp/host.sock ] && break
		sleep 0.1
	done
	nbd-client -unix /tmp/host.sock /dev/nbd0 -N d -b 4096 || return 1
	mkfs.ext4 -q -F /dev/nbd0 || return 1
	mkdir -p /tmp/mnt
	mount /dev/nbd0 /tmp/mnt || return 1
	head -c 5000000 /dev/urandom >/tmp/mnt/f
	(cd /tmp/mnt && sha256sum f) >/tmp/sum
	umount /tmp/mnt || return 1
	e2fsck -fn /dev/nbd0 >/tmp/fsck.log 2>&1 || {
		cat /tmp/fsck.log
		say "e2fsck over the RBD table found errors"
		return 1
	}
	mount /dev/nbd0 /tmp/mnt || return 1
	(cd /tmp/mnt && sha256sum --quiet -c /tmp/sum) || return 1
	umount /tmp/mnt || return 1
	nbd-client -d /dev/nbd0 || return 1
	echo "VMTEST-SUM $(cut -c1-64 /tmp/sum)"
}

if run >/tmp/test.log 2>&1; then
	cat /tmp/test.log
	result ceph_ext4 PASS
else
	cat /tmp/test.log
	result ceph_ext4 FAIL "$(tail -3 /tmp/test.log | tr '\n' ' ')"
	exit 1
fi
