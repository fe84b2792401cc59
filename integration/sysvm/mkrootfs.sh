#!/usr/bin/env bash
# Builds sysvm's guest root file system, a tarball of Debian 12 (bookworm) with systemd,
# with mmdebstrap: mkrootfs.sh OUT.tar (as root). The packages are rootfs.packages'.
# Packages come through the host's apt sources for bookworm, so a machine that reaches
# Debian only through a mirror builds it too.
set -euo pipefail
out=$1
here=$(dirname "$0")
pkgs=$(grep -v '^#' "$here/rootfs.packages" | xargs | tr ' ' ',')
mirrors=()
for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources; do
	[ -f "$f" ] && grep -Eq '^[^#]*(^|[[:space:]])bookworm([[:space:]]|$)' "$f" && mirrors+=("$f")
done
# No documentation, manuals or translations: a smaller image boots no slower and is
# built faster.
mmdebstrap --quiet --format=tar --variant=minbase --include="$pkgs" \
	--dpkgopt='path-exclude=/usr/share/man/*' \
	--dpkgopt='path-exclude=/usr/share/doc/*' \
	--dpkgopt='path-exclude=/usr/share/locale/*' \
	--dpkgopt='path-exclude=/usr/share/info/*' \
	bookworm "$out" "${mirrors[@]}"
