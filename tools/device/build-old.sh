#!/usr/bin/env bash
# Builds the strata binary of each commit given (in a worktree under
# /tmp/strata-old, its own target directory) and keeps it stripped and
# xz-compressed in .carry-cache/old/COMMIT.xz (about 1 MB each), for
# tools/device/compare.sh to time side by side with HEAD on the device.
# Copy the ones a run needs into .carry/old/ after tools/device/pack.sh
# (XZ_BIN=1 leaves room for them). Runs cargo.
#   tools/device/build-old.sh a4334b6 992a138 ...
set -euo pipefail
cd "$(dirname "$0")/../.."
root=$PWD; wt=/tmp/strata-old
mkdir -p .carry-cache/old
[ -d $wt ] || git worktree add -f --detach $wt HEAD >/dev/null
for c in "$@"; do
  id=$(git rev-parse --short=7 "$c")
  [ -f .carry-cache/old/$id.xz ] && { echo "$id: already built"; continue; }
  git -C $wt checkout -q --detach "$id"
  echo "$id: building ($(git log -1 --format=%s "$id" | cut -c1-70))"
  (cd $wt && STRATA_CPU_VARIANTS=portable cargo build --release --bin strata >/tmp/build-old-$id.log 2>&1) \
    || { echo "$id: build failed, see /tmp/build-old-$id.log"; continue; }
  strip -o /tmp/strata-$id $wt/target/release/strata
  xz -T2 -9 -c /tmp/strata-$id > "$root/.carry-cache/old/$id.xz"
  rm -f /tmp/strata-$id
done
ls -la .carry-cache/old
