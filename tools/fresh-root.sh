#!/usr/bin/env bash
# Runs the README's quick start as a new user would, on a fresh machine: a
# clean Debian root made by mmdebstrap from Debian's packages (variant
# minbase: no compiler, no cmake, no python), holding a clean clone of this
# repository's HEAD and the Rust toolchain such a machine comes with (copied
# from this one; rustup's own server is not reachable from here). In it,
# `tools/demo.sh`, then (with `test` or `both`) `tools/test.sh`, each timed.
# Needs root (mount, chroot). Times and logs go to DIR/results/.
#   tools/fresh-root.sh [DIR] [demo|test|both]      (default /tmp/strata-fresh, demo)
#   REF=COMMIT tools/fresh-root.sh ...                an older commit instead of HEAD
# SUITE (default bookworm) and MIRROR pick the Debian release and mirror.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
root=${1:-/tmp/strata-fresh}
what=${2:-demo}
suite=${SUITE:-bookworm}
mirror=${MIRROR:-http://deb.debian.org/debian}
command -v mmdebstrap >/dev/null || { apt-get update -qq && apt-get install -y -qq mmdebstrap >/dev/null; }

cleanup() {
  for m in dev/pts dev proc sys; do umount -l "$root/$m" 2>/dev/null || true; done
}
trap cleanup EXIT
cleanup
rm -rf "$root"
echo "fresh-root: mmdebstrap --variant=minbase $suite into $root" >&2
mmdebstrap --quiet --variant=minbase "$suite" "$root" "$mirror"
cp /etc/resolv.conf "$root/etc/resolv.conf"
# the local certificate authorities of this machine's network (a TLS proxy
# may sit between it and the registries); ca-certificates picks them up
# when setup.sh installs it
if ls /usr/local/share/ca-certificates/*.crt >/dev/null 2>&1; then
  mkdir -p "$root/usr/local/share/ca-certificates"
  cp /usr/local/share/ca-certificates/*.crt "$root/usr/local/share/ca-certificates/"
fi
mount -t proc proc "$root/proc"
mount -t sysfs sys "$root/sys"
mount --bind /dev "$root/dev"
mount --bind /dev/pts "$root/dev/pts"

# the machine's Rust toolchain, as rustup installed it: the default
# toolchain and the proxies
rustup_home=${RUSTUP_HOME:-$HOME/.rustup}
tc=$(rustup show active-toolchain | cut -d' ' -f1)
mkdir -p "$root/root/.rustup/toolchains" "$root/root/.cargo/bin"
cp "$rustup_home/settings.toml" "$root/root/.rustup/"
cp -a "$rustup_home/toolchains/$tc" "$root/root/.rustup/toolchains/"
for b in cargo rustc rustup rustdoc; do cp -a "${CARGO_HOME:-$HOME/.cargo}/bin/$b" "$root/root/.cargo/bin/"; done

# a clean clone of HEAD, as CI gets it
git clone -q "$repo" "$root/root/strata"
ref=$(git -C "$repo" rev-parse --short "${REF:-HEAD}")
git -C "$root/root/strata" checkout -q "$ref"
mkdir -p "$root/results"
echo "fresh-root: $ref, toolchain $tc" > "$root/results/info.txt"

in_root() {
  chroot "$root" /usr/bin/env -i HOME=/root TERM=dumb PATH=/root/.cargo/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    /bin/bash -c "cd /root/strata && $1"
}
timed() {
  local name=$1 cmd=$2 t0 rc
  t0=$(date +%s)
  set +e
  in_root "$cmd" > "$root/results/$name.log" 2>&1
  rc=$?
  set -e
  echo "$name: exit $rc after $(( $(date +%s) - t0 )) s ($cmd)" | tee -a "$root/results/info.txt"
  return $rc
}
timed demo "tools/demo.sh"
tail -4 "$root/results/demo.log"
if [ "$what" = test ] || [ "$what" = both ]; then
  timed test "tools/test.sh"
  tail -4 "$root/results/test.log"
fi
cat "$root/results/info.txt"
