#!/usr/bin/env bash
# Builds megacpp (with the CUDA code wherever nvcc exists) and runs every test.
# GPU tests run where a GPU is present and show as skipped elsewhere. A second,
# CPU-only build with AddressSanitizer and UndefinedBehaviorSanitizer runs the
# kernel, runtime and store tests again (MEGACPP_SKIP_SANITIZE=1 skips it); the
# daemon's integration tests run only in the first pass.
set -euo pipefail
cd "$(dirname "$0")/.."
bash deploy/install-deps.sh
jobs=$(nproc)

cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release
cmake --build build -j "$jobs"
ctest --test-dir build --output-on-failure -j "$jobs"

if [ "${MEGACPP_SKIP_SANITIZE:-0}" != 1 ]; then
  cmake -S . -B build-sanitize -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DMEGACPP_CUDA=OFF \
    -DMEGACPP_SANITIZE=ON -DMEGACPP_BUILD_BENCH=OFF "-DMEGACPP_TEST_DIRS=^(kernels/cpu|runtime|receipts)/"
  cmake --build build-sanitize -j "$jobs"
  ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
    ctest --test-dir build-sanitize --output-on-failure -j "$jobs" -L cpu
fi
