#!/usr/bin/env bash
# Runs GPU test binaries on a lent GPU machine, one log per binary, and prints a table.
# Usage (on the GPU machine, after `source .devbundle/env.sh`):
#   deploy/gpu-tests.sh OUTDIR BINARY...      # binaries by name, found on PATH
# Each binary writes OUTDIR/<binary>.log (and its oracle tables, through MEGACPP_RESULTS_DIR);
# the exit status is the number of binaries that failed.
set -uo pipefail
out=$1; shift
mkdir -p "$out"
failed=0
printf '%-44s %6s %10s\n' binary status ms > "$out/summary.txt"
for binary in "$@"; do
  start=$(date +%s%N)
  MEGACPP_RESULTS_DIR="$out" timeout 300 "$binary" --gtest_brief=1 > "$out/$binary.log" 2>&1
  status=$?
  end=$(date +%s%N)
  [ "$status" -ne 0 ] && failed=$((failed + 1))
  printf '%-44s %6s %10d\n' "$binary" "$status" $(((end - start) / 1000000)) >> "$out/summary.txt"
done
cat "$out/summary.txt"
exit "$failed"
