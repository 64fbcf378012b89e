"""python/megacpp_checkpoint: an official save_pretrained directory converted to ours.

Builds the official directory itself, without torch: config.json with MambaConfig's keys and a
pytorch_model.bin in torch.save's zip format (data.pkl plus raw storages, the tied lm_head
sharing the embedding's storage as torch writes it), pickled with the same globals torch's
pickler emits. Checks the SISO state-dim reorder round-trips and matches
bench/official_parity.py's order, that the import restores our tensors exactly (SISO and MIMO),
that megacpp evaluates and trains on the result (`megacpp eval`, `megacpp train` with init),
and that bad input is refused naming the file and the tensor, key or class.

  python3 tests/python/import_official_test.py --bin-dir BUILD/bin
"""
import argparse
import collections
import io
import json
import math
import os
import pickle
import random
import struct
import subprocess
import sys
import tempfile
import types
import unittest
import zipfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))
from megacpp_checkpoint import (CheckpointImportError, Tensor, import_official,  # noqa: E402
                                official_siso_to_ours, ours_to_official_siso, read_safetensors,
                                write_safetensors)
from megacpp_checkpoint import expected_shapes, official_config_to_ours  # noqa: E402

BIN_DIR = ""

# ----------------------------------------------------------------------------------------------
# A minimal torch.save writer: stand-ins named as torch names them, so the pickle holds exactly
# the globals torch's does (torch._utils._rebuild_tensor_v2, torch.FloatStorage,
# collections.OrderedDict) and persistent ids ('storage', type, key, location, numel).


def _fake_torch():
    torch = types.ModuleType("torch")
    utils = types.ModuleType("torch._utils")

    def _rebuild_tensor_v2(*args):
        raise AssertionError("never called: only pickled by name")

    _rebuild_tensor_v2.__module__ = "torch._utils"
    _rebuild_tensor_v2.__qualname__ = "_rebuild_tensor_v2"
    utils._rebuild_tensor_v2 = _rebuild_tensor_v2
    torch._utils = utils
    for name in ("FloatStorage", "BFloat16Storage", "HalfStorage", "DoubleStorage"):
        cls = type(name, (), {"__module__": "torch"})
        setattr(torch, name, cls)
    return torch, utils


class _Storage:
    def __init__(self, key, type_name, data, numel):
        self.key, self.type_name, self.data, self.numel = key, type_name, data, numel


class _Tensor:
    def __init__(self, rebuild, storage, offset, shape, stride):
        self.rebuild, self.storage, self.offset = rebuild, storage, offset
        self.shape, self.stride = shape, stride

    def __reduce__(self):
        return (self.rebuild, (self.storage, self.offset, tuple(self.shape), tuple(self.stride),
                               False, collections.OrderedDict()))


def _contiguous_stride(shape):
    stride, step = [], 1
    for d in reversed(shape):
        stride.insert(0, step)
        step *= d
    return stride


