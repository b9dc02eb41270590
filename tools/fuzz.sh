#!/usr/bin/env bash
# Runs the mutation fuzzer (tests/fuzz.rs) for a while: windows of CASES
# seeds (default 2000) per input kind (half for checkpoints), a fresh window each round, until
# SECONDS (default 3600) have passed. Stops at the first failing case and
# prints it (the seed reproduces it: STRATA_FUZZ_SEED=N STRATA_FUZZ_CASES=1).
#   tools/fuzz.sh [SECONDS]
set -uo pipefail
cd "$(dirname "$0")/.."
export PATH="$HOME/.cargo/bin:$PATH"
secs=${1:-3600}; cases=${CASES:-2000}; seed=${SEED:-1000000}
cargo build --release --tests -q || exit 1
end=$((SECONDS + secs)); rounds=0; total=0
while [ $SECONDS -lt $end ]; do
  log=$(STRATA_FUZZ_SEED=$seed STRATA_FUZZ_CASES=$cases cargo test --release -q --test fuzz -- --nocapture --test-threads 1 2>&1)
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
