"""A checkpoint of the official mamba_ssm MambaLMHeadModel as a megacpp checkpoint.

    from megacpp_checkpoint import import_official
    import_official("official-dir", "megacpp-dir")

official-dir is what MambaLMHeadModel.save_pretrained writes (config.json and pytorch_model.bin,
or model.safetensors); megacpp-dir gets config.json and model.safetensors, the checkpoint format
of runtime/checkpoint (fp32, the PyTorch module names), which `megacpp eval --checkpoint` and a
train job's "init": {"checkpoint": DIR} read. Only the standard library is used: no torch.

pytorch_model.bin is read without torch's unpickler: a restricted pickle.Unpickler admits only
the globals a state_dict of plain tensors pickles (torch._utils._rebuild_tensor_v2,
collections.OrderedDict, the floating-point torch.*Storage types) and refuses any other class
by name, so a hostile file cannot run code.

The official SISO path (ssm_cfg.is_mimo false) has no mimo_x/z/o and pairs its rotated B/C state
dims as (2j, 2j + 1) where megacpp pairs (j, j + N/2): the import writes mimo_x/z/o = 1 (what the
SISO path computes) and puts the state dims in megacpp's order (official_siso_to_ours, the
inverse of bench/official_parity.py's siso_state_order). A MIMO checkpoint maps name for name.
"""
import array
import collections
import io
import json
import math
import os
import pickle
import struct
import sys
import zipfile

__all__ = ["import_official", "CheckpointImportError", "official_config_to_ours",
           "official_siso_to_ours", "ours_to_official_siso", "read_pytorch_bin",
           "read_safetensors", "write_safetensors", "Tensor"]


class CheckpointImportError(ValueError):
    """A checkpoint that cannot be converted; the message names the file and the tensor or key."""


class Tensor:
    """A dense row-major fp32 tensor: its shape and its little-endian bytes."""

    __slots__ = ("shape", "data")

    def __init__(self, shape, data):
        self.shape = list(shape)
        self.data = bytes(data)
        if len(self.data) != 4 * _numel(self.shape):
            raise ValueError(f"{len(self.data)} bytes for shape {self.shape}")

    def values(self):
        a = array.array("f")
        a.frombytes(self.data)
        if sys.byteorder != "little":
            a.byteswap()
        return a

    def __eq__(self, other):
        return isinstance(other, Tensor) and self.shape == other.shape and self.data == other.data

    def __repr__(self):
        return f"Tensor(shape={self.shape})"


def _numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


# ----------------------------------------------------------------------------------------------
# Element conversion to fp32 little-endian bytes.

_ITEMSIZE = {"F32": 4, "F64": 8, "F16": 2, "BF16": 2}


def _to_f32_bytes(raw, dtype, where):
    if dtype == "F32":
        return bytes(raw)
    if dtype == "BF16":
        # bf16 is the high half of an fp32: two zero bytes below each element, little-endian.
        out = bytearray(2 * len(raw))
        out[2::4] = raw[0::2]
        out[3::4] = raw[1::2]
        return bytes(out)
    if dtype == "F16":
        n = len(raw) // 2
        return struct.pack(f"<{n}f", *struct.unpack(f"<{n}e", raw))
    if dtype == "F64":
        n = len(raw) // 8
        values = struct.unpack(f"<{n}d", raw)
        for v in values:
            if math.isfinite(v) and abs(v) > 3.4028234663852886e38:
                raise CheckpointImportError(f"{where}: F64 value {v} does not fit in fp32")
        return struct.pack(f"<{n}f", *values)
    raise CheckpointImportError(f"{where}: dtype {dtype} is not a floating-point type megacpp reads "
                       "(F32, F64, F16, BF16)")


# ----------------------------------------------------------------------------------------------
# pytorch_model.bin: torch.save's zip format, read without torch.

# torch.<Name>Storage -> safetensors dtype name. Integer storages are refused: a model's
# state_dict holds only floating-point tensors.
_STORAGE_DTYPES = {"FloatStorage": "F32", "DoubleStorage": "F64", "HalfStorage": "F16",
                   "BFloat16Storage": "BF16"}


