"""The official model's checkpoints in megacpp's hands (deploy/gpu-import-check.sh's Python side).

Runs on a GPU machine with torch and the official package (../shared/peer, carried as .peer).

  make: builds a small official MambaLMHeadModel (SISO: is_mimo false, its Triton kernels; or
        MIMO: is_mimo true, R = 4), moves its parameters off their symmetric init (B/C biases and
        norms start at 1, which would hide a wrong state-dim order), trains it a few AdamW steps
        on the dataset, and save_pretrained()s it to OUT.
  loss: the official model's loss on the dataset's first windows, as `megacpp eval --batch 1`
        computes it (windows [i·S, i·S + S + 1), softmax over the padded vocabulary), in fp32 and
        under bf16 autocast. The model comes from --official DIR (save_pretrained's directory,
        loaded with load_state_dict(strict=True)) or from --ours DIR (one of our checkpoints,
        mapped to the official layout and loaded strictly: R = 1 into the SISO path with its B/C
        state dims reordered, which needs mimo_x/z/o all ones; R > 1 name for name).

The MIMO path needs the official TileLang kernels (`tilelang`). Where tilelang is absent, the
official MIMO reference math (`mamba3_MIMO_chunk_ref` of the peer's test_mamba3_mimo.py, eager
PyTorch) stands in for the kernel: the JSON line says so ("mimo_kernel": "reference math").

  python3 bench/official_import_check.py make --peer .peer --mode siso|mimo --out DIR \
      --data PREFIX [--train-steps 30] [--seed 0]
  python3 bench/official_import_check.py loss --peer .peer (--official DIR | --ours DIR) \
      --data PREFIX --seqlen S [--max-windows N]
"""
import argparse
import importlib.util
import json
import os
import sys
import types

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))
sys.path.insert(0, HERE)

MIMO_KERNEL = "tilelang"


def _pytest_stand_in():
    """test_mamba3_mimo.py imports pytest at module level; the GPU machine may lack it."""
    try:
        import pytest  # noqa: F401
        return
    except ImportError:
        pass
    pt = types.ModuleType("pytest")
    pt.param = lambda *a, **k: a
    pt.fixture = lambda *a, **k: (lambda f: f) if not a or not callable(a[0]) else a[0]

    class _Marks:
        def __getattr__(self, name):
            return lambda *a, **k: (lambda f: f)
    pt.mark = _Marks()
    pt.skip = lambda *a, **k: None
    pt.importorskip = lambda *a, **k: None
    sys.modules["pytest"] = pt


