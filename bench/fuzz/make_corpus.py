#!/usr/bin/env python3
"""Writes the seed corpus of each fuzz target under bench/fuzz/corpus/<target>/.

The seeds are small valid inputs (plus a near miss or two) covering each format's branches, so
that libFuzzer starts from inputs that get past the magic numbers and framing. The files are
committed; this script documents how they were made and regenerates them. No third-party
modules: the binary formats are written by hand here.
Usage: make_corpus.py [OUT_DIR]  (default: the corpus/ folder beside this script)
"""
import json
import os
import struct
import sys
import zlib


def write(root, target, name, data):
    os.makedirs(os.path.join(root, target), exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    with open(os.path.join(root, target, name), "wb") as f:
        f.write(data)


# --- safetensors ----------------------------------------------------------------------------------
def safetensors(tensors, metadata=None):
    """tensors: [(name, dtype, shape, raw bytes)] in file order."""
    header, offset, body = {}, 0, b""
    if metadata is not None:
        header["__metadata__"] = metadata
    for name, dtype, shape, raw in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
        body += raw
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    return struct.pack("<Q", len(text)) + text + body


def safetensors_seeds(root):
    f32 = struct.pack("<6f", 1, -2, 0.5, 3e38, float("inf"), float("nan"))
    write(root, "safetensors", "f32_matrix", safetensors(
        [("w", "F32", [2, 3], f32)], {"format": "pt"}))
    write(root, "safetensors", "all_dtypes", safetensors([
        ("a.f64", "F64", [2], struct.pack("<2d", 1e300, -1e-300)),
        ("b.f16", "F16", [3], struct.pack("<3H", 0x3C00, 0x0001, 0x7C00)),
        ("c.bf16", "BF16", [2], struct.pack("<2H", 0x3F80, 0xFF80)),
        ("d.scalar", "F32", [], struct.pack("<f", 7.0)),
        ("e.empty", "F32", [0, 4], b""),
    ]))
    write(root, "safetensors", "empty_header", safetensors([]))
    # A near miss: the tensor claims one byte more than the file holds.
    bad = safetensors([("w", "F32", [1], struct.pack("<f", 1.0))])
    write(root, "safetensors", "truncated", bad[:-1])


# --- Megatron MMIDIDX -----------------------------------------------------------------------------
def mmidx(dtype_code, token_size, documents, modes=False):
    """documents: lists of token values, one sequence per document. Returns the fuzz input:
    u32 bin length, the .bin, then the .idx (see indexed_dataset_fuzz.cpp)."""
    fmt = {1: "B", 2: "b", 3: "h", 4: "i", 5: "q", 8: "H"}[dtype_code]
    binary = b"".join(struct.pack("<%d%s" % (len(d), fmt), *d) for d in documents)
    lengths = [len(d) for d in documents]
    pointers, position = [], 0
    for n in lengths:
        pointers.append(position)
        position += n * token_size
    doc_index = list(range(len(documents) + 1))
    idx = b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, dtype_code, len(lengths), len(doc_index))
    idx += struct.pack("<%di" % len(lengths), *lengths)
    idx += struct.pack("<%dq" % len(pointers), *pointers)
    idx += struct.pack("<%dq" % len(doc_index), *doc_index)
    if modes:
        idx += bytes(len(lengths))
    return struct.pack("<I", len(binary)) + binary + idx


def indexed_dataset_seeds(root):
    write(root, "indexed_dataset", "uint16_two_docs", mmidx(8, 2, [[1, 2, 3], [256, 65535]]))
    write(root, "indexed_dataset", "uint8_with_empty_doc", mmidx(1, 1, [[7, 8], [], [9]]))
    write(root, "indexed_dataset", "int64_out_of_int32", mmidx(5, 8, [[1, 1 << 40]]))
    write(root, "indexed_dataset", "int32_multimodal", mmidx(4, 4, [[-1, 5], [6]], modes=True))
    write(root, "indexed_dataset", "no_sequences", mmidx(3, 2, []))


