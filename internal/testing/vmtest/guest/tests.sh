# The guest test suite: nbdmapper through the real kernel nbd driver, run
# by internal/testing/vmtest/run.sh (and TestGuest). Each test prints one line
#	VMTEST-RESULT <name> PASS|FAIL|SKIP <detail>
# and figures as
#	VMTEST-METRIC <name>=<value>
# Usage: tests.sh [TEST...] (default: all).
set -uo pipefail
here=$(dirname "$(realpath "$0")")
. "$here/lib.sh"

segments=1024
table=/tmp/table-$segments

result() { echo "VMTEST-RESULT $1 $2 ${*:3}"; }
metric() { echo "VMTEST-METRIC $1=$2"; }

# cleanup after a test, pass or fail.
cleanup() {
	umount /tmp/mnt 2>/dev/null || true
	dmsetup remove nbdmx 2>/dev/null || true
	for d in korig ksnap kcheck kmerge ks1 ks2 vmbench snorigin sncow sncow2; do dmsetup remove "$d" 2>/dev/null; done
	"$NBDMAPPER" detach /dev/nbd2 >/dev/null 2>&1
	"$NBDMAPPER" detach /dev/nbd1 >/dev/null 2>&1
	detach /dev/nbd0 >/dev/null 2>&1
	unserve
	remote_stop
}

# fs_make N BIG SUMS: a fresh filesystem on /dev/nbd0 holding N small files
# and one of BIG bytes, their checksums written to SUMS; fsck'd clean after
# unmounting.
fs_make() {
	local n=$1 big=$2 sums=$3 i
	mkfs.ext4 -q -F /dev/nbd0 || return 1
	mkdir -p /tmp/mnt
	mount /dev/nbd0 /tmp/mnt || return 1
	mkdir -p /tmp/mnt/a/b/c
	for ((i = 0; i < n; i++)); do
		head -c $(((i * 7919) % 3000000 + 1)) /dev/urandom >"/tmp/mnt/a/f$i"
	done
	head -c "$big" /dev/urandom >/tmp/mnt/a/b/c/big
	(cd /tmp/mnt && find . -type f | sort | xargs sha256sum) >"$sums"
	sync
	umount /tmp/mnt || return 1
	e2fsck -fn /dev/nbd0 >/tmp/fsck.log 2>&1 || {
		cat /tmp/fsck.log
		say "e2fsck found errors"
		return 1
	}
}

# fs_check SUMS: /dev/nbd0 fscks clean and its files have the checksums in
# SUMS.
fs_check() {
	e2fsck -fn /dev/nbd0 >/tmp/fsck.log 2>&1 || {
		cat /tmp/fsck.log
		say "e2fsck after restart found errors"
		return 1
	}
	mkdir -p /tmp/mnt
	mount /dev/nbd0 /tmp/mnt || return 1
	(cd /tmp/mnt && sha256sum --quiet -c "$1") || return 1
	umount /tmp/mnt
}

# 1. A filesystem on a 1024-segment table: mkfs (which discards), files,
# fsck, and the files' checksums after a restart of the server.
test_fs() {
	serve "$table" && attach || return 1
	fs_make 24 20000000 /tmp/sums || return 1
	detach
	unserve
	# a new server process and cold caches: the data must come from the disk
	# (attached with four connections this time)
	echo 3 >/proc/sys/vm/drop_caches
	serve "$table" && attach /dev/nbd0 --connections 4 || return 1
	fs_check /tmp/sums || return 1
	metric fs_files "$(wc -l </tmp/sums)"
}

# 2. The kernel's dm-linear over the same table reads what nbdmapper wrote,
# nbdmapper reads what dm-linear wrote, and in the end the two devices are
# identical byte for byte. nbdmapper attaches with two connections here.
test_dm_linear() {
	serve "$table" && attach /dev/nbd0 --connections 2 || return 1
	dmcreate nbdmx "$(cat "$table")" || return 1
	local size off
	size=$(blockdev --getsize64 /dev/nbd0)
	[ "$size" = "$(blockdev --getsize64 /dev/mapper/nbdmx)" ] || {
		say "sizes differ: nbd0 $size, dm $(blockdev --getsize64 /dev/mapper/nbdmx)"
		return 1
	}
	head -c $((3 << 20)) /dev/urandom >/tmp/pat1
	head -c $((3 << 20)) /dev/urandom >/tmp/pat2
	# through nbdmapper: 3 MiB runs, some not aligned to the segments
	# (512 KiB here), each crossing several of them; offsets in 4 KiB blocks
	local last=$((size / 4096 - 768))
	for off in 0 1 127 50003 "$last"; do
		dd if=/tmp/pat1 of=/dev/nbd0 bs=4k seek="$off" oflag=direct status=none || return 1
	done
	sync /dev/nbd0 # fsync: an NBD flush (BLKFLSBUF would not send one)
	echo 3 >/proc/sys/vm/drop_caches
	cmp -n $((3 << 20)) /tmp/pat1 <(dd if=/dev/mapper/nbdmx bs=4k skip=50003 iflag=direct status=none) || return 1
	# through dm-linear
	for off in 3 30001 "$last"; do
		dd if=/tmp/pat2 of=/dev/mapper/nbdmx bs=4k seek="$off" oflag=direct status=none || return 1
	done
	sync /dev/mapper/nbdmx
	echo 3 >/proc/sys/vm/drop_caches
	cmp /dev/nbd0 /dev/mapper/nbdmx || {
		say "nbd0 and dm-linear differ"
		return 1
	}
	cmp -n $((3 << 20)) /tmp/pat2 <(dd if=/dev/nbd0 bs=4k skip=30001 iflag=direct status=none) || return 1
	metric dm_compared_bytes "$size"
}

