#!/usr/bin/env bash
# Builds the Debian package (cargo-deb), installs it, runs what it installed from the installed
# paths, verifies its systemd units, and removes it again. Run by .ci/run as root on Debian;
# by hand: `sudo packaging/check-package.sh`. Leaves the machine as it found it (the package
# removed, even when a check fails), except for cargo-deb, installed if it was missing.
set -euo pipefail
cd "$(dirname "$0")/.."

# A skip is said, and counted where .ci/run collects them (testkit::skip's log).
skip() {
  echo "SKIPPED packaging (needs $1): $2"
  [ -z "${CITRONFS_SKIP_LOG:-}" ] || printf '%s\tpackaging\t%s\n' "$1" "$2" >> "$CITRONFS_SKIP_LOG"
}
if ! command -v dpkg >/dev/null 2>&1; then
  skip other "no dpkg (not a Debian system)"
  exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
  skip root "installing the package needs root"
  exit 0
fi
if dpkg -s citronfs >/dev/null 2>&1; then
  echo "error: a citronfs package is installed already; not touching it" >&2
  exit 1
fi
command -v cargo-deb >/dev/null 2>&1 || cargo install cargo-deb --locked --version 3.8.0

deb=$(cargo deb -p tools --locked | tail -n 1)
echo "built $deb"
dpkg-deb --info "$deb" | sed -n '1,/Description/p'
dpkg-deb --contents "$deb"

trap 'dpkg -r citronfs >/dev/null 2>&1 || true' EXIT
dpkg -i "$deb"
/usr/bin/citronfs --version
/usr/bin/citronfs meta-server --help >/dev/null
# mount(8)'s helpers, as mount(8) calls them; -f checks the settings and mounts nothing.
work=$(mktemp -d)
trap 'dpkg -r citronfs >/dev/null 2>&1 || true; rm -rf "$work"' EXIT
printf 'secret\n' > "$work/token"
chmod 600 "$work/token"
mkdir "$work/mnt"
for helper in /sbin/mount.citronfs /sbin/mount.fuse.citronfs; do
  "$helper" 127.0.0.1:7700 "$work/mnt" -f -v -o "token_file=$work/token,cluster=check"
done
for f in /lib/systemd/system/citronfs-meta.service /lib/systemd/system/citronfs-data@.service \
  /usr/share/doc/citronfs/examples/meta.toml /usr/share/doc/citronfs/OPERATIONS.md; do
  [ -f "$f" ] || { echo "error: the package did not install $f" >&2; exit 1; }
done
if command -v systemd-analyze >/dev/null 2>&1; then
  systemd-analyze verify citronfs-meta.service citronfs-data@ds0.service
  echo "systemd-analyze verify: the units are valid"
else
  skip other "no systemd-analyze: the units were not verified"
fi
dpkg -r citronfs
rm -rf "$work"
trap - EXIT
[ ! -e /usr/bin/citronfs ] || { echo "error: dpkg -r left /usr/bin/citronfs" >&2; exit 1; }
echo "package: built, installed, run, verified and removed"
