# bash completion for nbdmapper(8): verbs, each verb's flags (asked of the
# binary itself, so they never go stale), export names from `nbdmapper ls`,
# table files, and /dev/nbdX devices.

_nbdmapper_verbs="serve create remove reload suspend resume clear table info ls message check status wait attach detach version help"

# _nbdmapper_flags VERB: the flags VERB --help lists, as --name.
_nbdmapper_flags() {
	"$1" "$2" --help 2>/dev/null | sed -n 's/^  -\([a-z][a-z0-9-]*\).*/--\1/p'
}

# _nbdmapper_exports: the devices of the running server, through the
# control socket given on the command line, if any.
_nbdmapper_exports() {
	local control=() i
	for ((i = 1; i < ${#COMP_WORDS[@]} - 1; i++)); do
		case ${COMP_WORDS[i]} in
		--control=* | -control=*) control=("${COMP_WORDS[i]}") ;;
		--control | -control) control=(--control "${COMP_WORDS[i + 1]}") ;;
		esac
	done
	"$1" ls "${control[@]}" 2>/dev/null | awk '{print $1}'
}

_nbdmapper() {
	local cur prev bin verb i nargs=0
	cur=${COMP_WORDS[COMP_CWORD]}
	prev=${COMP_WORDS[COMP_CWORD - 1]}
	bin=${COMP_WORDS[0]}
	COMPREPLY=()
	if ((COMP_CWORD == 1)); then
		mapfile -t COMPREPLY < <(compgen -W "$_nbdmapper_verbs --help --version" -- "$cur")
		return
	fi
	verb=${COMP_WORDS[1]}
	case $prev in
	--socket | --tls-cert | --tls-key | --tls-ca | --metrics-web-config | --cpuprofile | --password-file | --control)
		mapfile -t COMPREPLY < <(compgen -f -- "$cur")
		return
		;;
	--tables)
		mapfile -t COMPREPLY < <(compgen -d -- "$cur")
		return
		;;
	--tls)
		mapfile -t COMPREPLY < <(compgen -W "off on require" -- "$cur")
		return
		;;
	--export)
		mapfile -t COMPREPLY < <(compgen -W "$(_nbdmapper_exports "$bin")" -- "$cur")
		return
		;;
	esac
	if [[ $cur == -* ]]; then
		mapfile -t COMPREPLY < <(compgen -W "$(_nbdmapper_flags "$bin" "$verb") --help" -- "$cur")
		return
	fi
	# nargs: the arguments before this one that are not flags (a flag
	# with a separate value counts its value as a flag's).
	for ((i = 2; i < COMP_CWORD; i++)); do
		case ${COMP_WORDS[i]} in
		--*=* | --inactive | --force | --connect | --read-only | --table) ;;
		-*) ((i++)) ;;
		*) ((nargs++)) ;;
		esac
	done
	case $verb in
	help)
		mapfile -t COMPREPLY < <(compgen -W "$_nbdmapper_verbs" -- "$cur")
		;;
	remove | suspend | resume | clear | table | info | message | wait)
		((nargs == 0)) && mapfile -t COMPREPLY < <(compgen -W "$(_nbdmapper_exports "$bin")" -- "$cur")
		;;
	create | reload)
		if ((nargs == 0)); then
			mapfile -t COMPREPLY < <(compgen -W "$(_nbdmapper_exports "$bin")" -- "$cur")
		else
			mapfile -t COMPREPLY < <(compgen -f -- "$cur")
		fi
		;;
	check)
		mapfile -t COMPREPLY < <(compgen -f -- "$cur")
		;;
	serve)
		# NAME=TABLE_FILE: complete the file after the =.
		if [[ $cur == *=* ]]; then
			mapfile -t COMPREPLY < <(compgen -P "${cur%%=*}=" -f -- "${cur#*=}")
		fi
		;;
	attach | detach)
		mapfile -t COMPREPLY < <(compgen -G "/dev/nbd*" -- "$cur" | grep -E '^/dev/nbd[0-9]+$')
		;;
	esac
}
complete -o default -F _nbdmapper nbdmapper
