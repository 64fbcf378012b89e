#!/usr/bin/env bash
# Builds the libFuzzer targets (cmake/fuzz.cmake) in build-fuzz with clang, ASan and UBSan, and
# runs each for SECONDS (default 20) from a scratch copy of its seed corpus in
# bench/fuzz/corpus/<target>/, so the committed corpus never grows. The targets run side by side;
# the script fails if any of them met a crash, leak, timeout or sanitizer report, leaving the
# input in build-fuzz/fuzz-artifacts/.
#
#   bash bench/fuzz/run.sh [SECONDS] [TARGET...]     targets: all by default
#   MEGACPP_FUZZ_RUNS=1000000 bash bench/fuzz/run.sh 0 safetensors    a fixed number of inputs
#
# MEGACPP_FUZZ_JOBS sets the build parallelism and how many targets run at once (default: nproc);
# CXX_FUZZ the compiler (default clang++-14).
set -euo pipefail
cd "$(dirname "$0")/../.."

seconds=${1:-20}
shift || true
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
  targets=(job_spec daemon_config safetensors indexed_dataset event_stream plan_cache)
fi

parallel=${MEGACPP_FUZZ_JOBS:-$(nproc)}
if ! [[ "$parallel" =~ ^[0-9]+$ ]] || [ "$parallel" -lt 1 ]; then
  echo "fuzz: MEGACPP_FUZZ_JOBS must be a whole number of at least 1, not '$parallel'" >&2
  exit 2
fi

launcher=()
if command -v ccache >/dev/null; then launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache); fi
# -O1 with line tables: fast enough to fuzz, quick to compile, stack traces with lines. Not
# CMake's RelWithDebInfo flags, which define NDEBUG and so would drop the libraries' asserts.
cmake -S . -B build-fuzz -G Ninja -DCMAKE_CXX_COMPILER="${CXX_FUZZ:-clang++-14}" \
  -DMEGACPP_FUZZ=ON -DMEGACPP_CUDA=OFF -DMEGACPP_BUILD_TESTS=OFF -DMEGACPP_BUILD_BENCH=OFF \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -gline-tables-only" \
  "${launcher[@]}" >/dev/null
build_targets=()
for t in "${targets[@]}"; do build_targets+=("${t}_fuzz"); done
cmake --build build-fuzz --target "${build_targets[@]}" -j "$parallel"

work=$(mktemp -d)
# The harnesses' scratch files, in memory where possible (see fuzz_support.h).
scratch=$(mktemp -d -p /dev/shm megacpp-fuzz-run.XXXXXX 2>/dev/null || mktemp -d)
export MEGACPP_FUZZ_SCRATCH="$scratch"
# The targets' runs, each a process group of its own (set -m below): on any exit the trap stops
# whichever still run, fuzzer and all, before their scratch goes.
running_groups=()
stop_and_clean() {
  for group in "${running_groups[@]}"; do kill -- "-$group" 2>/dev/null || true; done
  rm -rf "$work" "$scratch"
}
trap stop_and_clean EXIT
artifacts="$PWD/build-fuzz/fuzz-artifacts"
mkdir -p "$artifacts"
limit=(-max_total_time="$seconds")
if [ -n "${MEGACPP_FUZZ_RUNS:-}" ]; then limit+=(-runs="$MEGACPP_FUZZ_RUNS"); fi

# One target's run: its summary line in $work/$t/summary, its status in $work/$t/status.
fuzz_one() {
  local t=$1
  local binary="$PWD/build-fuzz/fuzz/${t}_fuzz"
  local seeds="bench/fuzz/corpus/$t"
  mkdir -p "$work/$t"
  cp -r "$seeds" "$work/$t/corpus"
  local dict=()
  if [ -f "bench/fuzz/$t.dict" ]; then dict=(-dict="$PWD/bench/fuzz/$t.dict"); fi
  local log="$work/$t/log" status started elapsed execs rate corpus
  # -timeout: one input running this long is a hang, not a slow machine (inputs take
  # milliseconds). -rss_limit_mb also caps single allocations: a parser sized by a hostile
  # header must not reach for gigabytes.
  started=$(date +%s)
  if (cd "$work/$t" && "$binary" "${limit[@]}" -timeout=25 -rss_limit_mb=2048 \
      -print_final_stats=1 -artifact_prefix="$artifacts/$t-" "${dict[@]}" corpus >"$log" 2>&1); then
    status=ok
  else
    status=FAILED
  fi
  elapsed=$(($(date +%s) - started))
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log")
  rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log")
  corpus=$(find "$work/$t/corpus" -type f | wc -l)
  printf 'fuzz %-16s %s: %s execs, %s exec/s, %s s, corpus %s -> %s files\n' "$t" "$status" \
    "${execs:-?}" "${rate:-?}" "$elapsed" "$(find "$seeds" -type f | wc -l)" "$corpus" \
    >"$work/$t/summary"
  echo "$status" >"$work/$t/status"
}

for t in "${targets[@]}"; do
  [ -d "bench/fuzz/corpus/$t" ] || { echo "fuzz: no seed corpus bench/fuzz/corpus/$t" >&2; exit 2; }
done
# The targets run side by side, one a core (MEGACPP_FUZZ_JOBS): each is one process, and a
# time-limited run does as much on a loaded machine, only with fewer inputs. A run's result is
# its status file (a run that stopped before writing it failed), not its exit status.
set -m
running=0
for t in "${targets[@]}"; do
  if [ "$running" -ge "$parallel" ]; then
    wait -n || true
    running=$((running - 1))
  fi
  fuzz_one "$t" &
  running_groups+=("$!")
  running=$((running + 1))
done
wait || true
running_groups=()
set +m

failed=()
for t in "${targets[@]}"; do
  status=$(cat "$work/$t/status" 2>/dev/null || echo FAILED)
  cat "$work/$t/summary" 2>/dev/null || echo "fuzz $t: stopped before its summary"
  if [ "$status" != ok ]; then
    failed+=("$t")
    grep -E 'fuzz: BUG|ERROR|runtime error|SUMMARY|Test unit written' "$work/$t/log" 2>/dev/null |
      head -20 >&2 || true
    tail -40 "$work/$t/log" >&2 2>/dev/null || true
  fi
done

if [ ${#failed[@]} -gt 0 ]; then
  echo "fuzz: FAILED: ${failed[*]} (inputs in $artifacts)" >&2
  exit 1
fi
echo "fuzz: ${#targets[@]} targets, no crashes"
