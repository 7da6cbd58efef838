# Power cuts through the real kernel, run by internal/testing/vmtest/run.sh for
# TestPowerCut (internal/testing/vmtest/powercut_test.go) and bench/powercut.sh.
#
#   powercut.sh [verify EPOCH RAW FS] [write EPOCH]
#
# verify checks what the boot that was cut left on the disk image; write
# then starts writing (a new epoch) until the host cuts this boot too, so
# that N cuts take N+1 boots.
#
# nbdmapper serves two exports over /dev/vda, each a table of 16 linear
# segments scattered over one half of the disk:
#
#	raw -> /dev/nbd0   records of 4 KiB: "PCUT", le64 seq, sha256 of the
#	                   rest, payload (from epoch and seq); written in
#	                   order, fdatasync'd after a random 1..8 of them, then
#	                   "POWERCUT-ACK raw <seq>"
#	fs  -> /dev/nbd1   a fresh ext4; file f<seq> (a record, repeated),
#	                   fsync'd with its directory, then "POWERCUT-ACK fs <seq>"
#
# The host SIGKILLs QEMU while they run. The guest's dirty-page expiry is
# raised and periodic writeback is off, so a write nbdmapper did not
# fdatasync to /dev/vda stays in the guest's page cache and dies with QEMU.
# QEMU's own writes (cache=writeback) are in the host's page cache, which a
# SIGKILL keeps.
#
# verify serves the same tables, replays ext4's journal by mounting, runs
# e2fsck -fn, and checks raw records 0..RAW and files f0..fFS of EPOCH:
#	VMTEST-RESULT powercut_raw|powercut_fs PASS|FAIL <detail>
#	VMTEST-METRIC powercut_<name>=<value>
set -uo pipefail
here=$(dirname "$(realpath "$0")")
. "$here/lib.sh"

result() { echo "VMTEST-RESULT $1 $2 ${*:3}"; }
metric() { echo "VMTEST-METRIC powercut_$1=$2"; }

# half_table HALF: 16 linear segments over half HALF (0 or 1) of the disk,
# segment i in slot (i*5) mod 16 of that half.
half_table() {
	local total half seg i
	total=$(blockdev --getsz "$disk")
	half=$((total / 2))
	seg=$((half / 16 / 8 * 8))
	for ((i = 0; i < 16; i++)); do
		echo "$((i * seg)) $seg linear $disk $(($1 * half + (i * 5 % 16) * seg))"
	done
}

start() {
	half_table 0 >/tmp/raw.table
	half_table 1 >/tmp/fs.table
	serve_set --metrics=off raw=/tmp/raw.table fs=/tmp/fs.table &&
		attach_export raw /dev/nbd0 && attach_export fs /dev/nbd1
}

cat >/tmp/powercut.py <<'EOF'
import hashlib, os, random, struct, sys

BS = 4096

EPOCH = int(os.environ["EPOCH"])

def record(seq):
    payload = random.Random(EPOCH << 32 | seq).randbytes(BS - 44)
    body = struct.pack("<Q", seq) + payload
    return b"PCUT" + struct.pack("<Q", seq) + hashlib.sha256(body).digest() + payload

def ack(kind, seq):
    print("POWERCUT-ACK %s %d" % (kind, seq), flush=True)

def write_raw(dev):
    fd = os.open(dev, os.O_RDWR)
    rng = random.Random()
    seq, n = 0, rng.randint(1, 8)
    while True:
        os.pwrite(fd, record(seq), seq * BS)
        n -= 1
        if n == 0:
            os.fdatasync(fd)  # NBD_CMD_FLUSH: nbdmapper fdatasyncs /dev/vda
            ack("raw", seq)
            n = rng.randint(1, 8)
        seq += 1

def write_fs(mnt):
    d = os.open(mnt, os.O_RDONLY)
    seq = 0
    while True:
        name = os.path.join(mnt, "f%d" % seq)
        with open(name, "wb") as f:
            f.write(record(seq) * (1 + seq % 4))
            f.flush()
            os.fsync(f.fileno())
        os.fsync(d)
        ack("fs", seq)
        seq += 1

def verify(intact, acked):
    """Counts seq 0..acked that are not intact, then goes on past acked
    while they are: (bad, first bad, last seq checked)."""
    bad, first_bad, seq = 0, -1, 0
    while True:
        ok = intact(seq)
        if not ok and seq > acked:
            break
        if not ok:
            bad += 1
            first_bad = first_bad if first_bad >= 0 else seq
        seq += 1
    return bad, first_bad, seq - 1

