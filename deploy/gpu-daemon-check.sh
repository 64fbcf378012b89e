#!/usr/bin/env bash
# On a GPU machine (after `source .devbundle/env.sh`): megacppd takes the machine's GPUs, a cuda
# job of the tiny preset trains through it to the end (receipts printed), then a second cuda job's
# executor is killed with SIGKILL: the daemon must stay healthy, record the failure, and give the
# GPU to a third job, which must succeed. Logs and receipts go to OUTDIR.
# Usage: deploy/gpu-daemon-check.sh OUTDIR [STEPS]
set -euo pipefail
out=$(realpath -m "$1")
steps=${2:-300}
mkdir -p "$out"
cd "$(dirname "$0")/.."
source deploy/start-daemon.sh
# The corpus: this repository's own sources (every GPU machine has them with the working tree).
fresh_corpus gpu-check runtime "$out"
spec() {  # STEPS NAME
  cat <<JSON
{"name": "$2", "preset": "tiny", "device_kind": "cuda",
 "train_data": "$PWD/data/gpu-check_train", "valid_data": "$PWD/data/gpu-check_valid",
 "steps": $1, "batch": 8, "seqlen": 256, "eval_interval": 50, "eval_batches": 8,
 "checkpoint_interval": 100, "seed": "1234",
 "optimizer": {"lr": 0.003, "min_lr": 0.0003, "warmup_steps": 20, "grad_clip": 1.0}}
JSON
}
spec "$steps" "gpu check" > "$out/job.json"
spec 100000 "to be killed" > "$out/killed.json"
spec 50 "after the kill" > "$out/after.json"

start_megacppd "$out/megacppd.log"
megacpp status | tee "$out/status-before.txt"

job=$(megacpp submit "$out/job.json")
megacpp watch "$job" > "$out/watch.log" 2>&1 || true
megacpp job "$job" | tee "$out/job.txt"
megacpp receipts gates "$job" > "$out/gates.txt" 2>&1 || true
megacpp receipts runs "$job" > "$out/runs.txt" 2>&1 || true
megacpp receipts kernels "$job" > "$out/kernels.txt" 2>&1 || true
cp "state/jobs/$job/executor.log" "$out/executor.log" 2>/dev/null || true

victim=$(megacpp submit "$out/killed.json")
for _ in $(seq 1 600); do
  pid=$(pgrep -f "megacpp-executor --job .*$victim" || true)
  [ -n "$pid" ] && grep -q '"type": *"step"\|step' "state/jobs/$victim/executor.log" 2>/dev/null && break
  sleep 0.1
done
sleep 2
echo "killing executor $pid of $victim" | tee "$out/kill.txt"
kill -KILL "$pid"
sleep 3
megacpp job "$victim" | tee -a "$out/kill.txt"
megacpp status | tee "$out/status-after-kill.txt"
after=$(megacpp submit "$out/after.json")
megacpp watch "$after" > "$out/watch-after.log" 2>&1 || true
megacpp job "$after" | tee "$out/after.txt"
echo "daemon alive: $(kill -0 $daemon && echo yes)" | tee -a "$out/after.txt"