# flush_run LABEL IOS [serve flags]: IOS 4 KiB writes with fdatasync after
# each through a fresh attach; prints the flushes seen by nbd0 and the disk.
flush_run() {
	local label=$1 ios=$2
	shift 2
	serve "$table" "$@" && attach || return 1
	local n0 d0 w0
	n0=$(blkstat nbd0 16) d0=$(blkstat "$disk" 16) w0=$(blkstat nbd0 5)
	fio --name=flush --filename=/dev/nbd0 --ioengine=sync --rw=randwrite --bs=4k \
		--fdatasync=1 --number_ios="$ios" --io_size=$((ios * 4))k --size=256M \
		--output=/tmp/fio-$label.log >/dev/null || {
		cat /tmp/fio-$label.log
		return 1
	}
	flush_nbd=$(($(blkstat nbd0 16) - n0))
	flush_disk=$(($(blkstat "$disk" 16) - d0))
	writes_nbd=$(($(blkstat nbd0 5) - w0))
	detach
	unserve
	metric "flush_${label}_nbd_flushes" "$flush_nbd"
	metric "flush_${label}_disk_flushes" "$flush_disk"
	metric "flush_${label}_nbd_writes" "$writes_nbd"
}

# 3. fdatasync through a 1024-segment table: one disk flush per NBD flush
# (the disk's counter also sees the 4 KiB writes' own flush-free I/O only),
# where the one-flush-per-segment baseline sends ~1024.
test_flush() {
	flush_run nbdmapper 200 || return 1
	local n=$flush_nbd d=$flush_disk
	if ((n < 180)); then
		say "only $n flushes reached nbd0 for 200 fdatasyncs: are the transmission flags passed?"
		return 1
	fi
	if ((d > n + n / 10 + 4)); then
		say "$d disk flushes for $n NBD flushes: more than one per flush"
		return 1
	fi
	flush_run baseline 8 --flush-baseline per-segment || return 1
	if ((flush_nbd < 7 || flush_disk < flush_nbd * segments / 2)); then
		say "baseline: $flush_disk disk flushes for $flush_nbd NBD flushes; expected ~$segments each (is the counter real?)"
		return 1
	fi
	grep -i "stats\|sync" /tmp/serve.log | tail -5 || true
	echo "disk flushes per NBD flush: nbdmapper $d/$n, per-segment baseline $flush_disk/$flush_nbd"
}

# 4. blkdiscard of the whole device: the 1024 scattered pieces of each trim
# reach the disk as a few merged discards.
test_discard() {
	serve "$table" && attach || return 1
	local n0 d0 n d
	n0=$(blkstat nbd0 12) d0=$(blkstat "$disk" 12)
	blkdiscard -f /dev/nbd0 || return 1
	sync /dev/nbd0 # fsync: an NBD flush (BLKFLSBUF would not send one)
	n=$(($(blkstat nbd0 12) - n0))
	d=$(($(blkstat "$disk" 12) - d0))
	detach
	unserve
	metric discard_nbd_trims "$n"
	metric discard_disk_discards "$d"
	grep -i discard /tmp/serve.log | tail -3 || true
	echo "disk discards: $d for $n trims of $segments segments each"
	if ((n < 1)); then
		say "no trim reached nbd0: is SEND_TRIM passed to the kernel?"
		return 1
	fi
	if ((d > 4 * n + 4)); then
		say "$d disk discards for $n trims: the pieces were not merged"
		return 1
	fi
}

# nbd-client attaches nbdmapper too, passing its flags: fsync becomes an
# NBD flush and blkdiscard a trim.
test_nbd_client() {
	serve "$table" || return 1
	nbd-client -unix "$sock" /dev/nbd0 -N d -b 4096 || return 1
	local f0 t0
	head -c $((1 << 20)) /dev/urandom >/tmp/pat3
	f0=$(blkstat nbd0 16) t0=$(blkstat nbd0 12)
	dd if=/tmp/pat3 of=/dev/nbd0 bs=64k seek=17 conv=fsync status=none || return 1
	blkdiscard -f -o $((64 << 20)) -l $((8 << 20)) /dev/nbd0 || return 1
	echo 3 >/proc/sys/vm/drop_caches
	cmp -n $((1 << 20)) /tmp/pat3 <(dd if=/dev/nbd0 bs=64k skip=17 iflag=direct status=none) || return 1
	local f=$(($(blkstat nbd0 16) - f0)) t=$(($(blkstat nbd0 12) - t0))
	nbd-client -d /dev/nbd0 || return 1
	metric nbd_client_flushes "$f"
	metric nbd_client_trims "$t"
	if ((f < 1 || t < 1)); then
		say "nbd-client: $f flushes, $t trims reached nbd0"
		return 1
	fi
}

