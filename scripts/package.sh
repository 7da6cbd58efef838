#!/usr/bin/env bash
# Builds nbdmapper's Debian package with dpkg-deb, from this checkout:
#
#   /usr/sbin/nbdmapper                     the binary (version from git)
#   /usr/lib/systemd/system/                deploy/systemd's units, run from /usr/sbin
#   /usr/share/man/man8/nbdmapper.8.gz      docs/man, rendered with go-md2man
#   /usr/share/man/man5/nbdmapper-table.5.gz
#   /usr/share/bash-completion/completions/nbdmapper, /usr/share/zsh/vendor-completions/_nbdmapper
#   /usr/share/doc/nbdmapper/examples/example.table
#   /etc/nbdmapper/tables/                  what nbdmapper.service serves (--tables)
#
# usage: scripts/package.sh [OUTDIR]   (default dist/); prints the .deb's path.
# Needs go, go-md2man and dpkg-dev. The version is the tag vX.Y.Z at HEAD, or
# else 0~gitYYYYMMDDHHMMSS.REV from HEAD's commit; NBDMAPPER_VERSION overrides
# it (a source tree without git needs it).
set -euo pipefail
cd "$(dirname "$0")/.."
out=$(realpath -m "${1:-dist}")

if [ -n "${NBDMAPPER_VERSION:-}" ]; then
	version=$NBDMAPPER_VERSION
elif tag=$(git describe --tags --exact-match --match 'v[0-9]*' 2>/dev/null); then
	version=${tag#v}
else
	version="0~git$(TZ=UTC git log -1 --format=%cd --date=format-local:%Y%m%d%H%M%S).$(git rev-parse --short=12 HEAD)"
fi
arch=$(dpkg --print-architecture)
goarch=$(go env GOARCH)
case $arch in
amd64 | arm64 | riscv64 | ppc64el | s390x) ;;
*) echo "scripts/package.sh: architecture $arch not packaged" >&2; exit 1 ;;
esac

root=$(mktemp -d)
trap 'rm -rf "$root"' EXIT
pkg=$root/nbdmapper
doc=$pkg/usr/share/doc/nbdmapper
install -d -m 0755 "$pkg/DEBIAN" "$pkg/usr/sbin" "$pkg/usr/lib/systemd/system" \
	"$pkg/usr/share/man/man8" "$pkg/usr/share/man/man5" \
	"$pkg/usr/share/bash-completion/completions" "$pkg/usr/share/zsh/vendor-completions" \
	"$doc/examples" "$pkg/etc/nbdmapper/tables"

# A static binary: no libc to depend on; the build
# info (nbdmapper version) keeps the VCS revision where git has it.
CGO_ENABLED=0 GOARCH=$goarch go build -trimpath -buildvcs=auto \
	-ldflags='-s -w' -o "$pkg/usr/sbin/nbdmapper" ./cmd/nbdmapper

for unit in deploy/systemd/*.service deploy/systemd/*.socket; do
	sed 's|/usr/local/bin/nbdmapper|/usr/sbin/nbdmapper|g' "$unit" >"$pkg/usr/lib/systemd/system/$(basename "$unit")"
	chmod 0644 "$pkg/usr/lib/systemd/system/$(basename "$unit")"
done

for page in docs/man/*.md; do
	name=$(basename "$page" .md) # nbdmapper.8
	go-md2man -in "$page" -out "$root/$name"
	gzip -9n <"$root/$name" >"$pkg/usr/share/man/man${name##*.}/$name.gz"
done

install -m 0644 deploy/completion/nbdmapper.bash "$pkg/usr/share/bash-completion/completions/nbdmapper"
install -m 0644 deploy/completion/_nbdmapper "$pkg/usr/share/zsh/vendor-completions/_nbdmapper"
install -m 0644 deploy/example.table "$doc/examples/example.table"
install -m 0644 scripts/debian/copyright "$doc/copyright"
printf 'nbdmapper (%s) unstable; urgency=medium\n\n  * Built from %s.\n\n -- nbdmapper developers <nbdmapper@users.noreply.github.com>  %s\n' \
	"$version" "$(git rev-parse HEAD 2>/dev/null || echo "a source tree")" \
	"$(date -R -u -d "@$(git log -1 --format=%ct 2>/dev/null || date +%s)")" | gzip -9n >"$doc/changelog.gz"
install -m 0644 scripts/debian/lintian-overrides -D "$pkg/usr/share/lintian/overrides/nbdmapper"
install -m 0755 scripts/debian/postinst scripts/debian/prerm scripts/debian/postrm "$pkg/DEBIAN/"

size=$(du -sk --exclude=DEBIAN "$pkg" | cut -f1)
sed -e "s/@VERSION@/$version/" -e "s/@ARCH@/$arch/" -e "s/@SIZE@/$size/" scripts/debian/control >"$pkg/DEBIAN/control"
(cd "$pkg" && find . -path ./DEBIAN -prune -o -type f -printf '%P\n' | LC_ALL=C sort | xargs md5sum) >"$pkg/DEBIAN/md5sums"
chmod 0644 "$pkg/DEBIAN/control" "$pkg/DEBIAN/md5sums"

mkdir -p "$out"
deb=$out/nbdmapper_${version}_$arch.deb
dpkg-deb --root-owner-group -Zxz --build "$pkg" "$deb" >/dev/null
echo "$deb"
