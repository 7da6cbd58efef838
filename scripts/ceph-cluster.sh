#!/usr/bin/env bash
# A throwaway single-node Ceph cluster for tests and benchmarks: one mon, one
# mgr and one BlueStore OSD on a sparse file, everything under DIR and bound
# to 127.0.0.1 on ports PORT to PORT+20, no systemd, cephx only if asked.
#
#   scripts/ceph-cluster.sh start DIR PORT [cephx]
#                                            prints DIR/ceph.conf once a pool
#                                            "rbd" takes images; with cephx,
#                                            auth is required and DIR/keyring
#                                            (named in the conf) holds every
#                                            daemon's key and client.admin's
#   scripts/ceph-cluster.sh stop DIR         stops the daemons by PID
#   scripts/ceph-cluster.sh kill-osd DIR     kills the OSD with SIGKILL
#   scripts/ceph-cluster.sh start-osd DIR    starts it again
#
# The daemons run in the foreground (-f) in the background of this script;
# their PIDs are in DIR/pids and their logs in DIR/log. Debian 12's ceph-mon,
# ceph-mgr, ceph-osd and ceph-common are all it needs. The OSD's memory is
# capped near Ceph's lowest `osd memory target` (896 MiB).
set -euo pipefail

die() {
	echo "ceph-cluster.sh: $*" >&2
	exit 1
}

stop() {
	local dir=$1 pid
	[ -f "$dir/pids" ] || return 0
	while read -r pid; do
		kill -TERM "$pid" 2>/dev/null || true
	done <"$dir/pids"
	for _ in $(seq 100); do
		local alive=0
		while read -r pid; do
			kill -0 "$pid" 2>/dev/null && alive=1
		done <"$dir/pids"
		((alive)) || break
		sleep 0.1
	done
	while read -r pid; do
		kill -KILL "$pid" 2>/dev/null || true
	done <"$dir/pids"
	rm -f "$dir/pids"
}

# daemon NAME ARGS...: starts a Ceph daemon in the foreground, in the
# background, and records its PID.
daemon() {
	local name=$1
	shift
	"$@" -c "$conf" -f >>"$dir/log/$name.out" 2>&1 &
	echo $! >>"$dir/pids"
}

# until_ok WHAT CMD...: retries CMD for up to 60 s.
until_ok() {
	local what=$1
	shift
	for _ in $(seq 600); do
		if "$@" >/dev/null 2>&1; then
			return 0
		fi
		sleep 0.1
	done
	die "timed out waiting for $what (logs in $dir/log)"
}