# nbd-client over TLS: nbdmapper requires TLS and a client certificate
# and limits export d to CN=client (certificates made here with openssl).
# A plaintext nbd-client and one with another CA's certificate are refused;
# then nbd-client with the right certificate attaches /dev/nbd0, which gets
# a filesystem that must fsck clean after a detach and a new attach.
test_nbd_client_tls() {
	command -v openssl >/dev/null || { say "SKIP no openssl"; return 77; }
	local pki=/tmp/pki other=/tmp/pki-other who
	for d in "$pki" "$other"; do
		mkdir -p "$d"
		openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 2 \
			-subj /CN=ca -keyout "$d/ca-key.pem" -out "$d/ca-cert.pem" 2>/dev/null || return 1
		for who in server client; do
			openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "/CN=$who" \
				-keyout "$d/$who-key.pem" -out "$d/$who.csr" 2>/dev/null || return 1
			if [ $who = server ]; then
				printf 'subjectAltName=DNS:localhost\nextendedKeyUsage=serverAuth\n' >"$d/$who.ext"
			else
				printf 'extendedKeyUsage=clientAuth\n' >"$d/$who.ext"
			fi
			openssl x509 -req -in "$d/$who.csr" -CA "$d/ca-cert.pem" -CAkey "$d/ca-key.pem" \
				-CAcreateserial -days 2 -extfile "$d/$who.ext" -out "$d/$who-cert.pem" 2>/dev/null || return 1
		done
	done
	serve "$table" --tls require --tls-cert "$pki/server-cert.pem" --tls-key "$pki/server-key.pem" \
		--tls-ca "$pki/ca-cert.pem" --allow d=client || return 1
	if nbd-client -unix "$sock" /dev/nbd0 -N d -b 4096; then
		say "a plaintext nbd-client attached to --tls require"
		nbd-client -d /dev/nbd0
		return 1
	fi
	if nbd-client -unix "$sock" /dev/nbd0 -N d -b 4096 -cacertfile "$pki/ca-cert.pem" \
		-certfile "$other/client-cert.pem" -keyfile "$other/client-key.pem" -tlshostname localhost; then
		say "nbd-client with another CA's certificate attached"
		nbd-client -d /dev/nbd0
		return 1
	fi
	local tls=(-cacertfile "$pki/ca-cert.pem" -certfile "$pki/client-cert.pem"
		-keyfile "$pki/client-key.pem" -tlshostname localhost)
	nbd-client -unix "$sock" /dev/nbd0 -N d -b 4096 "${tls[@]}" || return 1
	mkfs.ext4 -q -F /dev/nbd0 || return 1
	mkdir -p /tmp/mnt
	mount /dev/nbd0 /tmp/mnt || return 1
	head -c 5000000 /dev/urandom >/tmp/mnt/f
	sha256sum /tmp/mnt/f >/tmp/tls-sum
	umount /tmp/mnt || return 1
	nbd-client -d /dev/nbd0 || return 1
	echo 3 >/proc/sys/vm/drop_caches
	nbd-client -unix "$sock" /dev/nbd0 -N d -b 4096 "${tls[@]}" || return 1
	e2fsck -fn /dev/nbd0 >/tmp/fsck.log 2>&1 || {
		cat /tmp/fsck.log
		say "e2fsck over TLS found errors"
		return 1
	}
	mount /dev/nbd0 /tmp/mnt || return 1
	sha256sum --quiet -c /tmp/tls-sum || return 1
	umount /tmp/mnt
	nbd-client -d /dev/nbd0 || return 1
	unserve
	# Every key type users make, the CA's, the server's and the client's
	# alike; the client certificates as the shortest openssl recipe makes
	# them, with no extensions. nbd-client (GnuTLS) once sent no RSA
	# certificate to nbdmapper, and no Ed25519 one under TLS 1.2.
	local key
	for key in rsa:2048 ed25519 "ec -pkeyopt ec_paramgen_curve:P-384"; do
		d=/tmp/pki-${key%% *}
		mkdir -p "$d"
		# shellcheck disable=SC2086 # the key's words are openssl's
		openssl req -x509 -newkey $key -nodes -days 2 -subj /CN=ca \
			-keyout "$d/ca-key.pem" -out "$d/ca-cert.pem" 2>/dev/null || return 1
		for who in server client; do
			# shellcheck disable=SC2086
			openssl req -newkey $key -nodes -subj "/CN=$who" \
				-keyout "$d/$who-key.pem" -out "$d/$who.csr" 2>/dev/null || return 1
			local ext=()
			[ $who = client ] || {
				printf 'subjectAltName=DNS:localhost\n' >"$d/$who.ext"
				ext=(-extfile "$d/$who.ext")
			}
			openssl x509 -req -in "$d/$who.csr" -CA "$d/ca-cert.pem" -CAkey "$d/ca-key.pem" \
				-set_serial 2 -days 2 "${ext[@]}" -out "$d/$who-cert.pem" 2>/dev/null || return 1
		done
		serve "$table" --tls require --tls-cert "$d/server-cert.pem" --tls-key "$d/server-key.pem" \
			--tls-ca "$d/ca-cert.pem" --allow d=client || return 1
		nbd-client -unix "$sock" /dev/nbd0 -N d -b 4096 -cacertfile "$d/ca-cert.pem" \
			-certfile "$d/client-cert.pem" -keyfile "$d/client-key.pem" -tlshostname localhost || {
			say "nbd-client with $key certificates was refused"
			tail -3 /tmp/serve.log
			return 1
		}
		dd if=/dev/nbd0 of=/dev/null bs=4096 count=16 iflag=direct 2>/dev/null || return 1
		nbd-client -d /dev/nbd0 || return 1
		unserve
	done
}

# 5. Kernel dm-snapshot and nbdmapper read each other's COW stores. Two
# dm-linear pieces of the disk stand for the origin and the COW device
# (nbdmapper opens them by major:minor). Each side writes through its
# snapshot and its snapshot-origin, then the other side loads the same COW
# and must show the same snapshot and origin bytes. Both sides start from
# the same origin and make the same writes, so their results (bytes and the
# kernel's allocation status) must also match each other.
snap_sectors=65536 # 32 MiB origin, 16 MiB COW, 4 KiB chunks

devnum() { dmsetup info -c --noheadings -o major,minor --separator : "$1" | tr -d ' '; }

# snap_pieces: fresh origin (/tmp/snaporig) and COW (zeroed header: a new
# store).
snap_pieces() {
	dmsetup remove snorigin 2>/dev/null
	dmsetup remove sncow 2>/dev/null
	dmcreate snorigin "0 $snap_sectors linear $disk 0" || return 1
	dmcreate sncow "0 $((snap_sectors / 2)) linear $disk $snap_sectors" || return 1
	dd if=/tmp/snaporig of=/dev/mapper/snorigin bs=1M oflag=direct status=none || return 1
	dd if=/dev/zero of=/dev/mapper/sncow bs=1M count=1 oflag=direct status=none || return 1
}

# snap_writes SNAPDEV ORIGDEV: the same writes on either side: through the
# snapshot (new chunks and partial chunks), then through the origin
# (copy-outs), including chunks the snapshot already wrote.
snap_writes() {
	head -c $((1 << 20)) /tmp/snappat | dd of="$1" bs=4k seek=100 oflag=direct status=none || return 1
	head -c 6144 /tmp/snappat | dd of="$1" bs=512 seek=40001 oflag=direct status=none || return 1
	tail -c $((1 << 20)) /tmp/snappat | dd of="$2" bs=4k seek=50 oflag=direct status=none || return 1
	tail -c 4608 /tmp/snappat | dd of="$2" bs=512 seek=60003 oflag=direct status=none || return 1
	sync "$1" "$2"
}