class _StorageType:
    def __init__(self, dtype):
        self.dtype = dtype


class _Storage:
    def __init__(self, dtype, key, numel):
        self.dtype, self.key, self.numel = dtype, key, numel


class _LazyTensor:
    def __init__(self, storage, offset, size, stride):
        self.storage, self.offset = storage, offset
        self.size, self.stride = list(size), list(stride)


def _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad=False,
                       backward_hooks=None, metadata=None):
    del requires_grad, backward_hooks, metadata  # training state, not the tensor's value
    if not isinstance(storage, _Storage):
        raise CheckpointImportError(f"_rebuild_tensor_v2 got {type(storage).__name__}, not a storage")
    return _LazyTensor(storage, storage_offset, size, stride)


class _RestrictedUnpickler(pickle.Unpickler):
    def __init__(self, file, source):
        super().__init__(file)
        self.source = source

    def find_class(self, module, name):
        if module == "collections" and name == "OrderedDict":
            return collections.OrderedDict
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return _rebuild_tensor_v2
        if module == "torch" and name in _STORAGE_DTYPES:
            return _StorageType(_STORAGE_DTYPES[name])
        raise CheckpointImportError(
            f"{self.source}: refers to {module}.{name}, which a state_dict of floating-point "
            "tensors does not need; refusing to unpickle it (only torch._utils._rebuild_tensor_v2, "
            "collections.OrderedDict and torch.{Float,Double,Half,BFloat16}Storage are allowed)")

    def persistent_load(self, pid):
        if (not isinstance(pid, tuple) or len(pid) != 5 or pid[0] != "storage"
                or not isinstance(pid[1], _StorageType)):
            raise CheckpointImportError(f"{self.source}: unexpected persistent id {pid!r}")
        _, storage_type, key, _location, numel = pid
        return _Storage(storage_type.dtype, str(key), int(numel))


def _gather(storage_bytes, itemsize, tensor, where):
    """The tensor's elements in row-major order, as raw bytes of its dtype."""
    size, stride, offset = tensor.size, tensor.stride, tensor.offset
    numel = _numel(size)
    contiguous, expected = True, 1
    for d in reversed(range(len(size))):
        if size[d] != 1 and stride[d] != expected:
            contiguous = False
        expected *= size[d]
    if numel == 0:
        return b""
    last = offset + sum((s - 1) * st for s, st in zip(size, stride))
    if offset < 0 or min(stride, default=0) < 0 or (last + 1) * itemsize > len(storage_bytes):
        raise CheckpointImportError(f"{where}: size {size}, stride {stride}, offset {offset} reach beyond "
                           f"its storage of {len(storage_bytes) // itemsize} elements")
    if contiguous:
        return storage_bytes[offset * itemsize:(offset + numel) * itemsize]
    # A view (rare in a state_dict): element by element.
    out = bytearray()
    index = [0] * len(size)
    for _ in range(numel):
        at = offset + sum(i * st for i, st in zip(index, stride))
        out += storage_bytes[at * itemsize:(at + 1) * itemsize]
        for d in reversed(range(len(size))):
            index[d] += 1
            if index[d] < size[d]:
                break
            index[d] = 0
    return bytes(out)


