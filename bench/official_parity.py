"""One of our checkpoints in the official PyTorch MambaLMHeadModel: the same tokens, both losses.

Runs on a GPU machine with torch and the official package (../shared/peer, carried as .peer).
The official SISO path (is_mimo false) has no mimo_x/z/o: it computes ours with them fixed at 1
once the B/C state dims are reordered (siso_state_order: it pairs rotated dims differently), so
the checkpoint must be R = 1; --fix-mimo writes a copy of it with mimo_x/z/o set to 1 (our loss
must then be measured on that copy, e.g. `megacpp eval --checkpoint OUT_DIR ...`).

  python3 bench/official_parity.py --peer .peer --checkpoint DIR --data PREFIX --seqlen S \
      [--fix-mimo OUT_DIR [--fix-only]] [--max-windows N] [--ours LOSS]

Evaluates windows i = 0.. of the dataset's token stream, tokens [i·S, i·S + S + 1), as
megacpp's eval does (batch 1), with the official model in fp32 and under bf16 autocast; the loss
is the softmax over all padded-vocabulary columns, as in our runtime. Prints one JSON line.
"""
import argparse
import json
import math
import os
import shutil
import struct
import sys

import numpy as np

DTYPES = {"F32": np.float32, "F64": np.float64, "BF16": None, "I32": np.int32}


def read_safetensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    tensors = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        if meta["dtype"] not in ("F32",):
            raise SystemExit(f"{path}: tensor {name} has dtype {meta['dtype']}, expected F32")
        begin, end = meta["data_offsets"]
        tensors[name] = np.frombuffer(data[begin:end], dtype=np.float32).reshape(meta["shape"])
    return tensors, header.get("__metadata__")


def write_safetensors(path, tensors, metadata=None):
    header, offset, blobs = {}, 0, []
    for name in sorted(tensors):
        blob = np.ascontiguousarray(tensors[name], dtype=np.float32).tobytes()
        header[name] = {"dtype": "F32", "shape": list(tensors[name].shape),
                        "data_offsets": [offset, offset + len(blob)]}
        offset += len(blob)
        blobs.append(blob)
    if metadata:
        header["__metadata__"] = metadata
    text = json.dumps(header).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for blob in blobs:
            f.write(blob)


def token_stream(prefix):
    """The dataset's sequences in order, concatenated (megacpp's read_stream), as int64."""
    with open(prefix + ".idx", "rb") as f:
        idx = f.read()
    code = idx[17]
    dtype = {1: np.uint8, 3: np.int16, 4: np.int32, 5: np.int64, 8: np.uint16}.get(code)
    if dtype is None:
        raise SystemExit(f"{prefix}.idx: token dtype code {code} is not handled here")
    count = struct.unpack_from("<Q", idx, 18)[0]
    lengths = np.frombuffer(idx, dtype=np.int32, count=count, offset=34)
    offsets = np.frombuffer(idx, dtype=np.int64, count=count, offset=34 + 4 * count)
    data = np.fromfile(prefix + ".bin", dtype=np.uint8)
    size = np.dtype(dtype).itemsize
    parts = [np.frombuffer(data[o:o + n * size].tobytes(), dtype=dtype) for o, n in zip(offsets, lengths)]
    return np.concatenate(parts).astype(np.int64)