snap_sums() { echo "$(sha256sum <"$1" | cut -c1-64) $(sha256sum <"$2" | cut -c1-64)"; }

test_snapshot() {
	head -c $((2 << 20)) /dev/urandom >/tmp/snappat
	head -c $((snap_sectors * 512)) /dev/urandom >/tmp/snaporig
	local o c kern nbdm kstat kernA kstatA
	local ktab="0 $snap_sectors snapshot /dev/mapper/snorigin /dev/mapper/sncow P 8"

	# A: the kernel writes, nbdmapper reads.
	snap_pieces || return 1
	dmcreate ksnap "$ktab" || return 1
	dmcreate korig "0 $snap_sectors snapshot-origin /dev/mapper/snorigin" || return 1
	snap_writes /dev/mapper/ksnap /dev/mapper/korig || return 1
	echo 3 >/proc/sys/vm/drop_caches
	kern=$(snap_sums /dev/mapper/ksnap /dev/mapper/korig)
	kstat=$(dmsetup status ksnap)
	dmsetup remove korig && dmsetup remove ksnap || return 1
	o=$(devnum snorigin) c=$(devnum sncow)
	echo "0 $snap_sectors snapshot $o $c P 8" >/tmp/snap.table
	echo "0 $snap_sectors snapshot-origin $o" >/tmp/orig.table
	rm -f "$sock"
	"$NBDMAPPER" serve --socket "$sock" snap=/tmp/snap.table orig=/tmp/orig.table >>/tmp/serve.log 2>&1 &
	serve_pid=$!
	for ((i = 0; i < 300; i++)); do [ -S "$sock" ] && break; sleep 0.1; done
	"$NBDMAPPER" attach --socket "$sock" --export snap --block-size 512 /dev/nbd0 >>/tmp/attach.log 2>&1 &
	local a0=$!
	"$NBDMAPPER" attach --socket "$sock" --export orig --block-size 512 /dev/nbd1 >>/tmp/attach.log 2>&1 &
	local a1=$!
	for ((i = 0; i < 300; i++)); do [ -e /sys/block/nbd0/pid ] && [ -e /sys/block/nbd1/pid ] && break; sleep 0.1; done
	nbdm=$(snap_sums /dev/nbd0 /dev/nbd1)
	"$NBDMAPPER" detach /dev/nbd0
	"$NBDMAPPER" detach /dev/nbd1
	wait $a0 $a1
	unserve
	echo "A kernel wrote:   snapshot, origin sha256 $kern ($kstat)"
	echo "A nbdmapper read: snapshot, origin sha256 $nbdm"
	[ "$kern" = "$nbdm" ] || {
		say "nbdmapper reads the kernel's COW store differently"
		return 1
	}
	kernA=$kern kstatA=$kstat

	# B: nbdmapper writes, the kernel reads.
	snap_pieces || return 1
	echo 3 >/proc/sys/vm/drop_caches
	"$NBDMAPPER" serve --socket "$sock" snap=/tmp/snap.table orig=/tmp/orig.table >>/tmp/serve.log 2>&1 &
	serve_pid=$!
	for ((i = 0; i < 300; i++)); do [ -S "$sock" ] && break; sleep 0.1; done
	"$NBDMAPPER" attach --socket "$sock" --export snap --block-size 512 /dev/nbd0 >>/tmp/attach.log 2>&1 &
	a0=$!
	"$NBDMAPPER" attach --socket "$sock" --export orig --block-size 512 /dev/nbd1 >>/tmp/attach.log 2>&1 &
	a1=$!
	for ((i = 0; i < 300; i++)); do [ -e /sys/block/nbd0/pid ] && [ -e /sys/block/nbd1/pid ] && break; sleep 0.1; done
	snap_writes /dev/nbd0 /dev/nbd1 || return 1
	echo 3 >/proc/sys/vm/drop_caches
	nbdm=$(snap_sums /dev/nbd0 /dev/nbd1)
	"$NBDMAPPER" detach /dev/nbd0
	"$NBDMAPPER" detach /dev/nbd1
	wait $a0 $a1
	unserve
	echo 3 >/proc/sys/vm/drop_caches
	dmcreate ksnap "$ktab" || return 1
	dmcreate korig "0 $snap_sectors snapshot-origin /dev/mapper/snorigin" || return 1
	kern=$(snap_sums /dev/mapper/ksnap /dev/mapper/korig)
	kstat=$(dmsetup status ksnap)
	dmsetup remove korig
	dmsetup remove ksnap
	echo "B nbdmapper wrote: snapshot, origin sha256 $nbdm"
	echo "B kernel read:     snapshot, origin sha256 $kern ($kstat)"
	[ "$kern" = "$nbdm" ] || {
		say "the kernel reads nbdmapper's COW store differently"
		return 1
	}
	case $kstat in
	*Invalid* | *Overflow* | *failed*)
		say "kernel status of nbdmapper's store: $kstat"
		return 1
		;;
	esac
	# the same writes on the same origin: the same bytes and allocation
	[ "$kern" = "$kernA" ] || {
		say "the same writes gave different snapshot/origin bytes through the kernel and nbdmapper"
		return 1
	}
	[ "$kstat" = "$kstatA" ] || {
		say "kernel status of nbdmapper's store '$kstat', of its own '$kstatA'"
		return 1
	}
}

