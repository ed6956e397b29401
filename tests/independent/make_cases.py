#!/usr/bin/env python3
"""Writes `msa run-case` input files for the independent check (NumPy only).

Cases: a mixed pack of document lengths around block edges, smaller packs at 64/4 and 32/2
heads, all-zero index vectors (ties), chunked prefill (q_len < k_len), context-parallel
fragments sharing one KV range, non-default forcing and scales, a caller-supplied selection,
FP8 E4M3 index inputs, and an invalid selection that must be rejected. Inputs are random bf16,
normal x 0.2 (the FP8 index inputs normal x 0.5).
Inference cases (decode Q = 1 / 4 / 8 and paged prefill with prefixes 0, 1, 127, 128, 129 and
beyond 16 pages) cover bf16, fp8 (per-tensor and per-(head, token) scales, fp8 index-K) and
nvfp4 (with and without global scales) caches with shuffled physical pages and NaN in every
slot no request owns.

    python3 make_cases.py --out DIR [--seed S]
"""

import argparse
import json
import os

import numpy as np

import inference_np as inf
import safetensors_np as st

D = 128


class Case:
    """One input file plus what the checker needs to know about it."""

    def __init__(self, name, description, path, expect_error=None, exact_selection=False, given_topk=False):
        self.name = name
        self.description = description
        self.path = path
        self.expect_error = expect_error  # regex the error message must match (exit code 2)
        self.exact_selection = exact_selection  # ties: sets must match exactly, no near-tie slack
        self.given_topk = given_topk


def _bf16(rng, shape):
    return st.Tensor("BF16", st.f64_to_bf16_bits(rng.standard_normal(shape, dtype=np.float32) * np.float32(0.2)))


def _i32(values):
    return st.Tensor("I32", np.asarray(values, dtype=np.int32))


def _write_case(out_dir, name, rng, cu_q, cu_k, hq, hkv, fragments=None, grad=True, zero_index=False, metadata=None,
                topk=None, fp8_index=False):
    total_q, total_k = cu_q[-1], cu_k[-1]
    tensors = {
        "q": _bf16(rng, (total_q, hq, D)),
        "k": _bf16(rng, (total_k, hkv, D)),
        "v": _bf16(rng, (total_k, hkv, D)),
        "index_q": _bf16(rng, (total_q, hkv, D)),
        "index_k": _bf16(rng, (total_k, 1, D)),
        "cu_seqlens_q": _i32(cu_q),
        "cu_seqlens_k": _i32(cu_k),
    }
    if zero_index:
        tensors["index_q"] = st.Tensor("BF16", np.zeros((total_q, hkv, D), np.uint16))
        tensors["index_k"] = st.Tensor("BF16", np.zeros((total_k, 1, D), np.uint16))
    if fp8_index:  # FP8 E4M3 index inputs (scale 1), normal x 0.5
        tensors["index_q"] = st.Tensor("F8_E4M3", inf.e4m3_encode(rng.standard_normal((total_q, hkv, D)) * 0.5))
        tensors["index_k"] = st.Tensor("F8_E4M3", inf.e4m3_encode(rng.standard_normal((total_k, 1, D)) * 0.5))
    if fragments is not None:
        tensors["fragment_indices"] = _i32(fragments)
    if grad:
        tensors["grad_out"] = _bf16(rng, (total_q, hq, D))
    if topk is not None:
        tensors["topk"] = _i32(topk)
    path = os.path.join(out_dir, f"{name}.safetensors")
    st.write(path, tensors, metadata or {})
    return path