start() {
	dir=$1
	local port=$2 auth=${3:-none}
	mkdir -p "$dir"/{log,run,mon.a,mgr.x,osd.0}
	dir=$(cd "$dir" && pwd)
	conf=$dir/ceph.conf
	local fsid
	fsid=$(cat /proc/sys/kernel/random/uuid)
	cat >"$conf" <<-EOF
		[global]
		fsid = $fsid
		mon host = v2:127.0.0.1:$port
		public network = 127.0.0.0/8
		ms bind msgr1 = false
		ms bind port min = $((port + 1))
		ms bind port max = $((port + 20))
		auth cluster required = $auth
		auth service required = $auth
		auth client required = $auth
		keyring = $dir/keyring
		run dir = $dir/run
		admin socket = $dir/run/\$name.asok
		log file = $dir/log/\$name.log
		pid file = $dir/run/\$name.pid
		mon data = $dir/mon.\$id
		mgr data = $dir/mgr.\$id
		osd data = $dir/osd.\$id
		mon allow pool size one = true
		mon allow pool delete = true
		mon warn on pool no redundancy = false
		mon warn on insecure global id reclaim allowed = false
		mon data avail warn = 1
		mon data avail crit = 0
		paxos propose interval = 0.1
		osd pool default size = 1
		osd pool default min size = 1
		osd pool default pg num = 8
		osd pool default pgp num = 8
		osd crush chooseleaf type = 0
		osd objectstore = bluestore
		osd memory target = 939524096
		osd op num shards = 2
		bluestore block create = true
		bluestore block size = 4294967296
		bluestore fsck on mkfs = false
		bluestore cache autotune = true
	EOF
	: >"$dir/pids"

	monmaptool --create --fsid "$fsid" --addv a "[v2:127.0.0.1:$port]" "$dir/monmap" >/dev/null
	# The mon's mkfs takes in every key of the keyring.
	local kr=$dir/keyring
	ceph-authtool --create-keyring "$kr" --gen-key -n mon. --cap mon 'allow *' >/dev/null
	ceph-authtool "$kr" --gen-key -n client.admin --cap mon 'allow *' --cap osd 'allow *' --cap mgr 'allow *' >/dev/null
	ceph-authtool "$kr" --gen-key -n mgr.x --cap mon 'allow profile mgr' --cap osd 'allow *' >/dev/null
	ceph-authtool "$kr" --gen-key -n osd.0 --cap mon 'allow profile osd' --cap mgr 'allow profile osd' --cap osd 'allow *' >/dev/null
	ceph-mon -c "$conf" -i a --mkfs --monmap "$dir/monmap" --keyring "$kr" >"$dir/log/mon.mkfs.out" 2>&1 ||
		die "ceph-mon --mkfs failed: $(cat "$dir/log/mon.mkfs.out")"
	daemon mon.a ceph-mon -i a
	until_ok "the mon" ceph -c "$conf" --connect-timeout 5 mon stat

	daemon mgr.x ceph-mgr -i x
	local uuid
	uuid=$(cat /proc/sys/kernel/random/uuid)
	local id
	id=$(ceph -c "$conf" osd new "$uuid")
	[ "$id" = 0 ] || die "osd new gave id $id, want 0"
	ceph-osd -c "$conf" -i 0 --mkfs --osd-uuid "$uuid" >"$dir/log/osd.mkfs.out" 2>&1 ||
		die "ceph-osd --mkfs failed: $(tail -20 "$dir/log/osd.mkfs.out")"
	daemon osd.0 ceph-osd -i 0
	until_ok "the osd to come up" sh -c "ceph -c '$conf' osd stat | grep -q '1 up'"

	ceph -c "$conf" osd pool create rbd 8 >/dev/null 2>&1
	ceph -c "$conf" osd pool application enable rbd rbd >/dev/null 2>&1
	until_ok "the pool to take images" rbd -c "$conf" create --size 1M rbd/probe
	rbd -c "$conf" rm rbd/probe >/dev/null 2>&1
	echo "$conf"
}

# osd_pid DIR: the running OSD's PID, from the daemons' list.
osd_pid() {
	local pid
	while read -r pid; do
		if grep -q "^ceph-osd" "/proc/$pid/cmdline" 2>/dev/null; then
			echo "$pid"
		fi
	done <"$1/pids"
}

case "${1:-}" in
start)
	[ $# = 3 ] || [ $# = 4 ] || die "usage: $0 start DIR PORT [cephx]"
	# A start that fails stops what it started.
	trap 'stop "$2"' EXIT
	start "$2" "$3" "${4:-none}"
	trap - EXIT
	;;
stop)
	[ $# = 2 ] || die "usage: $0 stop DIR"
	stop "$2"
	;;
kill-osd)
	[ $# = 2 ] || die "usage: $0 kill-osd DIR"
	pid=$(osd_pid "$2")
	[ -n "$pid" ] || die "no OSD running in $2"
	kill -KILL "$pid"
	while kill -0 "$pid" 2>/dev/null; do sleep 0.05; done
	;;
start-osd)
	[ $# = 2 ] || die "usage: $0 start-osd DIR"
	dir=$(cd "$2" && pwd)
	conf=$dir/ceph.conf
	[ -z "$(osd_pid "$dir")" ] || die "the OSD in $dir runs already"
	daemon osd.0 ceph-osd -i 0
	# The monitor may still list the killed OSD as up: ask the new one.
	until_ok "the osd to come back" sh -c "ceph -c '$conf' --admin-daemon '$dir/run/osd.0.asok' status | grep -q '\"state\": \"active\"'"
	# and its placement groups to serve I/O again.
	until_ok "the pool to take images" rbd -c "$conf" create --size 1M rbd/probe
	rbd -c "$conf" rm rbd/probe >/dev/null 2>&1
	;;
*) die "usage: $0 start DIR PORT [cephx] | stop DIR | kill-osd DIR | start-osd DIR" ;;
esac