# 8. A device changed while /dev/nbd0 is in use, as dmsetup users do:
# a reload that moves a segment to a copy of its file (copied while
# suspended), a suspend of 2 s under a writer (held, not failed), and a
# grow by appending a segment, which the attached device follows.
test_lifecycle() {
	local ctl=/tmp/lifecycle.ctl w i
	ctlcmd() { "$NBDMAPPER" "$1" --control "$ctl" "${@:2}"; }
	for f in la lb la2 lc; do truncate -s 32M /tmp/$f.img; done
	printf '0 65536 linear /tmp/la.img 0\n65536 65536 linear /tmp/lb.img 0\n' >/tmp/l.table
	printf '0 65536 linear /tmp/la2.img 0\n65536 65536 linear /tmp/lb.img 0\n' >/tmp/l-moved.table
	{ cat /tmp/l-moved.table; printf '131072 65536 linear /tmp/lc.img 0\n'; } >/tmp/l-grown.table
	serve /tmp/l.table --control "$ctl" && attach || return 1
	head -c 64M /dev/urandom >/tmp/ldata
	dd if=/tmp/ldata of=/dev/nbd0 bs=64k oflag=direct status=none &
	w=$!
	ctlcmd reload d /tmp/l-moved.table || return 1
	ctlcmd suspend d || return 1
	cp /tmp/la.img /tmp/la2.img
	ctlcmd resume d || return 1
	ctlcmd suspend d || return 1
	sleep 2
	ctlcmd resume d || return 1
	wait "$w" || { say "the writer failed"; return 1; }
	ctlcmd info d
	ctlcmd info d | grep -q 'Requests held: *[1-9]' || { say "the suspend held nothing"; return 1; }
	echo 3 >/proc/sys/vm/drop_caches
	cmp /tmp/ldata /dev/nbd0 || { say "/dev/nbd0 differs from what was written"; return 1; }
	ctlcmd reload d /tmp/l-grown.table && ctlcmd resume d || return 1
	for ((i = 0; i < 300; i++)); do
		[ "$(blockdev --getsize64 /dev/nbd0)" = $((96 << 20)) ] && break
		sleep 0.1
	done
	[ "$(blockdev --getsize64 /dev/nbd0)" = $((96 << 20)) ] || { say "/dev/nbd0 did not grow: $(blockdev --getsize64 /dev/nbd0)"; return 1; }
	cmp -n $((64 << 20)) /tmp/ldata /dev/nbd0 || { say "data changed by growing"; return 1; }
	dd if=/dev/urandom of=/dev/nbd0 bs=1M seek=80 count=4 oflag=direct status=none || { say "writing the new segment failed"; return 1; }
}

# 9. A live snapshot as lvcreate -s takes one (create lv-real, suspend,
# reload lv as snapshot-origin, create snap, resume), then writes to the
# origin; the snapshot device holds the origin as of the suspend, and the
# kernel's dm-snapshot reads the same bytes from the COW store nbdmapper
# wrote.
test_live_snapshot() {
	local ctl=/tmp/live.ctl o c before after kern kstat i
	ctlcmd() { "$NBDMAPPER" "$1" --control "$ctl" "${@:2}"; }
	head -c $((snap_sectors * 512)) /dev/urandom >/tmp/snaporig
	head -c $((2 << 20)) /dev/urandom >/tmp/snappat
	snap_pieces || return 1
	o=$(devnum snorigin) c=$(devnum sncow)
	echo "0 $snap_sectors linear $o 0" >/tmp/lv.table
	echo "0 $snap_sectors snapshot-origin /dev/mapper/lv-real" >/tmp/lv-origin.table
	echo "0 $snap_sectors snapshot /dev/mapper/lv-real $c P 8" >/tmp/lv-snap.table
	rm -f "$sock"
	"$NBDMAPPER" serve --socket "$sock" --control "$ctl" lv=/tmp/lv.table >>/tmp/serve.log 2>&1 &
	serve_pid=$!
	for ((i = 0; i < 300; i++)); do [ -S "$sock" ] && break; sleep 0.1; done
	"$NBDMAPPER" attach --socket "$sock" --export lv --block-size 512 /dev/nbd0 >>/tmp/attach.log 2>&1 &
	local a0=$! a1
	for ((i = 0; i < 300; i++)); do [ -e /sys/block/nbd0/pid ] && break; sleep 0.1; done
	head -c $((1 << 20)) /tmp/snappat | dd of=/dev/nbd0 bs=4k seek=10 oflag=direct status=none || return 1
	before=$(sha256sum </dev/nbd0 | cut -c1-64)
	ctlcmd create lv-real /tmp/lv.table && ctlcmd suspend lv && ctlcmd reload lv /tmp/lv-origin.table &&
		ctlcmd create snap /tmp/lv-snap.table && ctlcmd resume lv || return 1
	tail -c $((1 << 20)) /tmp/snappat | dd of=/dev/nbd0 bs=4k seek=5 oflag=direct status=none || return 1
	after=$(sha256sum </dev/nbd0 | cut -c1-64)
	"$NBDMAPPER" attach --socket "$sock" --export snap --block-size 512 /dev/nbd1 >>/tmp/attach.log 2>&1 &
	a1=$!
	for ((i = 0; i < 300; i++)); do [ -e /sys/block/nbd1/pid ] && break; sleep 0.1; done
	local snapsum
	snapsum=$(sha256sum </dev/nbd1 | cut -c1-64)
	"$NBDMAPPER" detach /dev/nbd0
	"$NBDMAPPER" detach /dev/nbd1
	wait $a0 $a1
	unserve
	echo "origin before $before, after $after; snapshot $snapsum"
	[ "$before" != "$after" ] || { say "the origin write changed nothing"; return 1; }
	[ "$snapsum" = "$before" ] || { say "the snapshot does not hold the origin as of the suspend"; return 1; }
	echo 3 >/proc/sys/vm/drop_caches
	dmcreate ksnap "0 $snap_sectors snapshot /dev/mapper/snorigin /dev/mapper/sncow P 8" || return 1
	kern=$(sha256sum </dev/mapper/ksnap | cut -c1-64)
	kstat=$(dmsetup status ksnap)
	dmsetup remove ksnap
	echo "kernel reads the snapshot as $kern ($kstat)"
	[ "$kern" = "$before" ] || { say "the kernel reads the live snapshot's COW store differently"; return 1; }
}

