#!/usr/bin/env bash
# The main job: builds megacpp, turns the C++ headers under /usr/include into a
# byte-level dataset, trains the `tiny` preset on the CPU (at most ~3 minutes),
# and evaluates the final checkpoint against the validation split.
set -euo pipefail
cd "$(dirname "$0")/.."
bash deploy/install-deps.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release > /dev/null
cmake --build build -j "$(nproc)" --target megacpp
cli=build/bin/megacpp

headers=${MEGACPP_DEMO_CORPUS:-$(ls -d /usr/include/c++/*/ | sort -V | tail -n 1)}
$cli data prepare --input "$headers" --output data/cxx --seed 1 --valid-fraction 0.05
$cli data stats data/cxx_valid
rm -rf runs/tiny
$cli train configs/tiny_cpu.json
latest=runs/tiny/$(cat runs/tiny/latest)
$cli eval --checkpoint "$latest" --data data/cxx_valid --seqlen 256 --batch 8