def siso_state_order(tensors, config):
    """Our checkpoint with the B/C state dims reordered for the official SISO path.

    Both rotate A_n pairs of state dims by the same angles, but pair them differently: ours (the
    spec, and the official MIMO path) rotates dim j with dim j + N/2; the official SISO Triton
    kernels rotate dims 2j and 2j + 1 (mamba3.py: rotate_pairwise = not is_mimo). Official dim i
    takes our dim perm[i]. The RMSNorm over the N dims and the q·k products do not depend on the
    order, so the reordered model computes exactly our function.
    """
    ssm = config["ssm_cfg"]
    N, G, R = ssm["d_state"], ssm.get("ngroups", 1), ssm["mimo_rank"]
    d_inner = ssm.get("expand", 2) * config["d_model"]
    angles = int(ssm.get("rope_fraction", 0.5) * N)
    angles = (angles - angles % 2) // 2
    paired = [x for j in range(angles) for x in (j, j + N // 2)]
    perm = np.array(paired + [d for d in range(N) if d not in set(paired)])
    attention_layers = set(config.get("attn_layer_idx") or [])
    out = dict(tensors)
    for layer in range(config["n_layer"]):
        if layer in attention_layers:
            continue
        p = f"backbone.layers.{layer}.mixer."
        w = tensors[p + "in_proj.weight"].copy()
        for block in range(2 * G * R):  # B (G·R vectors of N rows), then C
            base = 2 * d_inner + block * N
            w[base:base + N] = tensors[p + "in_proj.weight"][base + perm]
        out[p + "in_proj.weight"] = w
        for bias in ("B_bias", "C_bias"):
            out[p + bias] = tensors[p + bias][..., perm]
        for norm in ("B_norm.weight", "C_norm.weight"):
            out[p + norm] = tensors[p + norm][perm]
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--peer", required=True)
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--seqlen", type=int, required=True)
    ap.add_argument("--max-windows", type=int, default=0)
    ap.add_argument("--fix-mimo", default="")
    ap.add_argument("--fix-only", action="store_true", help="write the --fix-mimo copy and stop")
    ap.add_argument("--ours", type=float, default=float("nan"))
    a = ap.parse_args()

    config = json.load(open(os.path.join(a.checkpoint, "config.json")))
    tensors, metadata = read_safetensors(os.path.join(a.checkpoint, "model.safetensors"))
    ssm = config["ssm_cfg"]
    if ssm["mimo_rank"] != 1:
        raise SystemExit(f"mimo_rank={ssm['mimo_rank']}: the official SISO path needs R = 1")
    if a.fix_mimo:
        for name in tensors:
            if name.rsplit(".", 1)[-1] in ("mimo_x", "mimo_z", "mimo_o"):
                tensors[name] = np.ones_like(tensors[name])
        os.makedirs(a.fix_mimo, exist_ok=True)
        for f in os.listdir(a.checkpoint):
            if f != "model.safetensors" and os.path.isfile(os.path.join(a.checkpoint, f)):
                shutil.copy(os.path.join(a.checkpoint, f), a.fix_mimo)
        write_safetensors(os.path.join(a.fix_mimo, "model.safetensors"), tensors, metadata)
        if a.fix_only:
            return
    for name, t in tensors.items():
        if name.rsplit(".", 1)[-1] in ("mimo_x", "mimo_z", "mimo_o") and not np.all(t == 1):
            raise SystemExit(f"{name} is not all ones: pass --fix-mimo DIR")

    if abs(config.get("norm_epsilon", 1e-5) - 1e-5) > 0:
        raise SystemExit(f"norm_epsilon={config['norm_epsilon']}: the official model fixes 1e-5")
    tensors = siso_state_order(tensors, config)

    sys.path.insert(0, os.path.abspath(a.peer))
    import torch
    import official_step  # noqa: F401  (installs the flash_attn stand-ins the package imports)
    from mamba_ssm.models.config_mamba import MambaConfig
    from mamba_ssm.models.mixer_seq_simple import MambaLMHeadModel

    ssm_cfg = {k: v for k, v in ssm.items() if k not in ("ngroups",)}
    ssm_cfg.update(layer="Mamba3", is_mimo=False, mimo_rank=1, is_outproj_norm=False,
                   ngroups=ssm.get("ngroups", 1))
    attn_cfg = dict(config.get("attn_cfg") or {})
    attn_cfg.pop("rotary_emb_interleaved", None)
    cfg = MambaConfig(d_model=config["d_model"], n_layer=config["n_layer"],
                      d_intermediate=config["d_intermediate"], vocab_size=config["vocab_size"],
                      ssm_cfg=ssm_cfg, attn_layer_idx=config.get("attn_layer_idx", []),
                      attn_cfg=attn_cfg, rms_norm=True, residual_in_fp32=True, fused_add_norm=True,
                      pad_vocab_size_multiple=config["pad_vocab_size_multiple"],
                      tie_embeddings=config["tie_embeddings"])
    model = MambaLMHeadModel(cfg, device="cuda", dtype=torch.float32)
    state = {k: torch.from_numpy(np.array(v)) for k, v in tensors.items()
             if k.rsplit(".", 1)[-1] not in ("mimo_x", "mimo_z", "mimo_o")}
    missing, unexpected = model.load_state_dict(state, strict=False)
    allowed_missing = {"lm_head.weight"} if config["tie_embeddings"] else set()
    if set(missing) - allowed_missing or unexpected:
        raise SystemExit(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
    if config["tie_embeddings"]:
        model.tie_weights()
    model.eval()

    stream = token_stream(a.data)
    S = a.seqlen
    windows = (len(stream) - 1) // S
    if a.max_windows:
        windows = min(windows, a.max_windows)
    totals = {"fp32": 0.0, "bf16_autocast": 0.0}
    with torch.no_grad():
        for i in range(windows):
            w = torch.from_numpy(stream[i * S:i * S + S + 1]).cuda()[None]
            for mode in totals:
                with torch.autocast("cuda", dtype=torch.bfloat16, enabled=mode != "fp32"):
                    logits = model(w[:, :-1]).logits
                loss = torch.nn.functional.cross_entropy(logits.float().view(-1, logits.shape[-1]),
                                                         w[:, 1:].reshape(-1))
                totals[mode] += loss.item()
    result = {"checkpoint": a.checkpoint if not a.fix_mimo else a.fix_mimo, "windows": windows,
              "seqlen": S, "device": torch.cuda.get_device_name(0),
              "official_fp32": totals["fp32"] / windows,
              "official_bf16_autocast": totals["bf16_autocast"] / windows}
    if not math.isnan(a.ours):
        result["ours"] = a.ours
        result["rel_diff_fp32"] = abs(a.ours - result["official_fp32"]) / result["official_fp32"]
        result["rel_diff_bf16"] = (abs(a.ours - result["official_bf16_autocast"]) /
                                   result["official_bf16_autocast"])
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