def write_pytorch_bin(path, tensors, shared=None, extra=None, dtype="FloatStorage"):
    """tensors: {name: Tensor (fp32)}; shared: {name: other} pickles `name` as a view of
    `other`'s storage (a tied weight); extra: an object pickled by reference into the state dict
    (a function such as os.system), to check that the reader refuses it."""
    torch, utils = _fake_torch()
    saved = {m: sys.modules.get(m) for m in ("torch", "torch._utils")}
    sys.modules["torch"], sys.modules["torch._utils"] = torch, utils
    try:
        storages, state = {}, collections.OrderedDict()
        for name, t in tensors.items():
            if shared and name in shared:
                continue
            raw = t.data
            if dtype == "BFloat16Storage":  # truncating: the test's values are exact in bf16
                raw = b"".join(raw[i + 2:i + 4] for i in range(0, len(raw), 4))
            storages[name] = _Storage(str(len(storages)), dtype, raw, len(t.data) // 4)
        for name, t in tensors.items():
            storage = storages[shared[name] if shared and name in shared else name]
            state[name] = _Tensor(utils._rebuild_tensor_v2, storage, 0, t.shape,
                                  _contiguous_stride(t.shape))
        if extra is not None:
            state["extra"] = extra
        # What Module.state_dict() attaches (pickled as the OrderedDict's instance state).
        state._metadata = collections.OrderedDict([("", {"version": 1})])

        def persistent_id(obj):
            if isinstance(obj, _Storage):
                return ("storage", getattr(torch, obj.type_name), obj.key, "cpu", obj.numel)
            return None

        buffer = io.BytesIO()
        pickler = pickle.Pickler(buffer, protocol=2)
        pickler.persistent_id = persistent_id
        pickler.dump(state)
    finally:
        for m, v in saved.items():
            if v is None:
                sys.modules.pop(m, None)
            else:
                sys.modules[m] = v
    archive = "pytorch_model"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr(f"{archive}/data.pkl", buffer.getvalue())
        z.writestr(f"{archive}/byteorder", "little")
        for s in storages.values():
            z.writestr(f"{archive}/data/{s.key}", s.data)
        z.writestr(f"{archive}/version", "3\n")


# ----------------------------------------------------------------------------------------------

def official_config(is_mimo=False, tie=True):
    ssm = {"layer": "Mamba3", "d_state": 16, "headdim": 16, "is_mimo": is_mimo, "chunk_size": 8}
    if is_mimo:
        ssm["mimo_rank"] = 2
    return {"d_model": 32, "d_intermediate": 32, "n_layer": 3, "vocab_size": 257,
            "ssm_cfg": ssm, "attn_layer_idx": [1],
            "attn_cfg": {"num_heads": 2, "num_heads_kv": 1, "rotary_emb_dim": 8, "causal": True},
            "rms_norm": True, "residual_in_fp32": True, "fused_add_norm": True,
            "pad_vocab_size_multiple": 8, "tie_embeddings": tie}


def random_tensors(cfg, seed, mimo_ones):
    """Our tensors for config `cfg`, values exact in bf16 (so a bf16 file can hold them)."""
    rng = random.Random(seed)
    out = {}
    for name, shape in expected_shapes(cfg).items():
        n = math.prod(shape)
        if mimo_ones and name.rsplit(".", 1)[-1] in ("mimo_x", "mimo_z", "mimo_o"):
            values = [1.0] * n
        else:
            values = [rng.randint(-64, 64) / 256.0 for _ in range(n)]
        out[name] = Tensor(shape, struct.pack(f"<{n}f", *values))
    if cfg["tie_embeddings"]:
        out["lm_head.weight"] = out["backbone.embedding.weight"]
    return out


def to_official(ours, cfg, is_siso):
    official = dict(ours)
    if is_siso:
        official = ours_to_official_siso(official, cfg)
        for name in list(official):
            if name.rsplit(".", 1)[-1] in ("mimo_x", "mimo_z", "mimo_o"):
                del official[name]
    return official


def make_official_dir(root, is_mimo=False, tie=True, seed=1, **writer):
    """(official dir, our tensors it must import to, our config)."""
    off_cfg = official_config(is_mimo, tie)
    cfg, is_siso = official_config_to_ours(off_cfg)
    ours = random_tensors(cfg, seed, mimo_ones=is_siso)
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, "config.json"), "w") as f:
        json.dump(off_cfg, f, indent=4)
    shared = {"lm_head.weight": "backbone.embedding.weight"} if tie else None
    write_pytorch_bin(os.path.join(root, "pytorch_model.bin"), to_official(ours, cfg, is_siso),
                      shared=shared, **writer)
    return root, ours, cfg