def _write_inference_case(out_dir, name, rng, mode, seq_lens, hq, hkv, kv_format, q_lens=None, q_len_per_req=None,
                          scales=None, global_scale=None, fp8_index_k=False, fp8_index_q=False, unused_pages=3,
                          metadata=None):
    """A paged-cache case (docs/inference.md, `msa run-case` inference modes). The physical pages
    of all requests are shuffled together with `unused_pages` extra ones; every cache slot that
    no request owns (unused pages, the tail of a request's last page) holds NaN, and page table
    entries past a request's pages point at NaN pages or are -1, so any read of them shows.
    scales: None, "tensor" (FP8 per-tensor, or the NVFP4 global scale) or "token" (FP8 per
    (head, token slot))."""
    batch = len(seq_lens)
    if mode == "decode":
        q_lens = [q_len_per_req] * batch
    total_q = sum(q_lens)
    pages = [(n + inf.PAGE - 1) // inf.PAGE for n in seq_lens]
    phys_count = sum(pages) + unused_pages
    order = rng.permutation(phys_count)
    nan_pages = [int(p) for p in order[sum(pages):]]
    max_pages = max(pages) + 2
    table = np.full((batch, max_pages), -1, dtype=np.int32)
    used = 0
    for b, n in enumerate(pages):
        table[b, :n] = order[used:used + n]
        used += n
        if b % 2 == 0 and nan_pages:  # entries past the request's pages: a NaN page, or -1
            table[b, n:] = nan_pages[b % len(nan_pages)]
    valid = np.zeros((phys_count, inf.PAGE), dtype=bool)  # slots holding a request's token
    for b, n in enumerate(seq_lens):
        phys, off = inf.token_slots(table[b], n)
        valid[phys, off] = True

    def values(shape, std):
        return rng.standard_normal(shape) * std

    # q larger than in the training cases so that the softmax is far from uniform and a wrong
    # K (scale, page, slot) shows in out, not only in the LSE.
    tensors = {"q": st.Tensor("BF16", st.f64_to_bf16_bits(values((total_q, hq, D), 1.0))), "page_table": _i32(table),
               "seq_lens": _i32(seq_lens)}
    index_q = values((total_q, hkv, D), 0.3)
    tensors["index_q"] = (st.Tensor("F8_E4M3", inf.e4m3_encode(index_q)) if fp8_index_q
                          else st.Tensor("BF16", st.f64_to_bf16_bits(index_q)))
    index_k = np.where(valid[..., None], values((phys_count, inf.PAGE, D), 0.3), np.nan)
    tensors["index_k_cache"] = (st.Tensor("F8_E4M3", inf.e4m3_encode(index_k)) if fp8_index_k
                                else st.Tensor("BF16", st.f64_to_bf16_bits(index_k)))
    slot_valid = valid[:, None, :, None]  # [phys, 1, 128, 1]
    for which in ("k", "v"):
        x = np.where(slot_valid, values((phys_count, hkv, inf.PAGE, D), 0.5), np.nan)  # [phys, Hkv, 128, D]
        if kv_format == "bf16":
            tensors[f"{which}_cache"] = st.Tensor("BF16", st.f64_to_bf16_bits(x))
        elif kv_format == "fp8" and scales == "token":
            # [Hkv, max_kv_tokens], slot = physical page * 128 + offset; NaN where no token lives
            scale = np.where(valid[:, None, :], rng.uniform(0.5, 2.0, (phys_count, hkv, inf.PAGE)) / 448 * 2.5, np.nan)
            tensors[f"{which}_cache"] = st.Tensor("F8_E4M3", inf.e4m3_encode(x / scale[..., None]))
            tensors[f"{which}_scale"] = st.Tensor("F32", scale.transpose(1, 0, 2).reshape(hkv, phys_count * inf.PAGE))
        elif kv_format == "fp8":
            scale = 0.01 if which == "k" else 0.02
            tensors[f"{which}_cache"] = st.Tensor("F8_E4M3", inf.e4m3_encode(x / scale))
            if scales == "tensor":
                tensors[f"{which}_scale"] = st.Tensor("F32", np.array([scale], dtype=np.float32))
        else:  # nvfp4
            g = (0.25 if which == "k" else 4.0) if global_scale else 1.0
            packed, sf = inf.nvfp4_encode(np.nan_to_num(x / g))
            sf[~valid[:, None, :, None].repeat(hkv, 1).repeat(8, 3)] = 0x7F  # NaN block scales off the tokens
            tensors[f"{which}_cache"] = st.Tensor("U8", packed)
            tensors[f"{which}_cache_sf"] = st.Tensor("F8_E4M3", sf)
            if global_scale:
                tensors[f"{which}_scale"] = st.Tensor("F32", np.array(g, dtype=np.float32))
    meta = {"mode": mode, "kv_format": kv_format, **(metadata or {})}
    if mode == "decode":
        meta["q_len_per_req"] = str(q_len_per_req)
    else:
        tensors["cu_seqlens_q"] = _i32(np.concatenate([[0], np.cumsum(q_lens)]))
    path = os.path.join(out_dir, f"{name}.safetensors")
    st.write(path, tensors, meta)
    return path


def _self_attention(lengths):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cu, cu


def _random_selection(rng, cu_q, cu_k, hkv):
    """A valid selection that is not the indexer's: per row a random number of distinct
    earlier blocks in random order, then the query's own block last; -1 padding."""
    total_q = cu_q[-1]
    topk = np.full((hkv, total_q, 16), -1, dtype=np.int32)
    for b in range(len(cu_q) - 1):
        q_len, k_len = cu_q[b + 1] - cu_q[b], cu_k[b + 1] - cu_k[b]
        for i in range(q_len):
            local = (k_len - q_len + i) // 128
            for g in range(hkv):
                count = int(rng.integers(0, min(15, local) + 1))
                history = rng.permutation(local)[:count]
                row = list(history) + [local]
                topk[g, cu_q[b] + i, : len(row)] = row
    return topk


def make_cases(out_dir, seed=1):
    os.makedirs(out_dir, exist_ok=True)
    rng = np.random.default_rng(seed)
    cases = []

    def add(name, description, **kwargs):
        case_kwargs = {k: kwargs.pop(k) for k in ("expect_error", "exact_selection") if k in kwargs}
        path = _write_case(out_dir, name, rng, **kwargs)
        cases.append(Case(name, description, path, given_topk=kwargs.get("topk") is not None, **case_kwargs))

    cu_q, cu_k = _self_attention([1, 127, 128, 129, 2047, 2048, 2049])
    add("mixed_pack_16x1", "documents of 1, 127, 128, 129, 2047, 2048, 2049 tokens; 16 q / 1 kv heads (TP=4)",
        cu_q=cu_q, cu_k=cu_k, hq=16, hkv=1)

    cu_q, cu_k = _self_attention([1, 129, 300, 257])
    add("mixed_pack_64x4", "documents of 1, 129, 300, 257 tokens; 64 q / 4 kv heads (MiniMax-M3)",
        cu_q=cu_q, cu_k=cu_k, hq=64, hkv=4)

    cu_q, cu_k = _self_attention([200, 1, 2200])
    add("pack_32x2", "documents of 200, 1, 2200 tokens; 32 q / 2 kv heads (TP=2)", cu_q=cu_q, cu_k=cu_k, hq=32, hkv=2)

    cu_q, cu_k = _self_attention([2304])
    add("ties_zero_index", "all-zero index vectors, 2304 tokens (18 blocks): ties go to the lower block id",
        cu_q=cu_q, cu_k=cu_k, hq=16, hkv=1, zero_index=True, exact_selection=True)

    # Chunked prefill: the new queries are the causal suffix of each request's KV.
    add("chunked_prefill", "q_len < k_len: (300 of 2600), (1 of 4000), (129 of 129) tokens",
        cu_q=[0, 300, 301, 430], cu_k=[0, 2600, 6600, 6729], hq=16, hkv=1)

    # Context parallelism: document A (3000 tokens) holds its KV once; its fragments are the
    # first and the last 500 queries (zig-zag). Document B (700 tokens): two fragments.
    add("fragments_shared_kv", "CP fragments sharing one KV range: A 0..500 + 2500..3000 of 3000, B 0..300 + 300..700",
        cu_q=[0, 500, 1000, 1300, 1700], cu_k=[0, 500, 3000, 3300, 3700], fragments=[0, 0, 2, 2], hq=16, hkv=1)

    add("forcing_and_scales", "init_blocks 2, local_blocks 2, lse_temperature 2, softmax/index scales, q_per_cta 3",
        cu_q=[0, 700], cu_k=[0, 3000], hq=16, hkv=1,
        metadata={"init_blocks": "2", "local_blocks": "2", "lse_temperature": "2.0", "softmax_scale": "0.05",
                  "index_scale": "0.1", "q_per_cta": "3", "kl_grad_scale": "0.001"})

    cu_q, cu_k = _self_attention([2600, 129, 1])
    add("fp8_index_inputs", "FP8 E4M3 index_q and index_k (scale 1): documents of 2600, 129, 1 tokens; 32 q / 2 kv heads",
        cu_q=cu_q, cu_k=cu_k, hq=32, hkv=2, fp8_index=True)

    cu_q, cu_k = [0, 600, 800], [0, 3000, 3200]
    add("given_topk", "caller-supplied selection: random valid subsets in random order, local last (indexer skipped)",
        cu_q=cu_q, cu_k=cu_k, hq=16, hkv=1, topk=_random_selection(rng, cu_q, cu_k, 1))

    cu_q, cu_k = _self_attention([300])
    bad = _random_selection(rng, cu_q, cu_k, 1)
    bad[0, 299, :3] = [0, 0, 2]  # block 0 twice
    add("invalid_topk", "a selection with a repeated block id must be rejected", cu_q=cu_q, cu_k=cu_k, hq=16, hkv=1,
        grad=False, topk=bad, expect_error=r"topk\[0, 299, [0-9:]+\].*(twice|repeat)")

    # ---- inference over paged caches (docs/inference.md); context lengths in tokens ----
    def add_inference(name, description, **kwargs):
        cases.append(Case(name, description, _write_inference_case(out_dir, name, rng, **kwargs)))

    add_inference("decode_q1_bf16", "decode Q=1, bf16 cache: contexts 1, 100, 128, 2500 (20 pages), 0 (padding), 4100",
                  mode="decode", q_len_per_req=1, seq_lens=[1, 100, 128, 2500, 0, 4100], hq=16, hkv=1,
                  kv_format="bf16")
    add_inference("decode_q8_fp8", "decode Q=8, fp8 per-tensor scales, fp8 index-K and index-Q: contexts 8, 130, "
                  "2177, 3000, 0 (padding); num_kv_splits 4", mode="decode", q_len_per_req=8,
                  seq_lens=[8, 130, 2177, 3000, 0], hq=16, hkv=1, kv_format="fp8", scales="tensor", fp8_index_k=True,
                  fp8_index_q=True, metadata={"num_kv_splits": "4"})
    add_inference("decode_q8_fp8_token_64x4", "decode Q=8, fp8 per-(head, token) scales, 64/4 heads: contexts 9, 2100, 300",
                  mode="decode", q_len_per_req=8, seq_lens=[9, 2100, 300], hq=64, hkv=4, kv_format="fp8",
                  scales="token")
    add_inference("decode_q4_nvfp4_global", "decode Q=4, nvfp4 cache with global scales 0.25 / 4: contexts 4, 127, "
                  "2049, 3333", mode="decode", q_len_per_req=4, seq_lens=[4, 127, 2049, 3333], hq=16, hkv=1,
                  kv_format="nvfp4", global_scale=True)
    prefill = dict(mode="paged_prefill", seq_lens=[40, 51, 130, 258, 149, 2500, 4100],
                   q_lens=[40, 50, 3, 130, 20, 200, 30])
    prefixes = "prefixes 0, 1, 127, 128, 129, 2300, 4070"
    add_inference("paged_prefill_bf16", f"paged prefill, bf16 cache: {prefixes}", hq=16, hkv=1, kv_format="bf16",
                  **prefill)
    add_inference("paged_prefill_fp8", f"paged prefill, fp8 per-tensor scales, fp8 index-K: {prefixes}", hq=16, hkv=1,
                  kv_format="fp8", scales="tensor", fp8_index_k=True, **prefill)
    add_inference("paged_prefill_fp8_token", f"paged prefill, fp8 per-(head, token) scales: {prefixes}", hq=16, hkv=1,
                  kv_format="fp8", scales="token", **prefill)
    add_inference("paged_prefill_nvfp4", f"paged prefill, nvfp4 cache (no global scale): {prefixes}", hq=16, hkv=1,
                  kv_format="nvfp4", **prefill)

    with open(os.path.join(out_dir, "cases.json"), "w") as f:
        json.dump([vars(c) for c in cases], f, indent=2)
    return cases


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for the .safetensors inputs")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    for case in make_cases(args.out, args.seed):
        print(f"{case.path}: {case.description}")


if __name__ == "__main__":
    main()
