# Helpers for scripts that run inside the vmtest guest (internal/testing/vmtest/run.sh):
# tables over the scratch disk, serving and attaching with nbdmapper, and
# the kernel's per-device I/O counters. Sourced, not run.

disk=${VMTEST_DISK:-/dev/vda}
sock=/tmp/nbdmapper.sock
serve_pid="" attach_pid=""

say() { echo "vmtest-guest: $*"; }

# gen_table N DEV: a linear table of N equal segments over all of DEV,
# written to stdout. Segment i of the virtual device sits in slot
# (i*389) mod N of the disk, so neighbours on the virtual device are far
# apart on the disk and only sorting brings their discards back together:
#
#	virtual  [ 0 ][ 1 ][ 2 ][ 3 ] ...
#	disk     [ 0 ] ... [ 1 ] ... [ 2 ] ...   (slots 0, 389, 778, ...)
#
# 389 is odd, so for any power-of-two N the slots are a permutation.
gen_table() {
	local n=$1 dev=$2 total seg i
	total=$(blockdev --getsz "$dev")
	seg=$((total / n))
	for ((i = 0; i < n; i++)); do
		echo "$((i * seg)) $seg linear $dev $(((i * 389 % n) * seg))"
	done
}

# serve TABLE [serve flags...]: start nbdmapper serve with export "d".
serve() {
	local t=$1
	shift
	serve_set "$@" d="$t"
}

# serve_set [serve flags...] NAME=TABLE...: start nbdmapper serve with
# these exports.
serve_set() {
	rm -f "$sock"
	"$NBDMAPPER" serve --socket "$sock" "$@" >>/tmp/serve.log 2>&1 &
	serve_pid=$!
	local i
	for ((i = 0; i < 300; i++)); do
		[ -S "$sock" ] && return 0
		kill -0 "$serve_pid" 2>/dev/null || break
		sleep 0.1
	done
	say "nbdmapper serve did not start:"
	cat /tmp/serve.log
	return 1
}

# attach [DEV] [attach flags...]: attach export "d" (default /dev/nbd0).
attach() {
	local dev=${1:-/dev/nbd0}
	shift || true
	attach_export d "$dev" "$@"
}

# attach_export EXPORT DEV [attach flags...]: attach EXPORT as DEV.
attach_export() {
	local name=$1 dev=$2
	shift 2
	"$NBDMAPPER" attach --socket "$sock" --export "$name" "$@" "$dev" >>/tmp/attach.log 2>&1 &
	attach_pid=$!
	local i
	for ((i = 0; i < 300; i++)); do
		[ -e "/sys/block/$(basename "$dev")/pid" ] && return 0
		kill -0 "$attach_pid" 2>/dev/null || break
		sleep 0.1
	done
	say "nbdmapper attach did not attach $dev:"
	cat /tmp/attach.log
	return 1
}

# detach [DEV]: detach and wait for the attach process.
detach() {
	local dev=${1:-/dev/nbd0}
	"$NBDMAPPER" detach "$dev" || true
	[ -z "$attach_pid" ] || wait "$attach_pid" || true
	attach_pid=""
}

# unserve: stop the server; it logs its stats when it shuts down.
unserve() {
	[ -n "$serve_pid" ] || return 0
	kill -TERM "$serve_pid" 2>/dev/null || true
	wait "$serve_pid" || true
	serve_pid=""
}

# blkstat DEV FIELD: one counter of /sys/block/DEV/stat
# (5 write I/Os, 12 discard I/Os, 16 flush I/Os).
blkstat() {
	awk -v f="$2" '{print $f}' "/sys/block/$(basename "$1")/stat"
}

# dmcreate NAME TABLE: dmsetup create, then the /dev/mapper node, which
# dmsetup leaves to udev and the guest has no udev.
dmcreate() {
	dmsetup create "$1" --table "$2" && dmsetup mknodes "$1" && [ -b "/dev/mapper/$1" ]
}
