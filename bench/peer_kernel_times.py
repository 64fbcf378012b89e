#!/usr/bin/env python3
"""Where the official Mamba-3 kernels spend a forward+backward at M3-ref, kernel by kernel.

run_peers.py times the official SISO Triton and MIMO TileLang scans whole; this profiles the same
calls (same shapes and inputs, through run_peers.py's scan_inputs) with torch.profiler and prints
each GPU kernel's time per forward+backward (its total over the profiled steps divided by the
steps) and launches per step, largest first: the budget a scan of ours would have to meet phase
by phase. Run it on the GPU machine from the peer folder's copy (see ../shared/peer/README.md):

    cd .peer && python3 ../bench/peer_kernel_times.py siso [mimo] [--steps 10]

The MIMO kernels need tilelang importable (bench/peer_tilelang_bundle.sh). Writes
peer_kernels_<scans>.json into $OUT (or /tmp) and a table per scan to stdout, with the launch
configuration each of the scan's autotuned Triton kernels settled on (warps, stages, register cap).
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.getcwd())  # the peer folder: run_peers.py and mamba_ssm
import run_peers  # noqa: E402

OUT = os.environ.get("OUT", "/tmp")


def siso_step():
    from mamba_ssm.ops.triton.mamba3.mamba3_siso_combined import mamba3_siso_combined

    B, S, H, P, N, G, C = 8, 8192, 16, 64, 64, 1, 64
    t = run_peers.scan_inputs(B, S, H, P, N, 1, G)
    Q, K = t["Q"][:, :, 0].detach().requires_grad_(), t["K"][:, :, 0].detach().requires_grad_()
    Qb, Kb = t["Qb"][:, 0].detach().requires_grad_(), t["Kb"][:, 0].detach().requires_grad_()
    d_out = torch.randn_like(t["V"])

    def step():
        mamba3_siso_combined(Q, K, t["V"], t["ADT"], t["DT"], t["Trap"], Qb, Kb, t["Ang"],
                             D=t["D"], Z=t["Z"], chunk_size=C).backward(d_out)

    return "siso_triton_M3ref_R1_C64", step


def mimo_step():
    from mamba_ssm.ops.tilelang.mamba3.mamba3_mimo import mamba3_mimo

    B, S, H, P, N, R, G, C = 8, 8192, 16, 64, 64, 4, 1, 16
    dev = "cuda"
    t = run_peers.scan_inputs(B, S, H, P, N, R, G)
    mv = (torch.randn(H, R, P, device=dev) / R).requires_grad_()
    mo = (torch.randn(H, R, P, device=dev) / R).requires_grad_()
    mz = torch.randn(H, R, P, device=dev).requires_grad_()
    d_out = torch.randn_like(t["V"])

    def step():
        mamba3_mimo(t["Q"], t["K"], t["V"], t["ADT"], t["DT"], t["Trap"], t["Qb"], t["Kb"], mv, mz,
                    mo, t["Ang"], t["D"], t["Z"], chunk_size=C, rotary_dim_divisor=4,
                    dtype=torch.bfloat16).backward(d_out)

    return "mimo_tilelang_M3ref_R4_C16", step


def device_time_us(event):
    # The attribute's name changed across torch versions.
    for name in ("self_device_time_total", "self_cuda_time_total"):
        if hasattr(event, name):
            return getattr(event, name)
    raise SystemExit("peer_kernel_times: this torch's profiler reports no device time")


def autotuned_configs():
    """The configuration each autotuned Triton kernel of the SISO scan chose, by kernel name."""
    import importlib

    chosen = {}
    for module_name in ("mamba3_siso_fwd", "mamba3_siso_bwd", "angle_dt"):
        try:
            module = importlib.import_module(f"mamba_ssm.ops.triton.mamba3.{module_name}")
        except ImportError:
            continue
        for attribute in vars(module).values():
            best = getattr(attribute, "best_config", None)
            if best is not None:
                chosen[getattr(getattr(attribute, "fn", None), "__name__", str(attribute))] = str(best)
    return chosen


def profile(name, step, steps):
    for _ in range(3):  # compile, autotune, warm
        step()
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    rows = []
    for event in prof.key_averages():
        us = device_time_us(event)
        if us <= 0:
            continue
        rows.append({"kernel": event.key, "ms_per_step": us / 1000.0 / steps,
                     "launches_per_step": event.count / steps})
    rows.sort(key=lambda row: -row["ms_per_step"])
    total = sum(row["ms_per_step"] for row in rows)
    print(f"\n{name}: {total:.3f} ms of GPU time per forward+backward ({steps} steps)")
    print("| kernel | ms / step | share | launches / step |\n|---|---|---|---|")
    for row in rows:
        print(f"| {row['kernel'][:90]} | {row['ms_per_step']:.3f} | "
              f"{100 * row['ms_per_step'] / total:.1f}% | {row['launches_per_step']:g} |")
    result = {"gpu_ms_per_step": total, "steps": steps, "kernels": rows}
    configs = autotuned_configs()
    if configs:
        result["autotuned"] = configs
        for kernel, config in configs.items():
            print(f"autotuned {kernel}: {config}")
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("scans", nargs="+", choices=["siso", "mimo"])
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    run_peers._pytest_stand_in()
    results = {"device": torch.cuda.get_device_name(0)}
    for scan in args.scans:
        name, step = {"siso": siso_step, "mimo": mimo_step}[scan]()
        results[name] = profile(name, step, args.steps)
        with open(os.path.join(OUT, f"peer_kernels_{'_'.join(args.scans)}.json"), "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