def megacpp(*args):
    exe = os.path.join(BIN_DIR, "megacpp")
    r = subprocess.run([exe, *args], capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise AssertionError(f"megacpp {' '.join(args)} exited {r.returncode}: {r.stderr}")
    return r.stdout


class SisoStateOrder(unittest.TestCase):
    def setUp(self):
        self.cfg, _ = official_config_to_ours(official_config())
        self.ours = random_tensors(self.cfg, 7, mimo_ones=True)

    def test_round_trip_is_the_identity(self):
        official = ours_to_official_siso(self.ours, self.cfg)
        self.assertNotEqual(official["backbone.layers.0.mixer.in_proj.weight"],
                            self.ours["backbone.layers.0.mixer.in_proj.weight"])
        self.assertEqual(official_siso_to_ours(official, self.cfg), self.ours)
        back = ours_to_official_siso(official_siso_to_ours(official, self.cfg), self.cfg)
        self.assertEqual(back, official)

    def test_matches_official_parity_order(self):
        # bench/official_parity.py's siso_state_order for N = 16, rope_fraction 0.5: A_n = 4
        # angles pair (j, j + 8); official dim i takes our dim perm[i].
        perm = [0, 8, 1, 9, 2, 10, 3, 11, 4, 5, 6, 7, 12, 13, 14, 15]
        official = ours_to_official_siso(self.ours, self.cfg)
        m = "backbone.layers.2.mixer."
        ours_bias, off_bias = self.ours[m + "C_bias"].values(), official[m + "C_bias"].values()
        n = 16
        for h in range(len(ours_bias) // n):
            for i in range(n):
                self.assertEqual(off_bias[h * n + i], ours_bias[h * n + perm[i]])
        w, ow = self.ours[m + "in_proj.weight"].values(), official[m + "in_proj.weight"].values()
        d, d_inner = 32, 64
        for block in range(2):  # B, then C (G = R = 1)
            for i in range(n):
                row, src = 2 * d_inner + block * n + i, 2 * d_inner + block * n + perm[i]
                self.assertEqual(ow[row * d:(row + 1) * d], w[src * d:(src + 1) * d])
        # Rows outside B and C (z, x, dd_dt, dd_A, trap, angles) stay.
        self.assertEqual(ow[:2 * d_inner * d], w[:2 * d_inner * d])
        self.assertEqual(ow[(2 * d_inner + 2 * n) * d:], w[(2 * d_inner + 2 * n) * d:])


class ImportOfficial(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.root = self.tmp.name

    def tearDown(self):
        self.tmp.cleanup()

    def path(self, *parts):
        return os.path.join(self.root, *parts)

    def check_import(self, **kwargs):
        src, ours, cfg = make_official_dir(self.path("official"), **kwargs)
        written = import_official(src, self.path("ours"))
        self.assertEqual(written, cfg)
        with open(self.path("ours", "config.json")) as f:
            self.assertEqual(json.load(f), cfg)
        self.assertEqual(read_safetensors(self.path("ours", "model.safetensors")), ours)
        return ours, cfg

    def test_siso_imports_to_our_tensors(self):
        _, cfg = self.check_import()
        self.assertEqual(cfg["ssm_cfg"]["mimo_rank"], 1)
        self.assertTrue(cfg["ssm_cfg"]["is_mimo"])

    def test_mimo_imports_name_for_name(self):
        _, cfg = self.check_import(is_mimo=True)
        self.assertEqual(cfg["ssm_cfg"]["mimo_rank"], 2)

    def test_untied_and_bf16(self):
        self.check_import(tie=False, dtype="BFloat16Storage")

    def test_safetensors_in_the_official_dir(self):
        src, ours, cfg = make_official_dir(self.path("official"), is_mimo=True)
        os.remove(os.path.join(src, "pytorch_model.bin"))
        write_safetensors(os.path.join(src, "model.safetensors"), ours)
        import_official(src, self.path("ours"))
        self.assertEqual(read_safetensors(self.path("ours", "model.safetensors")), ours)

    def refusal(self, src):
        with self.assertRaises(CheckpointImportError) as e:
            import_official(src, self.path("ours"))
        return str(e.exception)

    def test_bad_input_is_refused_by_name(self):
        self.assertIn("config.json: missing", self.refusal(self.path("nowhere")))
        src, ours, cfg = make_official_dir(self.path("a"))
        os.remove(os.path.join(src, "pytorch_model.bin"))
        self.assertIn("neither pytorch_model.bin nor model.safetensors", self.refusal(src))

        src, _, _ = make_official_dir(self.path("b"))
        with open(os.path.join(src, "config.json")) as f:
            c = json.load(f)
        c["ssm_cfg"]["bogus"] = 1
        with open(os.path.join(src, "config.json"), "w") as f:
            json.dump(c, f)
        self.assertIn("unknown key ssm_cfg.bogus", self.refusal(src))
        c["ssm_cfg"].pop("bogus")
        c["d_model"] = 48
        with open(os.path.join(src, "config.json"), "w") as f:
            json.dump(c, f)
        self.assertRegex(self.refusal(src), r"pytorch_model.bin: tensor \S+ has shape")

        # Tied in config.json, but lm_head is a different matrix.
        cfg, _ = official_config_to_ours(official_config())
        t = to_official(random_tensors(cfg, 3, True), cfg, True)
        t["lm_head.weight"] = Tensor(t["lm_head.weight"].shape,
                                     bytes(len(t["lm_head.weight"].data)))
        os.makedirs(self.path("c"))
        with open(self.path("c", "config.json"), "w") as f:
            json.dump(official_config(), f)
        write_pytorch_bin(self.path("c", "pytorch_model.bin"), t)
        self.assertIn("tensor lm_head.weight differs from backbone.embedding.weight",
                      self.refusal(self.path("c")))
        # Untied, without lm_head.
        del t["lm_head.weight"]
        with open(self.path("c", "config.json"), "w") as f:
            json.dump(official_config(tie=False), f)
        write_pytorch_bin(self.path("c", "pytorch_model.bin"), t)
        self.assertIn("tensor lm_head.weight is missing", self.refusal(self.path("c")))
        # An unexpected tensor.
        t["lm_head.weight"] = t["backbone.embedding.weight"]
        t["backbone.layers.0.mixer.norm.weight"] = Tensor([64], bytes(256))
        write_pytorch_bin(self.path("c", "pytorch_model.bin"), t)
        self.assertIn("unexpected tensor backbone.layers.0.mixer.norm.weight",
                      self.refusal(self.path("c")))

    def test_arbitrary_classes_are_never_unpickled(self):
        src, _, _ = make_official_dir(self.path("d"), extra=os.system)
        message = self.refusal(src)
        self.assertIn(f"refers to {os.system.__module__}.system", message)
        self.assertIn("refusing to unpickle it", message)


class LoadsInMegacpp(unittest.TestCase):
    def setUp(self):
        if not BIN_DIR:
            self.skipTest("needs --bin-dir (the megacpp CLI)")

    def test_eval_and_train_from_the_import(self):
        with tempfile.TemporaryDirectory() as root:
            src, ours, cfg = make_official_dir(os.path.join(root, "official"))
            converted = os.path.join(root, "converted")
            import_official(src, converted)
            # The same weights written directly in our format: the import must evaluate alike.
            direct = os.path.join(root, "direct")
            os.makedirs(direct)
            write_safetensors(os.path.join(direct, "model.safetensors"), ours)
            with open(os.path.join(direct, "config.json"), "w") as f:
                json.dump(cfg, f)
            os.makedirs(os.path.join(root, "corpus"))
            rng = random.Random(5)
            words = ["state", "space", "model", "mamba", "attention", "token", "the", "of"]
            for i in range(3):
                with open(os.path.join(root, "corpus", f"{i}.txt"), "w") as f:
                    f.write(" ".join(rng.choice(words) for _ in range(400)))
            prefix = os.path.join(root, "data")
            megacpp("data", "prepare", "--input", os.path.join(root, "corpus"), "--output",
                    prefix, "--valid-fraction", "0.34", "--seed", "1")
            losses = []
            for ckpt in (converted, direct):
                out = megacpp("--json", "eval", "--checkpoint", ckpt, "--data", prefix + "_valid",
                              "--seqlen", "32", "--batch", "2", "--max-windows", "4")
                losses.append(json.loads(out)["loss"])
            self.assertTrue(math.isfinite(losses[0]))
            self.assertEqual(losses[0], losses[1])
            job = {"model": {"config_file": os.path.join(converted, "config.json")},
                   "init": {"checkpoint": converted},
                   "data": {"train": prefix + "_train", "valid": prefix + "_valid"},
                   "steps": 3, "batch": 2, "seqlen": 32, "threads": 1,
                   "eval": {"interval": 0, "batches": 2},
                   "checkpoint": {"dir": os.path.join(root, "run")}}
            with open(os.path.join(root, "job.json"), "w") as f:
                json.dump(job, f)
            out = megacpp("--json", "train", "--quiet", os.path.join(root, "job.json"))
            # The whole of stdout: the CLI's log lines ("initialized from ...") go to stderr.
            summary = json.loads(out)
            self.assertEqual(summary["first_step"], 1)
            self.assertTrue(math.isfinite(summary["final_loss"]))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin-dir", default="")
    args, rest = ap.parse_known_args()
    BIN_DIR = args.bin_dir
    unittest.main(argv=[sys.argv[0], *rest], verbosity=2)
