# Runs inside the vmtest guest (see bench/vm.sh): fio 4k randwrite with
# fdatasync=1 (ioengine sync, 2 jobs) on nbdmapper's /dev/nbd0 and on the
# kernel's dm-linear, each over 1 and 1024 segments of the same virtio disk.
# Prints one "VMBENCH <case> <IOPS> <KiB/s> <fdatasyncs> <disk flushes>"
# line per case: fdatasyncs is fio's write count (one fdatasync after each
# write), disk flushes the flush requests /dev/vda completed meanwhile (the
# block layer merges flushes that are pending together, so dm's 1024
# per-target flushes show up as fewer).
#
#   vm-guest.sh RUNTIME_S REPS [CASE...]
#
# With REPS > 1 the cases run in REPS interleaved rounds, so that a slow
# spell of the (shared) host hits every case alike.
set -uo pipefail
. "$(dirname "$(realpath "$0")")/lib.sh" # run.sh puts it beside this script
runtime=${1:-20}
reps=${2:-1}
shift 2 || shift $#
cases=(nbdmapper-1 nbdmapper-1024 dm-1 dm-1024 nbdmapper-1024-per-segment)
[ $# -gt 0 ] && cases=("$@")

# run_fio CASE DEV: one fio run; prints the VMBENCH line.
run_fio() {
	local name=$1 dev=$2 d0 line iops bw kib
	d0=$(blkstat "$disk" 16)
	fio --name=vmbench --filename="$dev" --ioengine=sync --rw=randwrite --bs=4k \
		--fdatasync=1 --numjobs=2 --group_reporting --time_based --runtime="$runtime" \
		--output-format=terse --terse-version=3 --output=/tmp/fio-$name.terse \
		>/dev/null || { cat /tmp/fio-$name.terse; return 1; }
	# terse v3: field 47 write KiB, 48 write KiB/s, 49 write IOPS
	line=$(grep -v '^fio:' /tmp/fio-$name.terse | tail -1)
	kib=$(echo "$line" | cut -d';' -f47)
	bw=$(echo "$line" | cut -d';' -f48)
	iops=$(echo "$line" | cut -d';' -f49)
	echo "VMBENCH $name $iops $bw $((kib / 4)) $(($(blkstat "$disk" 16) - d0))"
}

rounds=()
for ((r = 0; r < reps; r++)); do rounds+=("${cases[@]}"); done
for c in "${rounds[@]}"; do
	segs=${c#*-}
	segs=${segs%%-*}
	gen_table "$segs" "$disk" >/tmp/bench.table
	case $c in
	nbdmapper-*)
		flags=()
		[[ $c == *per-segment ]] && flags=(--flush-baseline per-segment)
		serve /tmp/bench.table "${flags[@]}" && attach || exit 1
		run_fio "$c" /dev/nbd0
		detach
		unserve
		grep '"flush stats"' /tmp/serve.log | tail -1
		;;
	dm-*)
		dmcreate vmbench "$(cat /tmp/bench.table)" || exit 1
		run_fio "$c" "$(realpath /dev/mapper/vmbench)"
		dmsetup remove vmbench
		;;
	esac
done
