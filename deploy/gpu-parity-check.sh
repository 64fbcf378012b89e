#!/usr/bin/env bash
# On a GPU machine (after `source .devbundle/env.sh`, with the peer folder carried as .peer): trains
# an R = 1 model on the GPU, sets its mimo_x/z/o to 1 (the official SISO path has none), and
# compares our loss (`megacpp eval`, CPU) with the official PyTorch MambaLMHeadModel's on the same
# validation windows (bench/official_parity.py). Results in OUTDIR/parity.json.
# Usage: deploy/gpu-parity-check.sh OUTDIR [STEPS]
set -euo pipefail
out=$(realpath -m "$1")
steps=${2:-200}
mkdir -p "$out"
cd "$(dirname "$0")/.."
mkdir -p data
[ -f data/gpu-check_valid.idx ] ||
  megacpp data prepare --input runtime --output data/gpu-check --seed 1 --valid-fraction 0.1 \
    > "$out/prepare.log"
cat > "$out/job.json" <<JSON
{"model": {"config": {"d_model": 256, "pattern": "MMM*", "d_intermediate": 512, "vocab_size": 257,
  "ssm_cfg": {"d_state": 64, "headdim": 64, "mimo_rank": 1, "chunk_size": 64},
  "attn_cfg": {"num_heads": 4, "num_heads_kv": 2, "rotary_emb_dim": 64}}},
 "data": {"train": "$PWD/data/gpu-check_train", "valid": "$PWD/data/gpu-check_valid"},
 "steps": $steps, "batch": 8, "seqlen": 512, "optimizer": {"lr": 0.003, "warmup_steps": 20},
 "eval": {"interval": 0, "batches": 4}, "checkpoint": {"dir": "$out/run"}, "seed": 5,
 "device": "cuda"}
JSON
megacpp train --quiet "$out/job.json" > "$out/train.log" 2>&1
ckpt="$out/run/$(cat "$out/run/latest")"
python3 bench/official_parity.py --peer .peer --checkpoint "$ckpt" --data data/gpu-check_valid \
  --seqlen 512 --fix-mimo "$out/fixed" --fix-only
megacpp --json eval --checkpoint "$out/fixed" --data data/gpu-check_valid --seqlen 512 --batch 1 \
  > "$out/ours.json"
ours=$(python3 -c "import json;print(json.load(open('$out/ours.json'))['loss'])")
python3 bench/official_parity.py --peer .peer --checkpoint "$out/fixed" --data data/gpu-check_valid \
  --seqlen 512 --ours "$ours" | tee "$out/parity.json"