# Remote segments. The guest has no network, so its four "remote hosts"
# are nbdkits inside it, each serving a 64 MiB quarter of the scratch disk
# (offset filter), three on unix sockets and one on loopback TCP; a
# striped table over the four, and a linear table of 1024 segments spread
# over them, are each attached as /dev/nbd0: mkfs, files, fsck, and fsck
# and checksums again after nbdmapper restarts.
remote_pids=()

remote_start() {
	command -v nbdkit >/dev/null || { say "SKIP no nbdkit"; return 77; }
	ip link set lo up 2>/dev/null
	local i listen
	remote_uris=()
	for i in 0 1 2 3; do
		rm -f "/tmp/r$i.sock"
		if [ $i = 3 ] && ip -4 addr show lo 2>/dev/null | grep -q 127.0.0.1; then
			listen=(-i 127.0.0.1 -p 10809)
			remote_uris+=("nbd://127.0.0.1:10809/")
		else
			listen=(-U "/tmp/r$i.sock")
			remote_uris+=("nbd+unix:///?socket=/tmp/r$i.sock")
		fi
		nbdkit -f "${listen[@]}" --filter=offset --filter=log file "$disk" \
			offset=$((i * 64))M range=64M logfile="/tmp/r$i.log" logappend=true >>/tmp/nbdkit.log 2>&1 &
		remote_pids+=($!)
	done
	for ((i = 0; i < 300; i++)); do
		[ "$(cat /tmp/r?.log 2>/dev/null | grep -c ' Ready ')" -ge 4 ] && return 0
		sleep 0.1
	done
	say "the nbdkit remotes did not start:"
	cat /tmp/nbdkit.log
	return 1
}

remote_stop() {
	local p
	for p in "${remote_pids[@]}"; do kill "$p" 2>/dev/null; done
	for p in "${remote_pids[@]}"; do wait "$p" 2>/dev/null; done
	remote_pids=()
}

# remote_fs TABLE: a filesystem through /dev/nbd0 on TABLE, checked after
# a restart of nbdmapper.
remote_fs() {
	serve "$1" && attach /dev/nbd0 --connections 2 || return 1
	fs_make 12 30000000 /tmp/rsums || return 1
	detach
	unserve
	echo 3 >/proc/sys/vm/drop_caches
	serve "$1" && attach || return 1
	fs_check /tmp/rsums || return 1
	detach
	unserve
}

test_remote() {
	remote_start || return $?
	say "remotes: ${remote_uris[*]}"
	local quarter=$((64 << 11)) i
	echo "0 $((4 * quarter)) striped 4 128 ${remote_uris[0]} 0 ${remote_uris[1]} 0 ${remote_uris[2]} 0 ${remote_uris[3]} 0" >/tmp/remote-striped
	: >/tmp/remote-linear
	for ((i = 0; i < 1024; i++)); do
		echo "$((i * 512)) 512 linear ${remote_uris[i % 4]} $(((i / 4 * 389 % 256) * 512))" >>/tmp/remote-linear
	done
	remote_fs /tmp/remote-striped || return 1
	local f0 f
	f0=$(cat /tmp/r?.log | grep -c ' Flush id=')
	remote_fs /tmp/remote-linear || return 1
	f=$(($(cat /tmp/r?.log | grep -c ' Flush id=') - f0))
	metric remote_linear_remote_flushes "$f"
}


# Snapshot merge (issue 16), both ways, with dmsetup status and nbdmapper
# status compared mid-merge. The stores get 512 chunks copied out in random
# order (fio randwrite over 2 MiB of the origin), so each merge has as
# many runs and takes long enough to be caught in the middle: nbdmapper's
# by a slow --merge-rate, the kernel's by dm-snapshot's
# snapshot_copy_throttle. Mid-merge, the merging side is suspended (its
# merge stops after the step in progress) and the other side loads the
# same COW as a plain snapshot: both must print the same status line and
# read the same snapshot bytes. After the merge the origin holds the
# snapshot's bytes.
merge_rate=512K

# nstatus NAME: nbdmapper status's target lines for device NAME, without
# the name (not its failed, remote or merged: lines).
nstatus() { "$NBDMAPPER" status --metrics 127.0.0.1:9810 | sed -n "s/^$1: \([0-9]\)/\1/p"; }

# merge_state LINE: "mid", "done" or "start" for a snapshot(-merge) status
# line "<start> <len> <target> <alloc>/<total> <meta>", against the
# allocation $merge_start0 at the start.
merge_state() {
	local a m
	a=$(echo "$1" | awk '{split($4, x, "/"); print x[1]}')
	m=$(echo "$1" | awk '{print $5}')
	if [ -z "$a" ] || [ -z "$m" ]; then echo "?"
	elif [ "$a" = "$m" ]; then echo done
	elif [ "$a" -lt "$merge_start0" ]; then echo mid
	else echo start
	fi
}

# scatter DEV: 512 4 KiB writes in random order over [8M, 10M) of DEV.
scatter() {
	fio --name=scatter --filename="$1" --rw=randwrite --bs=4k --offset=8M --size=2M \
		--direct=1 --randrepeat=1 --output=/tmp/fio-scatter.log >/dev/null || {
		cat /tmp/fio-scatter.log
		return 1
	}
}