# --- daemon config --------------------------------------------------------------------------------
def daemon_config_seeds(root):
    write(root, "daemon_config", "minimal", json.dumps({"state_dir": "state"}))
    write(root, "daemon_config", "shipped", json.dumps({
        "listen_address": "127.0.0.1:50551", "http_address": "127.0.0.1:8551",
        "state_dir": "../state", "store_path": "../state/receipts.db",
        "checkpoint_root": "../state/checkpoints", "data_roots": ["../data"],
        "cache_dirs": ["../state/cache"], "min_free_bytes": 1073741824,
        "devices": {"cpu_slots": 1, "gpus": "auto"},
        "limits": {"max_queued_jobs": 64, "max_message_bytes": 4194304,
                   "max_spec_bytes": 262144},
        "security": {}, "allow_nvls": False}, indent=2))
    write(root, "daemon_config", "everything", json.dumps({
        "listen_address": "unix:/run/megacpp.sock", "http_address": "[::1]:0",
        "state_dir": "/var/lib/megacpp", "data_roots": ["/data/a", "b/../c"], "cache_dirs": [],
        "executor_path": "bin/megacpp-executor",
        "devices": {"cpu_slots": 0, "gpus": [0, 3]},
        "limits": {"max_concurrent_jobs": 2, "max_message_bytes": 65536, "max_spec_bytes": 1024},
        "security": {"token_file": "token", "tls_cert_file": "c.pem", "tls_key_file": "k.pem"}}))
    # Every limit at its lower bound, so that one decrement by the mutator crosses it (a value
    # below the bound takes the same branches as a valid one: coverage alone never leads there).
    write(root, "daemon_config", "lower_bounds", json.dumps({
        "state_dir": "s", "min_free_bytes": 0, "devices": {"cpu_slots": 0, "gpus": [0]},
        "limits": {"max_queued_jobs": 1, "max_concurrent_jobs": 1, "max_message_bytes": 1,
                   "max_spec_bytes": 1}}))
    write(root, "daemon_config", "unknown_key", '{"state_dir": "s", "limits": {"max_jobs": 1}}')
    # Found by the fuzzer: nlohmann reports this as out_of_range, not parse_error.
    write(root, "daemon_config", "number_beyond_double",
          '{"state_dir": "s", "min_free_bytes": 1e400}')


# --- executor event stream ------------------------------------------------------------------------
def varint(n):
    out = b""
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out += bytes([byte | 0x80])
        else:
            return out + bytes([byte])


def field(number, value):
    """int -> varint field, float -> fixed64 double, bytes/str -> length-delimited."""
    if isinstance(value, bool) or isinstance(value, int):
        return varint(number << 3) + varint(value & ((1 << 64) - 1))
    if isinstance(value, float):
        return varint(number << 3 | 1) + struct.pack("<d", value)
    if isinstance(value, str):
        value = value.encode()
    return varint(number << 3 | 2) + varint(len(value)) + value


def frame(payload):
    return varint(len(payload)) + payload


def event_stream_seeds(root):
    started = field(1, field(1, 1) + field(2, 400) + field(3, 2000000) +
                    field(4, '{"threads":2}'))
    step = field(2, field(1, 1) + field(2, 5.5) + field(3, 1.25) + field(4, 3e-3) +
                 field(5, 2048) + field(6, 12.5) + field(7, 1.6e5) + field(8, 2e9))
    evaluation = field(3, field(1, 100) + field(2, 4.25))
    checkpoint = field(4, field(1, 100) + field(2, "/state/checkpoints/job-000001/step-100"))
    kernel = field(7, field(1, "mamba3_scan_fwd") + field(2, "cuda:0") +
                   field(3, '{"grid":[1,2,3]}') + field(4, 128) + field(5, 0) + field(6, 49152) +
                   field(7, 0.5) + field(8, 0.1) + field(9, 0.2) + field(10, 0.3) + field(11, 5))
    write(root, "event_stream", "training_run", b"".join(frame(p) for p in [
        started, step, evaluation, checkpoint, field(6, "a log line"), kernel,
        field(5, '{"stop_reason":"steps"}')]))
    write(root, "event_stream", "failed", frame(field(8, "data: truncated")))
    write(root, "event_stream", "empty_events", frame(b"") + frame(b""))
    # A near miss: the last frame's length says one byte more than follows.
    write(root, "event_stream", "truncated_last", frame(step) + varint(len(evaluation) + 1) +
          evaluation)
    write(root, "event_stream", "unknown_field", frame(field(99, 7) + field(6, "x")))


