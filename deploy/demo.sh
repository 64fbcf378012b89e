#!/usr/bin/env bash
# The main job: builds megacpp, starts the daemon (megacppd) with its embedded
# receipt store, turns the C++ headers under /usr/include into a byte-level
# dataset, submits the `tiny` training job (on the GPU when the daemon has one, else the
# CPU; at most ~3 minutes), watches it
# to the end, evaluates the final checkpoint on the whole validation split and
# prints the run summary from the receipt store. Then stops the daemon.
set -euo pipefail
cd "$(dirname "$0")/.."
bash deploy/install-deps.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release > /dev/null
cmake --build build -j "$(nproc)" --target megacpp megacppd megacpp-executor
bin=build/bin

headers=${MEGACPP_DEMO_CORPUS:-$(ls -d /usr/include/c++/*/ | sort -V | tail -n 1)}
$bin/megacpp data prepare --input "$headers" --output data/cxx --seed 1 --valid-fraction 0.05
$bin/megacpp data stats data/cxx_valid

rm -rf state
mkdir -p state
$bin/megacppd --config configs/daemon.json > state/megacppd.log 2>&1 &
daemon=$!
trap 'kill -TERM $daemon 2>/dev/null; wait $daemon 2>/dev/null || true' EXIT
for _ in $(seq 1 100); do
  [ -f state/daemon.json ] && break
  kill -0 $daemon 2>/dev/null || { cat state/megacppd.log; exit 1; }
  sleep 0.1
done
export MEGACPP_DAEMON=127.0.0.1:50551
$bin/megacpp status

# A cuda job when the daemon found a GPU (a build with CUDA on a machine with a driver).
kind=cpu
if $bin/megacpp status | grep -q '^  cuda:'; then kind=cuda; fi
job=$($bin/megacpp submit --device-kind "$kind" configs/tiny_job.json)
echo "submitted $job"
$bin/megacpp watch "$job"
$bin/megacpp receipts gates "$job"
if [ "$kind" = cuda ]; then $bin/megacpp receipts kernels "$job"; fi
$bin/megacpp receipts runs "$job"
latest=state/checkpoints/$job/$(cat "state/checkpoints/$job/latest")
$bin/megacpp eval --checkpoint "$latest" --data data/cxx_valid --seqlen 256 --batch 8
