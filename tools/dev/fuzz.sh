#!/usr/bin/env bash
# Runs the mutation fuzzer (tests/fuzz.rs) for a while: windows of CASES
# seeds (default 2000) per input kind (half for checkpoints), a fresh window each round, until
# SECONDS (default 3600) have passed. Stops at the first failing case and
# prints it (the seed reproduces it: STRATA_FUZZ_SEED=N STRATA_FUZZ_CASES=1).
#   [CASES=2000] [SEED=1000000] tools/dev/fuzz.sh [SECONDS]     (builds tests/fuzz.rs with cargo)
set -uo pipefail
cd "$(dirname "$0")/../.."
export PATH="$HOME/.cargo/bin:$PATH"
secs=${1:-3600}; cases=${CASES:-2000}; seed=${SEED:-1000000}
# one build, copied with its libraries and backend modules: later builds in
# this tree (edits while it runs) do not change what is being fuzzed
exe=$(cargo test --release --test fuzz --no-run 2>&1 | grep -o "(target/release/deps/fuzz-[0-9a-f]*)" | tr -d '()')
[ -x "$exe" ] || { echo "fuzz: could not build tests/fuzz.rs"; exit 1; }
bin=$(mktemp -d "${TMPDIR:-/tmp}/strata-fuzz.XXXXXX")
trap 'rm -rf "$bin"' EXIT
cp "$exe" "$bin/fuzz"; cp -P target/release/lib*.so* "$bin/"
export STRATA_FUZZ_LOG="$PWD/target/fuzz-current.txt"
end=$((SECONDS + secs)); rounds=0; total=0
while [ $SECONDS -lt $end ]; do
  log=$(STRATA_FUZZ_SEED=$seed STRATA_FUZZ_CASES=$cases "$bin/fuzz" --nocapture --test-threads 1 2>&1)
  rc=$?
  echo "$log" | grep -o "fuzz [a-z]*: .*"
  if [ $rc -ne 0 ]; then
    echo "$log" | tail -20
    echo "fuzz: failed in the window of seeds $seed..$((seed + cases)); the case running: $(cat target/fuzz-current.txt 2>/dev/null)"
    exit 1
  fi
  ran=$(echo "$log" | grep -o "fuzz [a-z]*: [0-9]* cases" | awk '{s += $3} END {print s + 0}')
  rounds=$((rounds + 1)); total=$((total + ran)); seed=$((seed + cases))
done
echo "fuzz: $rounds rounds, $total cases, no failure"
