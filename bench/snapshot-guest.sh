# Runs inside the vmtest guest (see bench/snapshot.sh): 4k random first
# writes on a snapshot, with 16 writers (ioengine psync, numjobs 16) and
# with 32 in flight (libaio, iodepth 32), fsync after every write, direct
# I/O, each against its base device on the same workload:
#
#   dm-*         the guest kernel's dm-linear (base) and dm-snapshot
#                (snapshot <origin> <cow> P 8) on /dev/mapper
#   nbdmapper-*  nbdmapper serving the same linear table and the same
#                snapshot, attached as /dev/nbd0 (4 connections)
#
# The origin is the first GiB of /dev/vda, the COW the second (a fresh
# store for every snapshot case). Prints one line per case and round,
#   SNAPBENCH <case> <IOPS> <KiB/s> <writes> <disk flushes>
# where disk flushes are the flushes /dev/vda completed during the run.
# With REPS > 1 the cases run in REPS interleaved rounds.
#
#   snapshot-guest.sh RUNTIME_S [REPS]
set -uo pipefail
. "$(dirname "$(realpath "$0")")/lib.sh" # run.sh puts it beside this script
runtime=${1:-20}
reps=${2:-1}
gib=2097152 # sectors
ip link set lo up 2>/dev/null

dmcreate borig "0 $gib linear $disk 0" || exit 1
dmcreate bcow "0 $gib linear $disk $gib" || exit 1
devnum() { dmsetup info -c --noheadings -o major,minor --separator : "$1" | tr -d ' '; }
o=$(devnum borig) c=$(devnum bcow)
echo "0 $gib linear $o 0" >/tmp/base.table
echo "0 $gib snapshot $o $c P 8" >/tmp/snap.table
fresh_cow() { dd if=/dev/zero of=/dev/mapper/bcow bs=1M count=1 oflag=direct status=none; }

# run_fio CASE DEV MODE: one fio run; prints the SNAPBENCH line.
run_fio() {
	local name=$1 dev=$2 mode=$3 d0 line args
	case $mode in
	jobs16) args=(--ioengine=psync --numjobs=16) ;;
	depth32) args=(--ioengine=libaio --iodepth=32) ;;
	esac
	d0=$(blkstat "$disk" 16)
	fio --name=snapbench --filename="$dev" "${args[@]}" --rw=randwrite --bs=4k --direct=1 --fsync=1 \
		--randrepeat=0 --group_reporting --time_based --runtime="$runtime" \
		--output-format=terse --terse-version=3 --output=/tmp/fio-$name.terse >/dev/null ||
		{ cat /tmp/fio-$name.terse; return 1; }
	# terse v3: field 47 write KiB, 48 write KiB/s, 49 write IOPS
	line=$(grep -v '^fio:' /tmp/fio-$name.terse | tail -1)
	echo "SNAPBENCH $name $(echo "$line" | cut -d';' -f49) $(echo "$line" | cut -d';' -f48)" \
		"$(($(echo "$line" | cut -d';' -f47) / 4)) $(($(blkstat "$disk" 16) - d0))"
}

for ((rep = 0; rep < reps; rep++)); do for mode in jobs16 depth32; do
	run_fio "dm-base-$mode" /dev/mapper/borig "$mode"
	fresh_cow
	dmcreate ksnap "0 $gib snapshot /dev/mapper/borig /dev/mapper/bcow P 8" || exit 1
	run_fio "dm-snap-first-$mode" /dev/mapper/ksnap "$mode"
	dmsetup status ksnap
	dmsetup remove ksnap

	serve_set base=/tmp/base.table || exit 1
	attach_export base /dev/nbd0 --connections 4 || exit 1
	run_fio "nbdmapper-base-$mode" /dev/nbd0 "$mode"
	detach
	unserve
	fresh_cow
	serve_set snap=/tmp/snap.table || exit 1
	attach_export snap /dev/nbd0 --connections 4 || exit 1
	run_fio "nbdmapper-snap-first-$mode" /dev/nbd0 "$mode"
	"$NBDMAPPER" status | grep '^snap:'
	detach
	unserve
	grep '"snapshot stats"' /tmp/serve.log | tail -1
done; done
dmsetup remove borig
dmsetup remove bcow