def official_modules(peer):
    """(torch, MambaConfig, MambaLMHeadModel), with the MIMO reference math standing in for the
    TileLang kernel where tilelang is absent."""
    global MIMO_KERNEL
    sys.path.insert(0, os.path.abspath(peer))
    import torch
    import official_step  # noqa: F401  (installs the flash_attn / einops stand-ins)
    import mamba_ssm.modules.mamba3 as mamba3
    from mamba_ssm.models.config_mamba import MambaConfig
    from mamba_ssm.models.mixer_seq_simple import MambaLMHeadModel

    if mamba3.mamba3_mimo_combined is None:
        MIMO_KERNEL = "reference math (tilelang absent)"
        _pytest_stand_in()
        spec = importlib.util.spec_from_file_location(
            "mimo_reference", os.path.join(os.path.abspath(peer), "test_mamba3_mimo.py"))
        ref = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(ref)

        def mimo_by_reference(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, MIMO_V, MIMO_Z, MIMO_Out,
                              Angles, D, Z, chunk_size, rotary_dim_divisor, dtype,
                              return_state=False, cu_seqlens=None,
                              fuse_pregate_headwise_rms_norm=False, outproj_norm_weight=None,
                              outproj_norm_eps=1e-5):
            # What the TileLang wrapper (ops/tilelang/mamba3/mamba3_mimo.py) feeds its kernel:
            # the cumulated angles (angle_dt_fwd) and the in-chunk cumulative sums of ADT
            # (compute_dacs_segsum_triton), here in eager PyTorch.
            if return_state or cu_seqlens is not None or fuse_pregate_headwise_rms_norm:
                raise SystemExit("the MIMO reference stand-in covers the training forward only")
            batch, heads, seqlen = ADT.shape
            pad = (chunk_size - seqlen % chunk_size) % chunk_size
            dA = torch.nn.functional.pad(ADT.float(), (0, pad)).view(batch, heads, -1, chunk_size)
            cs = torch.cumsum(dA, -1)
            rev = torch.flip(torch.cumsum(torch.flip(dA, [-1]), -1), [-1]) - dA
            cs = cs.reshape(batch, heads, -1)[..., :seqlen]
            rev = rev.reshape(batch, heads, -1)[..., :seqlen]
            angles = ref.apply_angle_dt_reference(Angles, DT.transpose(1, 2))
            out, _, _ = ref.mamba3_MIMO_chunk_ref(
                Q, K, V, Q_bias, K_bias, MIMO_V, MIMO_Out, Z, MIMO_Z, angles, cs, rev, DT, Trap,
                D, chunk_size=chunk_size, rotary_dim_divisor=rotary_dim_divisor, dtype=dtype)
            return out

        mamba3.mamba3_mimo_combined = mimo_by_reference
    return torch, MambaConfig, MambaLMHeadModel


def official_config(mode):
    """The model of gpu-parity-check.sh (d_model 256, MMM*, MLP 512, N 64, P 64, 4/2 heads)."""
    mimo = mode == "mimo"
    ssm = {"layer": "Mamba3", "d_state": 64, "headdim": 64, "is_mimo": mimo,
           "mimo_rank": 4 if mimo else 1, "chunk_size": 16 if mimo else 64,
           "is_outproj_norm": False}
    return {"d_model": 256, "n_layer": 4, "d_intermediate": 512, "vocab_size": 257,
            "ssm_cfg": ssm, "attn_layer_idx": [3],
            "attn_cfg": {"num_heads": 4, "num_heads_kv": 2, "rotary_emb_dim": 64, "causal": True},
            "rms_norm": True, "residual_in_fp32": True, "fused_add_norm": True,
            "pad_vocab_size_multiple": 8, "tie_embeddings": True}


def windows(torch, prefix, seqlen, max_windows):
    from official_parity import token_stream
    stream = token_stream(prefix)
    count = (len(stream) - 1) // seqlen
    if max_windows:
        count = min(count, max_windows)
    return [torch.from_numpy(stream[i * seqlen:i * seqlen + seqlen + 1]).cuda()[None]
            for i in range(count)]