test_snapshot_merge() {
	ip link set lo up 2>/dev/null
	head -c $((2 << 20)) /dev/urandom >/tmp/snappat
	head -c $((snap_sectors * 512)) /dev/urandom >/tmp/snaporig
	local o c ksum nsum line st i kline nline want
	local throttle=/sys/module/dm_snapshot/parameters/snapshot_copy_throttle

	# A: the kernel makes and writes the snapshot, nbdmapper merges it.
	snap_pieces || return 1
	dmcreate ksnap "0 $snap_sectors snapshot /dev/mapper/snorigin /dev/mapper/sncow P 8" || return 1
	dmcreate korig "0 $snap_sectors snapshot-origin /dev/mapper/snorigin" || return 1
	snap_writes /dev/mapper/ksnap /dev/mapper/korig || return 1
	scatter /dev/mapper/korig || return 1
	sync /dev/mapper/korig
	ksum=$(sha256sum </dev/mapper/ksnap | cut -c1-64)
	merge_start0=$(dmsetup status ksnap | awk '{split($4, x, "/"); print x[1]}')
	echo "A kernel's snapshot: sha256 $ksum, $(dmsetup status ksnap)"
	dmsetup remove korig && dmsetup remove ksnap || return 1
	o=$(devnum snorigin) c=$(devnum sncow)
	echo "0 $snap_sectors snapshot-merge $o $c P 8" >/tmp/merge.table
	echo "0 $snap_sectors snapshot $o $c P 8" >/tmp/check.table
	serve /tmp/merge.table --merge-rate "$merge_rate" --control /tmp/merge.ctl && attach /dev/nbd0 --block-size 512 || return 1
	for ((i = 0; i < 600; i++)); do
		line=$(nstatus d)
		st=$(merge_state "$line")
		[ "$st" = start ] || break
		sleep 0.1
	done
	[ "$st" = mid ] || { say "nbdmapper's merge never seen in the middle: $line"; return 1; }
	"$NBDMAPPER" suspend --control /tmp/merge.ctl d || return 1
	nline=$(nstatus d)
	echo 3 >/proc/sys/vm/drop_caches
	dmcreate kcheck "0 $snap_sectors snapshot /dev/mapper/snorigin /dev/mapper/sncow P 8" || return 1
	kline=$(dmsetup status kcheck)
	nsum=$(sha256sum </dev/mapper/kcheck | cut -c1-64)
	dmsetup remove kcheck
	echo "A mid-merge: nbdmapper status '$nline', dmsetup status of the same COW '$kline'"
	[ "$(echo "$nline" | cut -d' ' -f4-)" = "$(echo "$kline" | cut -d' ' -f4-)" ] || {
		say "nbdmapper and the kernel disagree mid-merge: '$nline' vs '$kline'"
		return 1
	}
	[ "$nsum" = "$ksum" ] || { say "mid-merge the kernel reads other bytes than the snapshot's"; return 1; }
	"$NBDMAPPER" resume --control /tmp/merge.ctl d || return 1
	for ((i = 0; i < 1200; i++)); do
		line=$(nstatus d)
		[ "$(merge_state "$line")" = done ] && break
		sleep 0.1
	done
	[ "$(merge_state "$line")" = done ] || { say "nbdmapper's merge did not finish: $line"; return 1; }
	echo 3 >/proc/sys/vm/drop_caches
	nsum=$(sha256sum </dev/nbd0 | cut -c1-64)
	detach
	unserve
	[ "$nsum" = "$ksum" ] || { say "the merged device reads other bytes than the snapshot's"; return 1; }
	echo 3 >/proc/sys/vm/drop_caches
	[ "$(sha256sum </dev/mapper/snorigin | cut -c1-64)" = "$ksum" ] || { say "after nbdmapper's merge the origin is not the snapshot"; return 1; }
	echo "A merged by nbdmapper: $line; the origin holds the snapshot's bytes"
	metric snapshot_merge_nbdmapper_mid_sectors "$(echo "$nline" | awk '{split($4, x, "/"); print x[1]}')"

	# B: nbdmapper makes and writes the snapshot, the kernel merges it.
	snap_pieces || return 1
	echo 3 >/proc/sys/vm/drop_caches
	echo "0 $snap_sectors snapshot $o $c P 8" >/tmp/snap-b.table
	echo "0 $snap_sectors snapshot-origin $o" >/tmp/orig-b.table
	serve_set snap=/tmp/snap-b.table orig=/tmp/orig-b.table || return 1
	attach_export snap /dev/nbd0 --block-size 512 && attach_export orig /dev/nbd1 --block-size 512 || return 1
	snap_writes /dev/nbd0 /dev/nbd1 || return 1
	scatter /dev/nbd1 || return 1
	sync /dev/nbd1
	nsum=$(sha256sum </dev/nbd0 | cut -c1-64)
	line=$(nstatus snap)
	merge_start0=$(echo "$line" | awk '{split($4, x, "/"); print x[1]}')
	echo "B nbdmapper's snapshot: sha256 $nsum, $line"
	"$NBDMAPPER" detach /dev/nbd1
	detach /dev/nbd0
	unserve
	echo 3 >/proc/sys/vm/drop_caches
	local old=100
	[ -w "$throttle" ] && old=$(cat "$throttle") && echo 1 >"$throttle"
	dmcreate kmerge "0 $snap_sectors snapshot-merge /dev/mapper/snorigin /dev/mapper/sncow P 8" || return 1
	for ((i = 0; i < 3000; i++)); do
		line=$(dmsetup status kmerge)
		st=$(merge_state "$line")
		[ "$st" = start ] || break
		sleep 0.02
	done
	[ "$st" = mid ] || { [ -w "$throttle" ] && echo "$old" >"$throttle"; say "the kernel's merge never seen in the middle: $line"; return 1; }
	dmsetup suspend kmerge
	kline=$(dmsetup status kmerge)
	echo 3 >/proc/sys/vm/drop_caches
	serve /tmp/check.table --read-only || return 1
	attach /dev/nbd0 --block-size 512 || return 1
	nline=$(nstatus d)
	want=$(sha256sum </dev/nbd0 | cut -c1-64)
	detach
	unserve
	echo "B mid-merge: dmsetup status '$kline', nbdmapper status of the same COW '$nline'"
	[ -w "$throttle" ] && echo "$old" >"$throttle"
	dmsetup resume kmerge
	[ "$(echo "$nline" | cut -d' ' -f4-)" = "$(echo "$kline" | cut -d' ' -f4-)" ] || {
		say "the kernel and nbdmapper disagree mid-merge: '$kline' vs '$nline'"
		return 1
	}
	[ "$want" = "$nsum" ] || { say "mid-merge nbdmapper reads other bytes than the snapshot's"; return 1; }
	for ((i = 0; i < 1200; i++)); do
		line=$(dmsetup status kmerge)
		[ "$(merge_state "$line")" = done ] && break
		sleep 0.1
	done
	[ "$(merge_state "$line")" = done ] || { say "the kernel's merge did not finish: $line"; return 1; }
	dmsetup remove kmerge
	echo 3 >/proc/sys/vm/drop_caches
	[ "$(sha256sum </dev/mapper/snorigin | cut -c1-64)" = "$nsum" ] || { say "after the kernel's merge the origin is not nbdmapper's snapshot"; return 1; }
	echo "B merged by the kernel: $line; the origin holds the snapshot's bytes"
}

