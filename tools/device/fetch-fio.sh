#!/usr/bin/env bash
# Fetches Debian's fio for a GPU machine without network or apt, into
# .carry-cache/fio/ (ignored by git; tools/device/pack.sh copies it into
# .carry/fio/, tools/device/dram.sh runs it):
#   tools/device/fetch-fio.sh            (FORCE=1 refetches)
#
#   bin/fio      fio from the Debian package (apt-get download + dpkg-deb -x)
#   lib/         libaio.so.1 and libnuma.so.1 from their Debian packages, and
#                stub libraries for fio's other dependencies (see below)
#   run-fio      wrapper: LD_LIBRARY_PATH=lib exec bin/fio "$@"
#   MANIFEST     packages, versions and sizes
#
# Debian links fio against the libraries of every engine it builds (ceph
# rbd/rados, glusterfs, libnbd, rdma, pmem): with their own dependencies
# that is about 80 MB (libceph-common, ICU, gnutls, boost...), beyond the
# 64 MiB carry limit. Those engines are never used here (io_uring, libaio,
# psync are), and fio only calls into them when such an engine is chosen, so
# each of those libraries is replaced by a stub with the same soname and
# symbol versions whose functions print "<lib> is a stub" and abort. fio's
# own registration code does not call them. Left to the base system: libc,
# libm, libz (zlib1g is Essential on Debian and Ubuntu). fio 3.33 (bookworm)
# needs glibc >= 2.34, like strata's own binaries built here.
#
# Idempotent: does nothing when the cache is complete (FORCE=1 refetches).
# Needs apt-get, dpkg-deb, readelf, strip and a C compiler (cc).
set -euo pipefail
cd "$(dirname "$0")/../.."
dest=.carry-cache/fio
# Libraries that fio needs and that are small enough to carry for real.
real_pkgs=(libaio1 libnuma1)
# Libraries left to the base system.
base_re='^(libc\.so\.6|libm\.so\.6|libz\.so\.1|ld-linux-x86-64\.so\.2|libdl\.so\.2|libpthread\.so\.0|librt\.so\.1)$'

if [ -z "${FORCE:-}" ] && [ -x $dest/bin/fio ] && [ -x $dest/run-fio ] && [ -f $dest/MANIFEST ]; then
  cat $dest/MANIFEST
  echo "(cached; FORCE=1 to refetch)"
  exit 0
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/debs" "$work/root" "$work/out/bin" "$work/out/lib" "$work/stubs"

# apt-get download writes into the current directory; it warns (harmlessly)
# that it runs unsandboxed when root cannot hand the directory to _apt.
download() {
  (cd "$work/debs" && apt-get download "$@" 2>&1 | grep -v -e '^W: Download is performed unsandboxed' >&2)
}
if ! download fio "${real_pkgs[@]}"; then
  echo "apt-get download failed; running apt-get update and retrying" >&2
  apt-get update -qq >&2
  download fio "${real_pkgs[@]}"
fi
for d in "$work"/debs/*.deb; do dpkg-deb -x "$d" "$work/root"; done

fio_src=$(find "$work/root" -path '*/bin/fio' -type f | head -1)
[ -n "$fio_src" ] || { echo "no bin/fio in the fio package" >&2; exit 1; }
strip --strip-unneeded -o "$work/out/bin/fio" "$fio_src"