def make(a):
    torch, MambaConfig, MambaLMHeadModel = official_modules(a.peer)
    torch.manual_seed(a.seed)
    cfg = official_config(a.mode)
    model = MambaLMHeadModel(MambaConfig(**json.loads(json.dumps(cfg))), device="cuda",
                             dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if leaf in ("B_bias", "C_bias", "mimo_x", "mimo_z", "mimo_o", "D") or \
                    name.endswith("norm.weight") or name.endswith("norm2.weight") or \
                    name.endswith("norm_f.weight"):
                p.mul_(1 + 0.3 * torch.randn_like(p))
    tokens = windows(torch, a.data, 256, 0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    losses = []
    model.train()
    for step in range(a.train_steps):
        batch = torch.cat(tokens[(4 * step) % len(tokens):][:4] or tokens[:4])
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                                 batch[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    model.save_pretrained(a.out)
    print(json.dumps({"made": a.out, "mode": a.mode, "mimo_kernel": MIMO_KERNEL if
                      a.mode == "mimo" else "triton (SISO)", "train_losses": losses[:1] +
                      losses[-1:], "parameters": sum(p.numel() for p in model.parameters())}),
          flush=True)


def state_from_ours(torch, checkpoint):
    """(official config dict, state dict) of one of our checkpoints."""
    import megacpp_checkpoint as mc
    with open(os.path.join(checkpoint, "config.json")) as f:
        ours = json.load(f)
    tensors = mc.read_safetensors(os.path.join(checkpoint, "model.safetensors"))
    ssm = dict(ours["ssm_cfg"])
    siso = ssm["mimo_rank"] == 1
    if siso:
        for name, t in tensors.items():
            if name.rsplit(".", 1)[-1] in ("mimo_x", "mimo_z", "mimo_o") and \
                    any(v != 1.0 for v in t.values()):
                raise SystemExit(f"{checkpoint}: {name} is not all ones, which the official "
                                 "SISO path cannot express (bench/official_parity.py --fix-mimo)")
        tensors = mc.ours_to_official_siso(tensors, ours)
        tensors = {k: v for k, v in tensors.items()
                   if k.rsplit(".", 1)[-1] not in ("mimo_x", "mimo_z", "mimo_o")}
    ssm.update(is_mimo=not siso, is_outproj_norm=False)
    official = {k: v for k, v in ours.items() if k != "norm_epsilon"}
    official["ssm_cfg"] = ssm
    state = {k: torch.frombuffer(bytearray(t.data), dtype=torch.float32).reshape(t.shape)
             for k, t in tensors.items()}
    return official, state


def loss(a):
    torch, MambaConfig, MambaLMHeadModel = official_modules(a.peer)
    if a.official:
        with open(os.path.join(a.official, "config.json")) as f:
            cfg = json.load(f)
        state = torch.load(os.path.join(a.official, "pytorch_model.bin"), map_location="cpu")
    else:
        cfg, state = state_from_ours(torch, a.ours)
    model = MambaLMHeadModel(MambaConfig(**cfg), device="cuda", dtype=torch.float32)
    model.load_state_dict(state, strict=True)
    model.eval()
    totals = {"fp32": 0.0, "bf16_autocast": 0.0}
    ws = windows(torch, a.data, a.seqlen, a.max_windows)
    with torch.no_grad():
        for w in ws:
            for mode in totals:
                with torch.autocast("cuda", dtype=torch.bfloat16, enabled=mode != "fp32"):
                    logits = model(w[:, :-1]).logits
                totals[mode] += torch.nn.functional.cross_entropy(
                    logits.float().view(-1, logits.shape[-1]), w[:, 1:].reshape(-1)).item()
    is_mimo = cfg["ssm_cfg"].get("is_mimo", False)
    print(json.dumps({"source": a.official or a.ours, "windows": len(ws), "seqlen": a.seqlen,
                      "device": torch.cuda.get_device_name(0),
                      "path": ("MIMO, " + MIMO_KERNEL) if is_mimo else "SISO, triton",
                      "official_fp32": totals["fp32"] / len(ws),
                      "official_bf16_autocast": totals["bf16_autocast"] / len(ws)}), flush=True)


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="command", required=True)
    m = sub.add_parser("make")
    m.add_argument("--peer", required=True)
    m.add_argument("--mode", choices=["siso", "mimo"], required=True)
    m.add_argument("--out", required=True)
    m.add_argument("--data", required=True)
    m.add_argument("--train-steps", type=int, default=30)
    m.add_argument("--seed", type=int, default=0)
    l_ = sub.add_parser("loss")
    l_.add_argument("--peer", required=True)
    source = l_.add_mutually_exclusive_group(required=True)
    source.add_argument("--official", default="")
    source.add_argument("--ours", default="")
    l_.add_argument("--data", required=True)
    l_.add_argument("--seqlen", type=int, required=True)
    l_.add_argument("--max-windows", type=int, default=0)
    a = ap.parse_args()
    make(a) if a.command == "make" else loss(a)


if __name__ == "__main__":
    main()