def read_pytorch_bin(path):
    """{name: Tensor} of a torch.save'd state_dict (the zip format of torch >= 1.6)."""
    if not zipfile.is_zipfile(path):
        raise CheckpointImportError(f"{path}: not a zip archive: only torch.save's zip format (torch >= "
                           "1.6, the default) is read; re-save it with a recent torch")
    with zipfile.ZipFile(path) as archive:
        names = archive.namelist()
        pickles = [n for n in names if n.endswith("/data.pkl") or n == "data.pkl"]
        if len(pickles) != 1:
            raise CheckpointImportError(f"{path}: expected one data.pkl in the archive, found {pickles}")
        prefix = pickles[0][:-len("data.pkl")]
        byteorder = prefix + "byteorder"
        if byteorder in names and archive.read(byteorder).strip() != b"little":
            raise CheckpointImportError(f"{path}: byteorder {archive.read(byteorder)!r}: only "
                               "little-endian archives are read")
        source = f"{path}: {pickles[0]}"
        state = _RestrictedUnpickler(io.BytesIO(archive.read(pickles[0])), source).load()
        if isinstance(state, dict) and "state_dict" in state and isinstance(
                state["state_dict"], dict):
            state = state["state_dict"]
        if not isinstance(state, dict):
            raise CheckpointImportError(f"{source}: holds a {type(state).__name__}, not a state_dict")
        storages = {}
        tensors = {}
        for name, value in state.items():
            where = f"{path}: tensor {name}"
            if not isinstance(value, _LazyTensor):
                raise CheckpointImportError(f"{where} is a {type(value).__name__}, not a tensor")
            st = value.storage
            if st.key not in storages:
                entry = f"{prefix}data/{st.key}"
                if entry not in names:
                    raise CheckpointImportError(f"{where}: its storage {entry} is missing from the archive")
                storages[st.key] = archive.read(entry)
                if len(storages[st.key]) < st.numel * _ITEMSIZE[st.dtype]:
                    raise CheckpointImportError(f"{where}: storage {entry} has {len(storages[st.key])} "
                                       f"bytes, fewer than its {st.numel} {st.dtype} elements")
            raw = _gather(storages[st.key], _ITEMSIZE[st.dtype], value, where)
            tensors[str(name)] = Tensor(value.size, _to_f32_bytes(raw, st.dtype, where))
        return tensors


# ----------------------------------------------------------------------------------------------
# safetensors.

