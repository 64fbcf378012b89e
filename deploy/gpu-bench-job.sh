#!/usr/bin/env bash
# On a GPU machine (after `source .devbundle/env.sh`): anchors.md's bench-350m at micro-batch
# 4 x 8192 submitted to megacppd as a cuda job. megacppd checks it at submit against the GPU's
# memory with the CUDA model's own plan (daemon/job_spec.cpp), so it is accepted on an 80 GB GPU
# and trains STEPS steps; the same job at batch 8 needs more than a GPU has and is refused at
# submit, with the numbers, before anything starts. Logs and receipts go to OUTDIR.
# Usage: deploy/gpu-bench-job.sh OUTDIR [STEPS] [PRESET]
set -euo pipefail
out=$(realpath -m "$1")
steps=${2:-5}
preset=${3:-bench-350m}
mkdir -p "$out"
cd "$(dirname "$0")/.."
source deploy/start-daemon.sh
# The corpus: this repository's tests (0.9 MB of byte tokens, ids below every vocabulary).
fresh_corpus gpu-bench tests "$out"
spec() {  # BATCH STEPS NAME
  cat <<JSON
{"name": "$3", "preset": "$preset", "device_kind": "cuda",
 "train_data": "$PWD/data/gpu-bench_train", "valid_data": "$PWD/data/gpu-bench_valid",
 "steps": $2, "batch": $1, "seqlen": 8192, "eval_interval": $2, "eval_batches": 1,
 "checkpoint_interval": 0, "seed": "1234", "optimizer": {"lr": 0.0003, "warmup_steps": 2}}
JSON
}
spec 4 "$steps" "$preset batch 4" > "$out/job.json"
spec 8 "$steps" "$preset batch 8" > "$out/too-big.json"

start_megacppd "$out/megacppd.log"
megacpp status | tee "$out/status.txt"

# Refused at submit: the CLI exits non-zero with the daemon's reason (on stderr).
if too_big=$(megacpp submit "$out/too-big.json" 2> "$out/too-big.txt"); then
  echo "batch 8 was accepted ($too_big): the submit-time memory check failed" |
    tee -a "$out/too-big.txt"
  megacpp cancel "$too_big" > /dev/null 2>&1 || true
  exit 1
fi
echo "batch 8 refused at submit" | tee -a "$out/too-big.txt"
job=$(megacpp submit "$out/job.json")
megacpp watch "$job" > "$out/watch.log" 2>&1 || true
megacpp job "$job" | tee "$out/job.txt"
megacpp receipts runs "$job" > "$out/runs.txt" 2>&1 || true
megacpp receipts kernels "$job" > "$out/kernels.txt" 2>&1 || true
cp "state/jobs/$job/executor.log" "$out/executor.log" 2>/dev/null || true
echo "daemon alive: $(kill -0 $daemon && echo yes)" | tee -a "$out/job.txt"
