#!/usr/bin/env python3
"""How close the official MIMO TileLang backward comes to the official reference math.

Our scan's gradients are held to max|gpu − oracle| / max|oracle| < 0.012 against a double CPU
oracle (shared/bench/anchors.md; tests/kernels/cuda/oracle_harness.h), which is why its state
products take split hi + lo bf16 operands. The official package's own test
(test_mamba3_mimo.py, test_mamba_mimo_bwd_combined_relative_errors_lt_10pct) holds its kernels
to 0.10 by the same measure against its fp32 reference. This runs that test's case at M3-ref's
N, P, R and chunk (its batch 4, seqlen 2048, 16 heads, its inputs and seed) and prints every
gradient's error by that measure, so that the two precisions can be set side by side. Run it on
the GPU machine from the peer folder's copy with tilelang importable
(bench/peer_tilelang_bundle.sh):

    cd .peer && PYTHONPATH=<tilelang bundle> python3 ../bench/peer_precision.py

Writes peer_precision.json into $OUT (or /tmp).
"""
import importlib.util
import json
import os
import sys
from types import SimpleNamespace

sys.path.insert(0, os.getcwd())  # the peer folder: run_peers.py, test_mamba3_mimo.py, mamba_ssm
import run_peers  # noqa: E402  (also stands einops in where the machine lacks it)

OUT = os.environ.get("OUT", "/tmp")
GRADIENTS = ["dq", "dk", "dv", "dA", "ddt", "dtrap", "dq_bias", "dk_bias", "dmimo_v", "dmimo_z",
             "dmimo_o", "dangles", "dD", "dz"]


def main():
    run_peers._pytest_stand_in()
    spec = importlib.util.spec_from_file_location("official_test", "test_mamba3_mimo.py")
    test = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(test)
    # The test's `mods` fixture, built directly (pytest refuses a fixture called as a function).
    import mamba_ssm.ops.tilelang.mamba3.mamba3_mimo as top
    import mamba_ssm.ops.tilelang.mamba3.mamba3_mimo_bwd as bwd
    import mamba_ssm.ops.tilelang.mamba3.mamba3_mimo_fwd as fwd
    import mamba_ssm.ops.triton.mamba3.mamba3_mimo_utils as utils

    mods = SimpleNamespace(top=top, bwd=bwd, fwd=fwd, utils=utils)
    n, p, r, chunk, threads = 64, 64, 4, 16, 256  # the test grid's N64_P64_R4_C16_BB256
    inputs = test.build_inputs(mods=mods, n=n, p=p, r=r, chunk_size=chunk,
                               seed=5678 + n + p + r + chunk)
    reference = test.run_ref_backward_fp32(mods, inputs)
    grads = mods.bwd.mamba_mimo_bwd_combined(
        inputs["dout"], inputs["q"], inputs["k"], inputs["v"], inputs["q_bias"],
        inputs["k_bias"], inputs["mimo_v"], inputs["mimo_o"], inputs["z"], inputs["mimo_z"],
        inputs["angles"], inputs["dA_cs"], inputs["dA_cs_rev"], inputs["dt"], inputs["trap"],
        inputs["D"], inputs["segsum"], chunk, inputs["rotary_dim_divisor"], test.FIXED_DTYPE,
        bb_threads=threads)
    errors = {name: test.max_rel_err(grad, reference[name])
              for name, grad in zip(GRADIENTS, grads) if grad is not None}
    result = {"case": f"N{n}_P{p}_R{r}_C{chunk}_B{test.FIXED_B}_L{test.FIXED_S}_H{test.FIXED_H}",
              "measure": "max|kernel - fp32 reference| / max|fp32 reference|",
              "official_test_tolerance": test.REL_TOL, "errors": errors}
    for name, error in errors.items():
        print(f"{name}: {error:.3e}")
    with open(os.path.join(OUT, "peer_precision.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