def read_safetensors(path):
    """{name: Tensor} of a safetensors file (F32, F64, F16, BF16 converted to fp32)."""
    with open(path, "rb") as f:
        blob = f.read()
    if len(blob) < 8:
        raise CheckpointImportError(f"{path}: {len(blob)} bytes, too short for a safetensors header")
    n = struct.unpack_from("<Q", blob, 0)[0]
    if 8 + n > len(blob):
        raise CheckpointImportError(f"{path}: header length {n} runs past the end of the file")
    try:
        header = json.loads(blob[8:8 + n])
    except ValueError as e:
        raise CheckpointImportError(f"{path}: header is not valid JSON: {e}") from None
    data = memoryview(blob)[8 + n:]
    tensors = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        where = f"{path}: tensor {name}"
        try:
            dtype, shape = meta["dtype"], [int(d) for d in meta["shape"]]
            begin, end = (int(o) for o in meta["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointImportError(f"{where}: malformed header entry {meta!r}") from None
        if dtype not in _ITEMSIZE:
            raise CheckpointImportError(f"{where}: dtype {dtype} is not one megacpp reads "
                               "(F32, F64, F16, BF16)")
        if not 0 <= begin <= end <= len(data) or end - begin != _numel(shape) * _ITEMSIZE[dtype]:
            raise CheckpointImportError(f"{where}: data_offsets [{begin}, {end}] do not hold shape {shape} "
                               f"of {dtype} in a data section of {len(data)} bytes")
        tensors[name] = Tensor(shape, _to_f32_bytes(bytes(data[begin:end]), dtype, where))
    return tensors


def write_safetensors(path, tensors, metadata=None):
    """F32, names sorted, every tensor 8-byte aligned (the header padded with spaces), written to
    a temporary file first so that a crash leaves no half-written checkpoint."""
    header, offset = {}, 0
    if metadata:
        header["__metadata__"] = dict(metadata)
    names = sorted(tensors)
    for name in names:
        size = len(tensors[name].data)
        header[name] = {"dtype": "F32", "shape": tensors[name].shape,
                        "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for name in names:
            f.write(tensors[name].data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# ----------------------------------------------------------------------------------------------
# config.json: MambaConfig's keys, official defaults -> megacpp's explicit values.

# Mamba3.__init__'s keyword arguments and their defaults (mamba_ssm/modules/mamba3.py), so a key
# the official model took by default is written out: megacpp's own defaults differ (is_mimo).
_OFFICIAL_SSM_DEFAULTS = {"d_state": 128, "expand": 2, "headdim": 64, "ngroups": 1,
                          "rope_fraction": 0.5, "dt_min": 0.001, "dt_max": 0.1,
                          "dt_init_floor": 1e-4, "A_floor": 1e-4, "is_outproj_norm": False,
                          "is_mimo": False, "mimo_rank": 4, "fuse_pregate_headwise_norm": True,
                          "chunk_size": 64, "dropout": 0.0}
# MHA.__init__'s (mamba_ssm/modules/mha.py).
_OFFICIAL_ATTN_DEFAULTS = {"num_heads": None, "num_heads_kv": None, "head_dim": None,
                           "mlp_dim": 0, "qkv_proj_bias": True, "out_proj_bias": True,
                           "softmax_scale": None, "causal": False, "d_conv": 0,
                           "rotary_emb_dim": 0, "rotary_emb_base": 10000.0,
                           "rotary_emb_interleaved": False}
_TOP_KEYS = {"d_model", "d_intermediate", "n_layer", "vocab_size", "ssm_cfg", "attn_layer_idx",
             "attn_cfg", "rms_norm", "residual_in_fp32", "fused_add_norm",
             "pad_vocab_size_multiple", "tie_embeddings"}
_TOP_DEFAULTS = {"d_model": 2560, "d_intermediate": 0, "n_layer": 64, "vocab_size": 50277,
                 "rms_norm": True, "residual_in_fp32": True, "fused_add_norm": True,
                 "pad_vocab_size_multiple": 8, "tie_embeddings": True}


def official_config_to_ours(official, source="config.json"):
    """(our config.json dict, is_siso) from the official config.json dict."""
    if not isinstance(official, dict):
        raise CheckpointImportError(f"{source}: not a JSON object")
    unknown = sorted(set(official) - _TOP_KEYS)
    if unknown:
        raise CheckpointImportError(f"{source}: unknown key {unknown[0]} (MambaConfig has "
                           f"{', '.join(sorted(_TOP_KEYS))})")
    top = dict(_TOP_DEFAULTS)
    top.update({k: v for k, v in official.items() if k not in ("ssm_cfg", "attn_cfg")})
    if not top["rms_norm"]:
        raise CheckpointImportError(f"{source}: rms_norm=false (LayerNorm): megacpp implements RMSNorm only")
    attn_layers = list(top.get("attn_layer_idx") or [])
    has_mamba = len(set(attn_layers)) < top["n_layer"]

    ssm_in = dict(official.get("ssm_cfg") or {})
    layer = ssm_in.pop("layer", "Mamba1")
    if has_mamba and layer != "Mamba3":
        raise CheckpointImportError(f"{source}: ssm_cfg.layer={layer!r}: only Mamba3 models are imported "
                           "(the official model defaults to Mamba1 when the key is absent)")
    unknown = sorted(set(ssm_in) - set(_OFFICIAL_SSM_DEFAULTS))
    if unknown:
        raise CheckpointImportError(f"{source}: unknown key ssm_cfg.{unknown[0]} (Mamba3 takes "
                           f"{', '.join(sorted(_OFFICIAL_SSM_DEFAULTS))})")
    ssm = dict(_OFFICIAL_SSM_DEFAULTS)
    ssm.update(ssm_in)
    if has_mamba and ssm["is_outproj_norm"]:
        raise CheckpointImportError(f"{source}: ssm_cfg.is_outproj_norm=true: megacpp's Mamba-3 has no "
                           "output norm (the spec's model is is_outproj_norm=false)")
    is_siso = not ssm["is_mimo"]
    ours_ssm = {"layer": "Mamba3"}
    for key in ("d_state", "expand", "headdim", "ngroups", "rope_fraction", "dt_min", "dt_max",
                "dt_init_floor", "A_floor", "chunk_size"):
        ours_ssm[key] = ssm[key]
    # The SISO path is megacpp's R = 1 with mimo_x/z/o = 1.
    ours_ssm["is_mimo"] = True
    ours_ssm["mimo_rank"] = 1 if is_siso else ssm["mimo_rank"]

    attn_in = dict(official.get("attn_cfg") or {})
    unknown = sorted(set(attn_in) - set(_OFFICIAL_ATTN_DEFAULTS))
    if unknown:
        raise CheckpointImportError(f"{source}: unknown key attn_cfg.{unknown[0]} (MHA takes "
                           f"{', '.join(sorted(_OFFICIAL_ATTN_DEFAULTS))})")
    attn = dict(_OFFICIAL_ATTN_DEFAULTS)
    attn.update(attn_in)
    ours_attn = {}
    if attn_layers:
        if not attn["causal"]:
            raise CheckpointImportError(f"{source}: attn_cfg.causal is {attn_in.get('causal', 'absent')} "
                               "(MHA's default is false): megacpp's attention is causal only")
        for key in ("mlp_dim", "d_conv"):
            if attn[key]:
                raise CheckpointImportError(f"{source}: attn_cfg.{key}={attn[key]}: megacpp's attention "
                                   "has no MLP branch or convolution")
        if attn["num_heads"] is None:
            raise CheckpointImportError(f"{source}: attn_cfg.num_heads is required for attention layers")
        ours_attn = {k: attn[k] for k in ("num_heads", "qkv_proj_bias", "out_proj_bias",
                                          "rotary_emb_dim", "rotary_emb_base",
                                          "rotary_emb_interleaved", "causal")}
        for key in ("num_heads_kv", "head_dim", "softmax_scale"):
            if attn[key] is not None:
                ours_attn[key] = attn[key]

    ours = {"d_model": top["d_model"], "n_layer": top["n_layer"],
            "d_intermediate": top["d_intermediate"], "vocab_size": top["vocab_size"],
            "pad_vocab_size_multiple": top["pad_vocab_size_multiple"], "ssm_cfg": ours_ssm,
            "attn_layer_idx": attn_layers, "attn_cfg": ours_attn, "rms_norm": True,
            "residual_in_fp32": top["residual_in_fp32"], "fused_add_norm": True,
            "tie_embeddings": top["tie_embeddings"]}
    return ours, is_siso


# ----------------------------------------------------------------------------------------------
# The expected tensors of a config (megacpp's parameter set, runtime/model/model.cpp).

def _dims(cfg):
    ssm = cfg["ssm_cfg"]
    d_model = cfg["d_model"]
    d_inner = ssm["expand"] * d_model
    n, g, r, p = ssm["d_state"], ssm["ngroups"], ssm["mimo_rank"], ssm["headdim"]
    if d_inner % p:
        raise CheckpointImportError(f"config.json: ssm_cfg.headdim={p} does not divide d_inner={d_inner}")
    angles = int(ssm["rope_fraction"] * n)
    angles = (angles - angles % 2) // 2
    return d_inner, d_inner // p, n, g, r, p, angles


def expected_shapes(cfg):
    """{name: shape} of our checkpoint for config `cfg` (our config.json dict)."""
    d = cfg["d_model"]
    mult = cfg["pad_vocab_size_multiple"]
    vocab = (cfg["vocab_size"] + mult - 1) // mult * mult
    shapes = {"backbone.embedding.weight": [vocab, d], "backbone.norm_f.weight": [d],
              "lm_head.weight": [vocab, d]}
    attn_layers = set(cfg["attn_layer_idx"])
    hidden = (cfg["d_intermediate"] + 127) // 128 * 128
    for i in range(cfg["n_layer"]):
        p = f"backbone.layers.{i}."
        shapes[p + "norm.weight"] = [d]
        m = p + "mixer."
        if i in attn_layers:
            a = cfg["attn_cfg"]
            hq = a["num_heads"]
            hkv = a.get("num_heads_kv") or hq
            hd = a.get("head_dim") or d // hq
            shapes[m + "in_proj.weight"] = [(hq + 2 * hkv) * hd, d]
            if a["qkv_proj_bias"]:
                shapes[m + "in_proj.bias"] = [(hq + 2 * hkv) * hd]
            shapes[m + "out_proj.weight"] = [d, hq * hd]
            if a["out_proj_bias"]:
                shapes[m + "out_proj.bias"] = [d]
        else:
            d_inner, h, n, g, r, hp, angles = _dims(cfg)
            shapes[m + "in_proj.weight"] = [2 * d_inner + 2 * n * g * r + 3 * h + angles, d]
            shapes[m + "dt_bias"] = [h]
            for name in ("B_bias", "C_bias"):
                shapes[m + name] = [h, r, n]
            for name in ("B_norm.weight", "C_norm.weight"):
                shapes[m + name] = [n]
            for name in ("mimo_x", "mimo_z", "mimo_o"):
                shapes[m + name] = [h, r, hp]
            shapes[m + "D"] = [h]
            shapes[m + "out_proj.weight"] = [d, d_inner]
        if cfg["d_intermediate"] > 0:
            shapes[p + "norm2.weight"] = [d]
            shapes[p + "mlp.fc1.weight"] = [2 * hidden, d]
            shapes[p + "mlp.fc2.weight"] = [d, hidden]
    return shapes


# ----------------------------------------------------------------------------------------------
# The SISO state-dim order.

def _siso_perm(cfg):
    """perm with official SISO dim i = our dim perm[i] (bench/official_parity.py)."""
    n = cfg["ssm_cfg"]["d_state"]
    angles = _dims(cfg)[6]
    paired = [x for j in range(angles) for x in (j, j + n // 2)]
    taken = set(paired)
    return paired + [k for k in range(n) if k not in taken]


def _permute_last(t, order):
    """t with its last dim's element i taken from element order[i]."""
    n = t.shape[-1]
    src = memoryview(t.data)
    out = bytearray(len(t.data))
    for row in range(len(t.data) // (4 * n)):
        base = row * 4 * n
        for i, k in enumerate(order):
            out[base + 4 * i:base + 4 * i + 4] = src[base + 4 * k:base + 4 * k + 4]
    return Tensor(t.shape, out)


def _reorder_bc(tensors, cfg, order):
    """The B/C-related tensors of every Mamba-3 layer with state dim i taken from order[i]."""
    d_inner, _h, n, g, r, _p, _a = _dims(cfg)
    out = dict(tensors)
    attn_layers = set(cfg["attn_layer_idx"])
    for layer in range(cfg["n_layer"]):
        if layer in attn_layers:
            continue
        m = f"backbone.layers.{layer}.mixer."
        w = tensors[m + "in_proj.weight"]
        row = 4 * w.shape[1]
        data = bytearray(w.data)
        for block in range(2 * g * r):  # B's G·R vectors of N rows, then C's
            base = 2 * d_inner + block * n
            for i, k in enumerate(order):
                data[(base + i) * row:(base + i + 1) * row] = \
                    w.data[(base + k) * row:(base + k + 1) * row]
        out[m + "in_proj.weight"] = Tensor(w.shape, data)
        for name in ("B_bias", "C_bias", "B_norm.weight", "C_norm.weight"):
            out[m + name] = _permute_last(tensors[m + name], order)
    return out


def ours_to_official_siso(tensors, cfg):
    """Our R = 1 tensors in the official SISO path's state order (siso_state_order)."""
    return _reorder_bc(tensors, cfg, _siso_perm(cfg))


def official_siso_to_ours(tensors, cfg):
    """The inverse: official SISO state order back to ours (our dim perm[i] = official dim i)."""
    perm = _siso_perm(cfg)
    inverse = [0] * len(perm)
    for i, k in enumerate(perm):
        inverse[k] = i
    return _reorder_bc(tensors, cfg, inverse)


# ----------------------------------------------------------------------------------------------

def _ones(shape):
    return Tensor(shape, struct.pack("<f", 1.0) * _numel(shape))


def import_official(official_dir, out_dir):
    """Converts the official save_pretrained directory `official_dir` into our checkpoint
    directory `out_dir` (created if missing). Returns our config dict. Raises CheckpointImportError
    naming the file and the key or tensor for anything it cannot convert exactly."""
    config_path = os.path.join(official_dir, "config.json")
    if not os.path.isfile(config_path):
        raise CheckpointImportError(f"{config_path}: missing (save_pretrained writes config.json)")
    try:
        with open(config_path) as f:
            official = json.load(f)
    except ValueError as e:
        raise CheckpointImportError(f"{config_path}: not valid JSON: {e}") from None
    cfg, is_siso = official_config_to_ours(official, config_path)

    st_path = os.path.join(official_dir, "model.safetensors")
    bin_path = os.path.join(official_dir, "pytorch_model.bin")
    if os.path.isfile(st_path):
        weights_path, tensors = st_path, read_safetensors(st_path)
    elif os.path.isfile(bin_path):
        weights_path, tensors = bin_path, read_pytorch_bin(bin_path)
    else:
        raise CheckpointImportError(f"{official_dir}: neither pytorch_model.bin nor model.safetensors "
                           "(save_pretrained writes pytorch_model.bin)")

    expected = expected_shapes(cfg)
    attn_layers = set(cfg["attn_layer_idx"])
    mimo_names = [f"backbone.layers.{i}.mixer.{name}" for i in range(cfg["n_layer"])
                  if i not in attn_layers for name in ("mimo_x", "mimo_z", "mimo_o")]
    if is_siso:
        present = [n for n in mimo_names if n in tensors]
        if present:
            raise CheckpointImportError(f"{weights_path}: tensor {present[0]} in a SISO model "
                               "(ssm_cfg.is_mimo false has no mimo_x/z/o)")
        for name in mimo_names:
            tensors[name] = _ones(expected[name])
    if cfg["tie_embeddings"]:
        embedding = tensors.get("backbone.embedding.weight")
        head = tensors.get("lm_head.weight")
        if head is None and embedding is not None:
            tensors["lm_head.weight"] = embedding  # a state_dict saved without the tied copy
        elif head is not None and embedding is not None and head != embedding:
            raise CheckpointImportError(f"{weights_path}: tensor lm_head.weight differs from "
                               "backbone.embedding.weight, but config.json ties them "
                               "(tie_embeddings true)")
    elif "lm_head.weight" not in tensors:
        raise CheckpointImportError(f"{weights_path}: tensor lm_head.weight is missing, and config.json "
                           "does not tie it to the embedding (tie_embeddings false)")
    for name in sorted(tensors):
        if name not in expected:
            raise CheckpointImportError(f"{weights_path}: unexpected tensor {name} (not a parameter of "
                               "the model config.json describes)")
        if tensors[name].shape != expected[name]:
            raise CheckpointImportError(f"{weights_path}: tensor {name} has shape {tensors[name].shape}, "
                               f"config.json implies {expected[name]}")
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise CheckpointImportError(f"{weights_path}: tensor {missing[0]} is missing"
                           + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    if is_siso:
        tensors = official_siso_to_ours(tensors, cfg)

    os.makedirs(out_dir, exist_ok=True)
    write_safetensors(os.path.join(out_dir, "model.safetensors"), tensors,
                      {"format": "pt", "writer": "megacpp_checkpoint.import_official",
                       "source": os.path.abspath(weights_path)})
    tmp = os.path.join(out_dir, "config.json.tmp")
    with open(tmp, "w") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")
    os.replace(tmp, os.path.join(out_dir, "config.json"))
    return cfg


def _main(argv):
    if len(argv) != 2:
        print("usage: python3 -m megacpp_checkpoint OFFICIAL_DIR OUT_DIR", file=sys.stderr)
        return 2
    try:
        cfg = import_official(argv[0], argv[1])
    except (CheckpointImportError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {argv[1]} (n_layer {cfg['n_layer']}, d_model {cfg['d_model']}, "
          f"mimo_rank {cfg['ssm_cfg']['mimo_rank']})")
    return 0