# Several snapshots of one origin, each with its own COW and chunk size:
# nbdmapper serves the origin and two snapshots; writes through the origin
# (copied out to whichever snapshot lacks the chunk) and through each
# snapshot; then the kernel loads each COW as a snapshot of the origin and
# must read the same bytes with the same status as nbdmapper.
test_multi_snapshot() {
	ip link set lo up 2>/dev/null
	head -c $((2 << 20)) /dev/urandom >/tmp/snappat
	head -c $((snap_sectors * 512)) /dev/urandom >/tmp/snaporig
	local o c1 c2 s1 s2 n1 n2 k1 k2
	snap_pieces || return 1
	dmsetup remove sncow2 2>/dev/null
	dmcreate sncow2 "0 $((snap_sectors / 2)) linear $disk $((snap_sectors * 3 / 2))" || return 1
	dd if=/dev/zero of=/dev/mapper/sncow2 bs=1M count=1 oflag=direct status=none || return 1
	o=$(devnum snorigin) c1=$(devnum sncow) c2=$(devnum sncow2)
	echo "0 $snap_sectors snapshot $o $c1 P 8" >/tmp/s1.table
	echo "0 $snap_sectors snapshot $o $c2 P 32" >/tmp/s2.table
	echo "0 $snap_sectors snapshot-origin $o" >/tmp/o.table
	serve_set s1=/tmp/s1.table orig=/tmp/o.table || return 1
	attach_export orig /dev/nbd1 --block-size 512 || return 1
	# s1 sees the origin as it was, s2 (loaded later) after this write
	tail -c $((1 << 20)) /tmp/snappat | dd of=/dev/nbd1 bs=4k seek=300 oflag=direct status=none || return 1
	"$NBDMAPPER" detach /dev/nbd1
	unserve
	serve_set s1=/tmp/s1.table s2=/tmp/s2.table orig=/tmp/o.table || return 1
	attach_export s1 /dev/nbd0 --block-size 512 && attach_export orig /dev/nbd1 --block-size 512 &&
		attach_export s2 /dev/nbd2 --block-size 512 || return 1
	snap_writes /dev/nbd0 /dev/nbd1 || return 1
	scatter /dev/nbd1 || return 1
	head -c 8192 /tmp/snappat | dd of=/dev/nbd2 bs=512 seek=20001 oflag=direct status=none || return 1
	sync /dev/nbd1 /dev/nbd2
	echo 3 >/proc/sys/vm/drop_caches
	n1="$(sha256sum </dev/nbd0 | cut -c1-64) $(nstatus s1 | cut -d' ' -f4-)"
	n2="$(sha256sum </dev/nbd2 | cut -c1-64) $(nstatus s2 | cut -d' ' -f4-)"
	"$NBDMAPPER" detach /dev/nbd2
	"$NBDMAPPER" detach /dev/nbd1
	detach /dev/nbd0
	unserve
	echo 3 >/proc/sys/vm/drop_caches
	dmcreate ks1 "0 $snap_sectors snapshot /dev/mapper/snorigin /dev/mapper/sncow P 8" &&
		dmcreate ks2 "0 $snap_sectors snapshot /dev/mapper/snorigin /dev/mapper/sncow2 P 32" || return 1
	k1="$(sha256sum </dev/mapper/ks1 | cut -c1-64) $(dmsetup status ks1 | cut -d' ' -f4-)"
	k2="$(sha256sum </dev/mapper/ks2 | cut -c1-64) $(dmsetup status ks2 | cut -d' ' -f4-)"
	dmsetup remove ks1
	dmsetup remove ks2
	dmsetup remove sncow2
	echo "snapshot 1: nbdmapper $n1, kernel $k1"
	echo "snapshot 2: nbdmapper $n2, kernel $k2"
	[ "$n1" = "$k1" ] && [ "$n2" = "$k2" ] || { say "the kernel reads the snapshots differently"; return 1; }
	[ "${n1%% *}" != "${n2%% *}" ] || { say "the two snapshots are the same: the test proves nothing"; return 1; }
}

all=(fs dm_linear flush discard nbd_client nbd_client_tls snapshot lifecycle live_snapshot remote snapshot_merge multi_snapshot)
[ $# -gt 0 ] && all=("$@")
if [ ! -x "$NBDMAPPER" ]; then
	for t in "${all[@]}"; do result "$t" FAIL "no nbdmapper binary (did go build fail?)"; done
	exit 1
fi
gen_table "$segments" "$disk" >"$table"
say "kernel $(uname -r), $(nproc) CPUs, table of $(wc -l <"$table") segments over $disk"
failed=0
for t in "${all[@]}"; do
	say "=== $t"
	start=$(date +%s.%N)
	"test_$t" >/tmp/test.log 2>&1
	rc=$?
	cat /tmp/test.log
	cleanup >/dev/null 2>&1
	secs=$(awk -v s="$start" -v e="$(date +%s.%N)" 'BEGIN{printf "%.1f", e-s}')
	metric "${t}_seconds" "$secs"
	case $rc in
	0) result "$t" PASS "${secs}s" ;;
	77) result "$t" SKIP "$(grep SKIP /tmp/test.log | tail -1)" ;;
	*)
		result "$t" FAIL "exit $rc; last lines: $(tail -3 /tmp/test.log | tr '\n' ' ')"
		failed=1
		;;
	esac
done
exit $failed
