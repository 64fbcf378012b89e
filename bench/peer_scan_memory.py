# Memory of the official Mamba-3 scans at M3-ref (the peers of issue 10), beside which
# mamba3_scan_cuda_bench reports our scan's workspace: the bytes they keep from forward to backward
# beyond the output, and their peak during one forward+backward beyond the inputs, the output and the
# input gradients (torch's allocator, after two warm-up runs). Run on the GPU machine from the peer
# folder (../shared/peer, carried as .peer/), which holds run_peers.py and mamba_ssm:
#   cd .peer && PYTHONPATH=<tilelang bundle> python3 ../bench/peer_scan_memory.py
# (bench/peer_tilelang_bundle.sh builds that bundle; the MIMO kernels need it.)
import json, os, sys, torch
sys.path.insert(0, os.getcwd()); import run_peers as rp
def inputs_grads(ts):
    return sum(t.grad.numel() * t.grad.element_size() for t in ts if t.grad is not None)
def measure(name, f, leaves, dO):
    for _ in range(2):
        f().backward(dO)
    for t in leaves: t.grad = None
    torch.cuda.synchronize(); torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated(); torch.cuda.reset_peak_memory_stats()
    y = f(); torch.cuda.synchronize()
    out = y.numel() * y.element_size()
    saved = torch.cuda.memory_allocated() - base - out
    y.backward(dO); torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    grads = inputs_grads(leaves)
    r = {"saved_fwd_MB": round(saved / 1e6), "peak_extra_MB": round((peak - out - grads) / 1e6),
         "input_grads_MB": round(grads / 1e6), "output_MB": round(out / 1e6)}
    print(name, json.dumps(r), flush=True)
B, S, H, P, N, G = 8, 8192, 16, 64, 64, 1
from mamba_ssm.ops.triton.mamba3.mamba3_siso_combined import mamba3_siso_combined
t = rp.scan_inputs(B, S, H, P, N, 1, G)
Q, K = t["Q"][:, :, 0].detach().requires_grad_(), t["K"][:, :, 0].detach().requires_grad_()
Qb, Kb = t["Qb"][:, 0].detach().requires_grad_(), t["Kb"][:, 0].detach().requires_grad_()
f = lambda: mamba3_siso_combined(Q, K, t["V"], t["ADT"], t["DT"], t["Trap"], Qb, Kb, t["Ang"], D=t["D"], Z=t["Z"], chunk_size=64)
leaves = [Q, K, Qb, Kb] + [t[k] for k in ("V", "ADT", "DT", "Trap", "Ang", "D", "Z")]
measure("siso_triton_M3ref", f, leaves, torch.randn_like(t["V"]))
del t, f, leaves, Q, K, Qb, Kb; torch.cuda.empty_cache()
from mamba_ssm.ops.tilelang.mamba3.mamba3_mimo import mamba3_mimo
R = 4
t = rp.scan_inputs(B, S, H, P, N, R, G)
mv = (torch.randn(H, R, P, device="cuda") / R).requires_grad_(); mo = (torch.randn(H, R, P, device="cuda") / R).requires_grad_()
mz = torch.randn(H, R, P, device="cuda").requires_grad_()
f = lambda: mamba3_mimo(t["Q"], t["K"], t["V"], t["ADT"], t["DT"], t["Trap"], t["Qb"], t["Kb"], mv, mz, mo, t["Ang"], t["D"], t["Z"], chunk_size=16, rotary_dim_divisor=4, dtype=torch.bfloat16)
leaves = list(t.values()) + [mv, mz, mo]
measure("mimo_tilelang_M3ref", f, leaves, torch.randn_like(t["V"]))