def raw_intact(dev):
    fd = os.open(dev, os.O_RDONLY)
    return lambda seq: os.pread(fd, BS, seq * BS) == record(seq)

def fs_intact(mnt):
    def intact(seq):
        try:
            with open(os.path.join(mnt, "f%d" % seq), "rb") as f:
                return f.read() == record(seq) * (1 + seq % 4)
        except OSError:
            return False
    return intact

if __name__ == "__main__":
    cmd = sys.argv[1]
    if cmd == "write-raw":
        write_raw(sys.argv[2])
    elif cmd == "write-fs":
        write_fs(sys.argv[2])
    else:
        intact = raw_intact if cmd == "verify-raw" else fs_intact
        bad, first_bad, last = verify(intact(sys.argv[2]), int(sys.argv[3]))
        print("%d %d %d" % (bad, first_bad, last))
EOF

# Keep dirty pages in the guest until something syncs them: an hour before
# they expire, no periodic writeback, no background writeback below 80%.
echo 360000 >/proc/sys/vm/dirty_expire_centisecs
echo 0 >/proc/sys/vm/dirty_writeback_centisecs
echo 80 >/proc/sys/vm/dirty_background_ratio
echo 90 >/proc/sys/vm/dirty_ratio

py=/usr/bin/python3

# check KIND ACK WHERE WHAT [PREFIX]: verify items 0..ACK of KIND (raw
# or fs) at WHERE with powercut.py, print KIND's metrics and result line;
# WHAT names the items, PREFIX starts the detail.
check() {
	local kind=$1 ack=$2 where=$3 what=$4 prefix=${5:-} bad first last
	read -r bad first last < <($py /tmp/powercut.py "verify-$kind" "$where" "$ack")
	metric "${kind}_acked" $((ack + 1))
	metric "${kind}_found" $((last + 1 - bad))
	metric "${kind}_lost" "$bad"
	if [ "$bad" = 0 ]; then
		result "powercut_$kind" PASS "$prefix$what 0..$ack acknowledged, 0..$last intact"
	else
		result "powercut_$kind" FAIL "$prefix$bad of $((ack + 1)) acknowledged $what lost or corrupt, first $first"
		return 1
	fi
}

# run_verify EPOCH RAW_ACK FS_ACK
run_verify() {
	export EPOCH=$1
	local raw_ack=$2 fs_ack=$3 fsck_rc=0 rc=0
	check raw "$raw_ack" /dev/nbd0 records || rc=1
	mkdir -p /tmp/pc
	if mount /dev/nbd1 /tmp/pc; then # replays the journal
		umount /tmp/pc
		e2fsck -fn /dev/nbd1 >/tmp/fsck.log 2>&1 || fsck_rc=$?
	else
		fsck_rc=99
	fi
	metric fs_fsck_rc "$fsck_rc"
	if [ "$fsck_rc" != 0 ]; then
		head -40 /tmp/fsck.log 2>/dev/null
		result powercut_fs FAIL "after journal replay, e2fsck -fn exit $fsck_rc (99: no mount)"
		rc=1
	elif mount -o ro /dev/nbd1 /tmp/pc; then
		check fs "$fs_ack" /tmp/pc files "fsck clean; " || rc=1
		umount /tmp/pc
	else
		result powercut_fs FAIL "cannot mount read-only after e2fsck"
		rc=1
	fi
	echo "POWERCUT-VERIFIED $rc"
	return $rc
}

# run_write EPOCH: write until the power is cut.
run_write() {
	export EPOCH=$1
	mkfs.ext4 -q -F -E lazy_itable_init=0,lazy_journal_init=0 /dev/nbd1 || return 1
	mkdir -p /tmp/pc
	mount /dev/nbd1 /tmp/pc || return 1
	sync # the empty filesystem is durable before the first acknowledgement
	echo "POWERCUT-WRITING $EPOCH"
	$py /tmp/powercut.py write-raw /dev/nbd0 &
	$py /tmp/powercut.py write-fs /tmp/pc &
	wait
	say "the writers stopped before the power cut"
	return 1
}

start || exit 1
rc=0
if [ "${1:-}" = verify ]; then
	run_verify "$2" "$3" "$4" || rc=1
	shift 4
fi
if [ "${1:-}" = write ]; then
	run_write "$2" || rc=1
fi
"$NBDMAPPER" detach /dev/nbd1 >/dev/null 2>&1
"$NBDMAPPER" detach /dev/nbd0 >/dev/null 2>&1
unserve
exit $rc