# The real libraries: copied under their soname (dereferencing symlinks).
for soname in $(readelf -d "$fio_src" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p'); do
  [[ $soname =~ $base_re ]] && continue
  f=$(find "$work/root" -name "$soname" | head -1)
  if [ -n "$f" ]; then
    strip --strip-unneeded -o "$work/out/lib/$soname" "$(readlink -f "$f")"
  else
    echo "$soname" >>"$work/stubs/list"
  fi
done

# The stubs. fio's version needs (readelf -V) say which library defines
# which symbol version; its undefined dynamic symbols give the names. The
# unversioned ones are ceph's (rbd_*, rados_*) or zlib's (left to the base
# system).
readelf -V -W "$fio_src" | awk '
  /\.gnu\.version_r/ { on = 1 }
  on && /File:/ { for (i = 1; i <= NF; i++) if ($i == "File:") file = $(i + 1) }
  on && /Name:/ { for (i = 1; i <= NF; i++) if ($i == "Name:") print $(i + 1), file }
' >"$work/stubs/versions"
readelf --dyn-syms -W "$fio_src" | awk '$7 == "UND" && $5 == "GLOBAL" { print $4, $8 }' >"$work/stubs/undef"
while read -r soname; do
  base=${soname%%.so*}
  c="$work/stubs/$base.c"
  map="$work/stubs/$base.map"
  printf '#include <unistd.h>\n#include <stdlib.h>\nstatic void die(void) {\n  static const char m[] = "fio: %s is a stub (not carried to this machine); use io_uring, libaio or psync\\n";\n  write(2, m, sizeof m - 1);\n  abort();\n}\n' "$soname" >"$c"
  : >"$map"
  # versions this library must define, each with its symbols
  for v in $(awk -v f="$soname" '$2 == f { print $1 }' "$work/stubs/versions"); do
    syms=$(awk -v v="$v" '{ split($2, a, "@"); if (a[2] == v) print $1, a[1] }' "$work/stubs/undef")
    printf '%s {\n' "$v" >>"$map"
    while read -r type name; do
      [ -n "$name" ] || continue
      [ "$type" = FUNC ] || { echo "stub $soname: $name is $type, not a function" >&2; exit 1; }
      printf 'void %s(void) { die(); }\n' "$name" >>"$c"
      printf '  %s;\n' "$name" >>"$map"
    done <<<"$syms"
    printf '};\n' >>"$map"
  done
  # unversioned symbols by prefix
  case $base in
    librbd) prefix=rbd_ ;;
    librados) prefix=rados_ ;;
    *) prefix= ;;
  esac
  if [ -n "$prefix" ]; then
    awk -v p="^$prefix" '$2 !~ /@/ && $2 ~ p { print $1, $2 }' "$work/stubs/undef" |
      while read -r type name; do
        [ "$type" = FUNC ] || { echo "stub $soname: $name is $type, not a function" >&2; exit 1; }
        printf 'void %s(void) { die(); }\n' "$name" >>"$c"
      done
  fi
  flags=(-shared -fPIC -Os -s -Wl,-z,noseparate-code -Wl,-soname,"$soname")
  [ -s "$map" ] && flags+=(-Wl,--version-script="$map")
  cc "${flags[@]}" -o "$work/out/lib/$soname" "$c"
done < <(cat "$work/stubs/list" 2>/dev/null)

cat >"$work/out/run-fio" <<'EOF'
#!/bin/sh
# Runs the carried fio with its carried libraries (see tools/device/fetch-fio.sh).
d=$(cd "$(dirname "$0")" && pwd)
LD_LIBRARY_PATH="$d/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "$d/bin/fio" "$@"
EOF
chmod +x "$work/out/run-fio"

# Every symbol must resolve against the carried libraries and the base
# system (ldd -r reports the ones that do not).
if LD_LIBRARY_PATH="$work/out/lib" ldd -r "$work/out/bin/fio" 2>&1 | grep -e 'not found' -e 'undefined symbol'; then
  echo "fio does not resolve with the carried libraries" >&2
  exit 1
fi

{
  echo "fio for the device ($dest), from:"
  for d in "$work"/debs/*.deb; do
    printf '  %s %s (.deb %s bytes)\n' "$(dpkg-deb -f "$d" Package)" "$(dpkg-deb -f "$d" Version)" "$(stat -c %s "$d")"
  done
  echo "files:"
  (cd "$work/out" && find . -type f ! -name MANIFEST | sort | while read -r f; do
    kind=""
    case $f in ./lib/*) grep -qx "$(basename "$f")" "$work/stubs/list" 2>/dev/null && kind=" (stub)" ;; esac
    printf '  %-24s %8d bytes%s\n' "${f#./}" "$(stat -c %s "$f")" "$kind"
  done)
  echo "total: $(du -sk "$work/out" | cut -f1) KiB; fio version: $(LD_LIBRARY_PATH="$work/out/lib" "$work/out/bin/fio" --version)"
} >"$work/out/MANIFEST"

rm -rf "$dest"
mkdir -p "$(dirname "$dest")"
cp -r "$work/out" "$dest"
cat $dest/MANIFEST