# --- job spec -------------------------------------------------------------------------------------
def job_spec_seeds(root):
    write(root, "job_spec", "tiny_preset", json.dumps({
        "name": "tiny", "preset": "tiny", "train_data": "train", "valid_data": "valid",
        "steps": 400, "batch": 8, "seqlen": 256,
        "optimizer": {"lr": 0.003, "min_lr": 0.0003, "warmup_steps": 20, "weight_decay": 0.1,
                      "grad_clip": 1.0},
        "eval_interval": 100, "eval_batches": 8, "checkpoint_interval": 100, "seed": "1234",
        "max_seconds": 170, "restart_policy": "RESTART_POLICY_ON_INTERRUPT"}, indent=2))
    config = {"d_model": 64, "pattern": "M*M", "d_intermediate": 128, "vocab_size": 257,
              "ssm_cfg": {"d_state": 16, "headdim": 16, "mimo_rank": 2, "chunk_size": 8},
              "attn_cfg": {"num_heads": 4, "num_heads_kv": 2, "rotary_emb_dim": 8}}
    write(root, "job_spec", "inline_config", json.dumps({
        "config_json": json.dumps(config), "train_data": "train", "steps": 10, "batch": 2,
        "seqlen": 32, "grad_accum": 2, "threads": 1, "restart_policy": "RESTART_POLICY_ON_FAILURE",
        "max_restarts": 2}))
    write(root, "job_spec", "cuda_tensor_parallel", json.dumps({
        "preset": "tiny", "train_data": "train", "steps": 1, "batch": 1, "seqlen": 2,
        "device_kind": "cuda", "device_count": 2, "tensor_parallel": 2,
        "featureGates": ["psiv_cache", "tma"]}))
    # Found by the fuzzer: the system calls saw only "ROOT/" and the spec was accepted.
    write(root, "job_spec", "nul_in_path", json.dumps({
        "preset": "tiny", "train_data": "train\u0000x", "steps": 1, "batch": 1, "seqlen": 2}))
    write(root, "job_spec", "outside_root", json.dumps({
        "preset": "tiny", "train_data": "/etc/passwd", "steps": 1, "batch": 1, "seqlen": 2}))


# --- plan cache (base/plan_cache.h) ---------------------------------------------------------------
def plan_cache(scope, records, version=1, count=None):
    """records: [(key bytes, value bytes)] in file order."""
    scope = scope.encode()
    header = struct.pack("<III", version, len(scope), len(records) if count is None else count)
    header += scope
    out = b"MCPPLAN1" + header + struct.pack("<I", zlib.crc32(header))
    for key, value in records:
        record = struct.pack("<II", len(key), len(value)) + key + value
        out += record + struct.pack("<I", zlib.crc32(record))
    return out


def plan_cache_seeds(root):
    algo = bytes(range(64)) + struct.pack("<Q", 1 << 20)
    write(root, "plan_cache", "two_records", plan_cache(
        "cublaslt-120803/sm_90/NVIDIA H100", [(b"op=1,0 mnk=8,8,8", algo), (b"op=0,0", b"")]))
    write(root, "plan_cache", "empty", plan_cache("s", []))
    write(root, "plan_cache", "count_says_more", plan_cache("s", [(b"k", b"v")], count=2))
    write(root, "plan_cache", "other_version", plan_cache("s", [(b"k", b"v")], version=2))
    good = plan_cache("s", [(b"a", b"first"), (b"b", b"second")])
    write(root, "plan_cache", "flipped_byte", good[:-6] + b"X" + good[-5:])


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "corpus")
    safetensors_seeds(root)
    indexed_dataset_seeds(root)
    daemon_config_seeds(root)
    event_stream_seeds(root)
    job_spec_seeds(root)
    plan_cache_seeds(root)


if __name__ == "__main__":
    main()
