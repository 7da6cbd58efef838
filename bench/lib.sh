# Shared by the bench scripts; source it from the repository root.
#
#   bench_setup NAME TOOL...   checks the tools (and fio's nbd engine, when
#                              fio is one), makes $out (bench/results/NAME-<time>)
#                              and $work (a temporary folder removed on exit,
#                              after any server still running is killed), and
#                              puts the binary under test at $work/nbdmapper:
#                              $NBDMAPPER_BIN if set, else built from this checkout.
#   wait_socket SOCK PID LOG   waits until the server PID listens on SOCK;
#                              if it exits first, prints LOG and fails.
#   make_pki DIR               makes certificates for TLS runs in DIR.
#   wait_tls PORT PID LOG      wait_socket for a TLS server on 127.0.0.1:PORT
#                              with the certificates in $work/pki.
#   fio_tls ARGS...            fio with the client certificate of $work/pki.
#   keep_free_memory           stops the guest handing free memory back to the
#                              host (free page reporting) until the script exits,
#                              and says so in $out/machine.md.
#   bench_machine              prints the machine, tools and load average.
#   cpu_ticks PID              prints PID's user + system CPU in clock ticks.
#   task_ticks                 prints every process's user + system CPU in clock ticks.
#   guest_rounds TAG           sums up a guest log's per-round result lines.

bench_setup() {
	local name=$1 tool
	shift
	for tool in "$@"; do
		command -v "$tool" >/dev/null || { echo "bench/$name.sh: $tool missing (see scripts/test.sh for the Debian packages)" >&2; exit 1; }
		if [ "$tool" = fio ]; then
			fio --enghelp=nbd >/dev/null 2>&1 || { echo "bench/$name.sh: fio lacks the nbd engine" >&2; exit 1; }
		fi
	done
	out=bench/results/$name-$(date +%Y%m%d-%H%M%S)
	mkdir -p "$out"
	work=$(mktemp -d)
	trap 'kill $(jobs -p) 2>/dev/null || true; wait 2>/dev/null; rm -rf "$work"; restore_reporting' EXIT
	if [ -n "${NBDMAPPER_BIN:-}" ]; then
		cp "$NBDMAPPER_BIN" "$work/nbdmapper"
	else
		go build -o "$work/nbdmapper" ./cmd/nbdmapper
	fi
}

# keep_free_memory: a VM whose balloon has free page reporting hands 2 MiB
# blocks that have been free for 2 s back to the host, and the next touch of
# each of their pages faults in the host. Whichever server runs after memory
# has lain free pays for it, most on a sparse file's first 1M write run of a
# row (docs/decisions/bench-method.md has the figures). An
# order above the largest (10) reports nothing; the old order comes back on
# exit. Without the knob (a kernel without page reporting) or as a user who
# cannot write it, it does nothing.
reporting_knob=/sys/module/page_reporting/parameters/page_reporting_order
reporting_was=
keep_free_memory() {
	[ -w "$reporting_knob" ] || return 0
	reporting_was=$(cat "$reporting_knob")
	echo 11 >"$reporting_knob"
	echo "free page reporting: off for the run (order $reporting_was before)" | tee -a "$out/machine.md"
}

restore_reporting() {
	[ -z "$reporting_was" ] || echo "$reporting_was" >"$reporting_knob"
}

wait_socket() {
	local sock=$1 pid=$2 log=$3
	until [ -S "$sock" ]; do
		if ! kill -0 "$pid" 2>/dev/null; then
			echo "server did not start:" >&2
			cat "$log" >&2
			exit 1
		fi
		sleep 0.05
	done
}

# make_pki DIR: a CA, a server certificate for localhost/127.0.0.1 and a
# client certificate, in the layout libnbd, nbdkit and qemu read
# (ca-cert.pem, server-cert.pem, server-key.pem, client-cert.pem, client-key.pem).
make_pki() {
	local d=$1 who
	mkdir -p "$d"
	openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 2 \
		-subj /CN=bench-ca -keyout "$d/ca-key.pem" -out "$d/ca-cert.pem" 2>/dev/null
	for who in server client; do
		openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "/CN=$who" \
			-keyout "$d/$who-key.pem" -out "$d/$who.csr" 2>/dev/null
		if [ $who = server ]; then
			printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n' >"$d/$who.ext"
		else
			printf 'extendedKeyUsage=clientAuth\n' >"$d/$who.ext"
		fi
		openssl x509 -req -in "$d/$who.csr" -CA "$d/ca-cert.pem" -CAkey "$d/ca-key.pem" -CAcreateserial \
			-days 2 -extfile "$d/$who.ext" -out "$d/$who-cert.pem" 2>/dev/null
	done
}

