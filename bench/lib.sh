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
#   bench_machine              prints the machine, tools and load average.
#   cpu_ticks PID              prints PID's user + system CPU in clock ticks.

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
	trap 'kill $(jobs -p) 2>/dev/null || true; wait 2>/dev/null; rm -rf "$work"' EXIT
	if [ -n "${NBDMAPPER_BIN:-}" ]; then
		cp "$NBDMAPPER_BIN" "$work/nbdmapper"
	else
		go build -o "$work/nbdmapper" ./cmd/nbdmapper
	fi
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
