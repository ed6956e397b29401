#!/usr/bin/env python3
"""Writes the seed corpus of the fuzz targets (tests/fuzz/corpus/): small valid run-case inputs
of every mode (training forward / with gradients / with a given topk, decode over an NVFP4
cache, paged prefill over an FP8 cache) and a few near-misses. Standard library only;
deterministic. Run it again after changing it: python3 tests/fuzz/make_seeds.py
"""
import json
import os
import random
import struct

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus")
rng = random.Random(1)


def bf16(n, scale=0.2):
    out = bytearray()
    for _ in range(n):
        out += struct.pack("<f", rng.gauss(0, scale))[2:]  # the high half of an f32
    return bytes(out)


def fp8(n):
    return bytes(rng.choice([0x30, 0x38, 0x3c, 0xb0, 0xb8, 0x00]) for _ in range(n))


def i32(values):
    return struct.pack(f"<{len(values)}i", *values)


def write(name, tensors, metadata=None):
    """tensors: list of (name, dtype, shape, bytes)."""
    header, data = {}, b""
    if metadata:
        header["__metadata__"] = metadata
    for tname, dtype, shape, raw in sorted(tensors):
        header[tname] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(os.path.join(OUT, name), "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + data)


def training(tokens, cu, grad=False, topk=None, metadata=None):
    t = tokens
    tensors = [("q", "BF16", [t, 16, 128], bf16(t * 16 * 128)), ("k", "BF16", [t, 1, 128], bf16(t * 128)),
               ("v", "BF16", [t, 1, 128], bf16(t * 128)), ("index_q", "BF16", [t, 1, 128], bf16(t * 128)),
               ("index_k", "BF16", [t, 1, 128], bf16(t * 128)), ("cu_seqlens_q", "I32", [len(cu)], i32(cu)),
               ("cu_seqlens_k", "I32", [len(cu)], i32(cu))]
    if grad:
        tensors.append(("grad_out", "BF16", [t, 16, 128], bf16(t * 16 * 128)))
    if topk is not None:
        tensors.append(("topk", "I32", [1, t, 16], i32(topk)))
    return tensors, metadata


def main():
    os.makedirs(OUT, exist_ok=True)
    write("training_forward.safetensors", *training(3, [0, 2, 3]))
    write("training_grad.safetensors", *training(2, [0, 2], grad=True, metadata={"kl_grad_scale": "0.5"}))
    write("training_given_topk.safetensors",
          *training(2, [0, 1, 2], topk=[0] + [-1] * 15 + [0] + [-1] * 15,
                    metadata={"mode": "training", "lse_temperature": "2", "init_blocks": "0", "local_blocks": "1"}))
    write("decode_nvfp4.safetensors", [
        ("q", "BF16", [1, 16, 128], bf16(16 * 128)), ("index_q", "BF16", [1, 1, 128], bf16(128)),
        ("k_cache", "U8", [1, 1, 128, 64], bytes(rng.randrange(256) for _ in range(128 * 64))),
        ("v_cache", "U8", [1, 1, 128, 64], bytes(rng.randrange(256) for _ in range(128 * 64))),
        ("k_cache_sf", "F8_E4M3", [1, 1, 128, 8], fp8(128 * 8)), ("v_cache_sf", "F8_E4M3", [1, 1, 128, 8], fp8(128 * 8)),
        ("index_k_cache", "F8_E4M3", [1, 128, 128], fp8(128 * 128)), ("page_table", "I32", [1, 1], i32([0])),
        ("seq_lens", "I32", [1], i32([5]))], {"mode": "decode", "q_len_per_req": "1"})
    write("paged_prefill_fp8.safetensors", [
        ("q", "BF16", [3, 16, 128], bf16(3 * 16 * 128)), ("index_q", "BF16", [3, 1, 128], bf16(3 * 128)),
        ("k_cache", "F8_E4M3", [1, 1, 128, 128], fp8(128 * 128)), ("v_cache", "F8_E4M3", [1, 1, 128, 128], fp8(128 * 128)),
        ("k_scale", "F32", [1], struct.pack("<f", 0.5)), ("v_scale", "F32", [1], struct.pack("<f", 2.0)),
        ("index_k_cache", "F8_E4M3", [1, 128, 128], fp8(128 * 128)), ("page_table", "I32", [1, 1], i32([0])),
        ("seq_lens", "I32", [1], i32([5])), ("cu_seqlens_q", "I32", [2], i32([0, 3]))], {"mode": "paged_prefill"})
    # Near-misses: the reader's and the loader's early exits.
    write("empty_header.safetensors", [])
    write("metadata_only.safetensors", [], {"mode": "training", "format": "pt"})
    write("unknown_tensor.safetensors", [("bogus", "U8", [2], b"\x01\x02")])
    with open(os.path.join(OUT, "bad_length.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", 1 << 40) + b"{}")


if __name__ == "__main__":
    main()