# wait_tls PORT PID LOG: waits until the server PID answers NBD over TLS
# on 127.0.0.1:PORT, with the certificates in $work/pki; if it exits
# first, prints LOG and fails.
wait_tls() {
	local port=$1 pid=$2 log=$3
	until nbdinfo --size "nbds://127.0.0.1:$port/bench?tls-certificates=$work/pki" >/dev/null 2>&1; do
		if ! kill -0 "$pid" 2>/dev/null; then
			echo "server did not start:" >&2
			cat "$log" >&2
			exit 1
		fi
		sleep 0.05
	done
}

# fio_tls ARGS...: fio with libnbd's default certificate directory holding
# the client certificate of $work/pki. fio 3.33's nbd engine cannot take
# tls-certificates in its URI (libnbd refuses local files there), so fio
# finds it in $HOME/.pki/libnbd for a fresh HOME, running as nobody when
# run as root (root's is /etc/pki/libnbd).
fio_tls() {
	local home=$work/home
	if [ ! -d "$home" ]; then
		mkdir -p "$home/.pki/libnbd"
		cp "$work/pki/ca-cert.pem" "$work/pki/client-cert.pem" "$work/pki/client-key.pem" "$home/.pki/libnbd/"
		if [ "$(id -u)" = 0 ]; then
			chmod 711 "$work"
			chown -R nobody "$home"
		fi
	fi
	if [ "$(id -u)" = 0 ]; then
		(cd "$home" && HOME=$home setpriv --reuid=nobody --regid=nogroup --clear-groups fio "$@")
	else
		HOME=$home fio "$@"
	fi
}

# bench_machine: the machine a run measures, as markdown lines.
bench_machine() {
	echo "machine: $(nproc) CPUs ($(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -1))," \
		"$(awk '/MemTotal/ {printf "%.0f GiB", $2 / 2^20}' /proc/meminfo), Linux $(uname -r)," \
		"backing files on $(df --output=fstype "${work:-.}" | tail -1)"
	echo "tools: $(fio --version), nbdkit $(nbdkit --version 2>/dev/null | cut -d' ' -f2)," \
		"qemu-nbd $(qemu-nbd --version | head -1 | cut -d' ' -f2), $(go version | cut -d' ' -f3)"
	echo "load average at the start: $(cut -d' ' -f1-3 /proc/loadavg)"
}

# cpu_ticks PID: the user + system CPU time PID has used, in clock ticks.
cpu_ticks() {
	# Fields 14 and 15 of /proc/PID/stat, counted after the command name,
	# which is in parentheses and may contain spaces.
	sed 's/.*) //' "/proc/$1/stat" | awk '{print $12 + $13}'
}

# task_ticks: a line "PID TICKS" for every process on the machine, kernel
# threads included: user + system CPU, in clock ticks, a process's exited
# threads included. The difference of two snapshots, over the processes
# alive at the second, is what the machine spent between them on all but
# processes that ended in between (fio, started after the first and gone
# before the second, is not in it): the server and the kernel's worker
# threads that run work on its behalf, such as a sync queued to a
# workqueue, which the server's own figure does not include.
task_ticks() {
	local p
	for p in /proc/[0-9]*; do
		# A process may exit while it is read: sed then fails, which
		# pipefail would make this function's status.
		sed 's/.*) //' "$p/stat" 2>/dev/null | awk -v p="${p##*/}" '{print p, $12 + $13}' || true
	done
}

# guest_rounds TAG: reads a guest's log on stdin, whose result lines are
# "TAG CASE IOPS X A B" (one per case and round), and prints one line per
# case, in order of first appearance: "CASE MEDIAN_IOPS SUM_A SUM_B
# ROUNDS", ROUNDS being each round's IOPS joined by commas.
guest_rounds() {
	tr -d '\r' | awk -v tag="$1" '
		function median(c,   k, i, j, t, a) {
			k = runs[c]
			for (i = 1; i <= k; i++) a[i] = iops[c, i]
			for (i = 1; i <= k; i++) for (j = i + 1; j <= k; j++) if (a[j] < a[i]) { t = a[i]; a[i] = a[j]; a[j] = t }
			return k % 2 ? a[(k + 1) / 2] : (a[k / 2] + a[k / 2 + 1]) / 2
		}
		$1 == tag {
			c = $2
			if (!(c in runs)) name[n++] = c
			runs[c]++
			iops[c, runs[c]] = $3; sa[c] += $5; sb[c] += $6
			all[c] = all[c] (all[c] == "" ? "" : ",") $3
		}
		END {
			for (i = 0; i < n; i++) {
				c = name[i]
				printf "%s %d %d %d %s\n", c, median(c), sa[c], sb[c], all[c]
			}
		}'
}
