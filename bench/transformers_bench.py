#!/usr/bin/env python3
"""MiniMax-M3 in Hugging Face transformers: attn_implementation "msa" against transformers' own
"sdpa" and "eager" paths (their indexer computes a float32 score matrix [B, H_idx, S, S] and
the attention takes a dense block mask [B, Hq, S, S]) on one GPU.

Benchmark (default): random bf16 text models with MiniMax-M3's attention shapes (hidden 6144,
64 query heads, 4 KV heads, 4 index heads, head dim 128, top-16 blocks of 128):
  layer   one sparse layer (dense MLP of 1024, vocabulary 1024)
  model   4 layers: full attention + 3 sparse layers (dense MLP 12288, vocabulary 32000)
at 4k..128k tokens (batch 1): prefill (forward, use_cache=False, last-token logits), one training
step (forward + backward, loss on the last 1024 tokens' logits) and decode (one token at a time
on a DynamicCache filled by an msa prefill; median of --decode-steps steps). Times are
wall-clock around synchronised calls (median of --repeats after one warm-up); peak memory is
torch.cuda.max_memory_allocated during the case, weights and inputs included. A case that runs
out of memory is reported as OOM and the longer lengths of that implementation and mode are not
tried; cases are skipped once --budget seconds have passed. Prints a markdown table.

  python bench/transformers_bench.py [--part layer|model|all] [--lengths 4096 ... 131072]
                                     [--impls msa sdpa eager] [--budget 480]

Check (--check): a random text model with 2 sparse layers and one full layer (hidden 2048,
64 / 4 / 4 heads) through "msa": logits and 32 greedy tokens against "sdpa" at --compare-length
(where sdpa fits), a left-padded batch against its unpadded rows, then at --context (64k) one
training step (AdamW) and generate of 32 tokens with the dynamic and the static cache; sdpa is
tried at --context as well and compared where it fits. Exits 1 if a check fails.

  python bench/transformers_bench.py --check [--context 65536] [--compare-length 8192]
"""

import argparse
import copy
import gc
import statistics
import sys
import time

import torch

import msa.integrations.transformers as msa_hf

msa_hf.register()

from transformers import AutoModelForCausalLM  # noqa: E402
from transformers.models.minimax_m3_vl.configuration_minimax_m3_vl import MiniMaxM3VLTextConfig  # noqa: E402

M3_HEADS = dict(num_attention_heads=64, num_key_value_heads=4, index_n_heads=4, head_dim=128, index_head_dim=128,
                index_block_size=128, index_topk_blocks=16, index_local_blocks=1)


DEVICE = "cuda"
SMOKE = False  # --smoke: tiny shapes (16 / 1 / 1 heads, hidden 256) for a quick run of the script's logic


def make_config(hidden, layer_types, mlp, vocab, max_len, heads=None):
    if SMOKE:
        hidden, mlp, vocab = 256, 256, min(vocab, 512)
        heads = dict(M3_HEADS, num_attention_heads=16, num_key_value_heads=1, index_n_heads=1)
    return MiniMaxM3VLTextConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=mlp, dense_intermediate_size=mlp,
        shared_intermediate_size=mlp, num_hidden_layers=len(layer_types), layer_types=list(layer_types),
        mlp_layer_types=["dense"] * len(layer_types), max_position_embeddings=max_len,
        rope_parameters={"rope_type": "default", "rope_theta": 5e6, "partial_rotary_factor": 0.5},
        bos_token_id=1, eos_token_id=2, pad_token_id=0, use_cache=True, **(heads or M3_HEADS))


def make_model(cfg, seed=0):
    torch.manual_seed(seed)
    with torch.device(DEVICE):
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="msa", dtype=torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0, 0.3)
    return model.eval()


def free():
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def reset_peak():
    if DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()


def peak_gib():
    return torch.cuda.max_memory_allocated() / 2**30 if DEVICE == "cuda" else float("nan")


def is_oom(e):
    return isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e).lower()


def timed(fn, repeats):
    """(median seconds, peak bytes) of fn() after one warm-up."""
    fn()
    sync()
    reset_peak()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), peak_gib()


# ---- benchmark ------------------------------------------------------------------------------

def bench_part(name, cfg, lengths, impls, args, deadline, rows):
    model = make_model(cfg)
    vocab = cfg.vocab_size
    oom = {}  # (impl, mode) -> length that ran out of memory
    for n in lengths:
        ids = torch.randint(3, vocab, (1, n), device=DEVICE)
        cache = None
        for impl in impls:
            model.set_attn_implementation(impl)
            row = {"part": name, "tokens": n, "impl": impl}
            for mode in ("prefill", "train", "decode"):
                if (impl, mode) in oom:
                    row[mode] = f"OOM (≤ {oom[impl, mode]})"
                    continue
                if time.time() > deadline:
                    row[mode] = "skipped (time)"
                    continue
                try:
                    if mode == "prefill":
                        def run():
                            with torch.no_grad():
                                model(ids, use_cache=False, logits_to_keep=1)
                        t, peak = timed(run, args.repeats)
                        row[mode] = f"{t * 1e3:.1f} ms / {peak:.1f} GiB"
                    elif mode == "train":
                        labels = ids.clone()
                        labels[:, :-1024] = -100

                        def run():
                            model.zero_grad(set_to_none=True)
                            out = model(ids, use_cache=False, logits_to_keep=1025, labels=labels[:, -1025:])
                            out.loss.backward()
                        model.train()
                        try:
                            t, peak = timed(run, args.repeats)
                        finally:
                            model.zero_grad(set_to_none=True)
                            model.eval()
                        row[mode] = f"{t * 1e3:.1f} ms / {peak:.1f} GiB"
                    else:
                        if cache is None:  # one msa prefill fills the cache every implementation decodes from
                            model.set_attn_implementation("msa")
                            with torch.no_grad():
                                cache = model(ids, use_cache=True, logits_to_keep=1).past_key_values
                            model.set_attn_implementation(impl)
                        step_times = []
                        reset_peak()
                        kv = copy.deepcopy(cache)
                        tok = ids[:, -1:]
                        with torch.no_grad():
                            for i in range(args.decode_steps + 1):
                                pos = torch.tensor([[n + i]], device=DEVICE)
                                sync()
                                t0 = time.perf_counter()
                                model(tok, past_key_values=kv, position_ids=pos, use_cache=True, logits_to_keep=1)
                                sync()
                                if i:  # the first step is the warm-up
                                    step_times.append(time.perf_counter() - t0)
                        del kv
                        row[mode] = (f"{statistics.median(step_times) * 1e3:.2f} ms / "
                                     f"{peak_gib():.1f} GiB")
                except Exception as e:  # noqa: BLE001 - one failing case must not end the table
                    model.zero_grad(set_to_none=True)
                    model.eval()
                    if is_oom(e):
                        oom[impl, mode] = n
                        row[mode] = "OOM"
                    else:
                        row[mode] = f"error: {type(e).__name__}: {str(e)[:80]}"
                free()
            rows.append(row)
            print(f"# {row}", file=sys.stderr, flush=True)
        del cache, ids
        free()
    del model
    free()


def run_bench(args):
    deadline = time.time() + args.budget
    rows = []
    max_len = max(args.lengths) + 4096
    parts = {
        "layer": make_config(6144, ["minimax_m3_sparse"], 1024, 1024, max_len),
        "model": make_config(6144, ["full_attention"] + ["minimax_m3_sparse"] * 3, 12288, 32000, max_len),
    }
    for name in (["layer", "model"] if args.part == "all" else [args.part]):
        bench_part(name, parts[name], args.lengths, args.impls, args, deadline, rows)
    print(f"\n{torch.cuda.get_device_name() if DEVICE == 'cuda' else 'CPU (smoke run)'}, bf16, batch 1; each cell: time / peak memory "
          f"(weights included); decode: median per token over {args.decode_steps} steps\n")
    print("| part | tokens | impl | prefill | train step (fwd+bwd) | decode |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['part']} | {r['tokens']:,} | {r['impl']} | {r['prefill']} | {r['train']} | {r['decode']} |")


# ---- check ----------------------------------------------------------------------------------

def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


class Checks:
    def __init__(self):
        self.failed = []

    def __call__(self, name, ok, detail=""):
        print(f"{'PASS' if ok else 'FAIL'}  {name}  {detail}", flush=True)
        if not ok:
            self.failed.append(name)


def greedy_agree(ref, got, margin=0.05):
    """(ok, detail, steps with the same prefix): greedy tokens equal until a step where sdpa's
    top-2 logits were within margin (a near tie bf16 rounding may flip); after it the two
    continue from different prefixes."""
    start = ref.sequences.shape[1] - len(ref.scores)
    for step, scores in enumerate(ref.scores):
        if ref.sequences[0, start + step] != got.sequences[0, start + step]:
            top2 = scores[0].float().topk(2).values
            gap = (top2[0] - top2[1]).item()
            return gap < margin, f"first difference at step {step} (sdpa top-2 margin {gap:.3f})", step + 1
    return True, f"{len(ref.scores)} tokens equal", len(ref.scores)


def run_check(args):
    check = Checks()
    n_ctx, n_cmp, new = args.context, args.compare_length, 32
    cfg = make_config(2048, ["full_attention", "minimax_m3_sparse", "minimax_m3_sparse"], 4096, 4096, n_ctx + 4096)
    model = make_model(cfg, seed=1)
    gen = dict(max_new_tokens=new, do_sample=False, output_scores=True, return_dict_in_generate=True,
               pad_token_id=0)

    # 1. against sdpa where sdpa fits. bf16 rounding of a random 3-layer model moves single
    # logit rows by ~1e-2, so each comparison also measures both bf16 paths against the same
    # model in float32 on sdpa (ref32): msa must be no farther from it than bf16 sdpa is
    # (x1.5), or within the plain bound.
    ids = torch.randint(3, cfg.vocab_size, (1, n_cmp), device=DEVICE)
    ref32 = copy.deepcopy(model).float()
    ref32.set_attn_implementation("sdpa")

    def against_fp32(name, got, peer, ref, bound):
        e_got, e_peer, e_direct = rel(got, ref), rel(peer, ref), rel(got, peer)
        check(name, e_got <= max(bound, 1.5 * e_peer),
              f"rel L2 to float32: msa {e_got:.2e}, bf16 sdpa {e_peer:.2e} (msa vs sdpa {e_direct:.2e})")

    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        ref_logits = model(ids, use_cache=False).logits.float()
        ref_gen = model.generate(ids, **gen)
        model.set_attn_implementation("msa")
        logits = model(ids, use_cache=False).logits.float()
        got_gen = model.generate(ids, **gen)
        logits32 = ref32(ids, use_cache=False).logits.float()
    e = rel(logits, ref_logits)
    check(f"logits msa vs sdpa at {n_cmp} tokens", e < 2e-2, f"rel L2 {e:.2e}")
    against_fp32(f"logits at {n_cmp} tokens against float32", logits, ref_logits, logits32, 1e-2)
    del ref_logits, logits, logits32
    ok, detail, _ = greedy_agree(ref_gen, got_gen)
    check(f"greedy generate {new} tokens msa vs sdpa after {n_cmp} tokens", ok, detail)
    # msa's decode logits (one query a step, through the cache) against the float32 model and
    # bf16 sdpa run without a cache over the sequence msa generated (teacher forcing).
    seq = got_gen.sequences[:, :-1]
    with torch.no_grad():
        rows32 = ref32(seq, use_cache=False, logits_to_keep=new).logits.float()[0]
        model.set_attn_implementation("sdpa")
        rows_sdpa = model(seq, use_cache=False, logits_to_keep=new).logits.float()[0]
        model.set_attn_implementation("msa")
    steps = torch.cat([s.float() for s in got_gen.scores])
    against_fp32(f"decode logits of {new} steps against float32", steps, rows_sdpa, rows32, 2e-2)
    del rows32, rows_sdpa, steps
    free()

    # 2. left padding = the unpadded row (the padded row is a second, larger GEMM, so bf16
    # rounding differs; both are measured against the float32 row alone).
    pad = 300
    row = ids[:, pad:]
    left = torch.cat([torch.zeros(1, pad, dtype=ids.dtype, device=DEVICE), row], 1)
    batch = torch.cat([ids, left])
    mask = torch.ones_like(batch)
    mask[1, :pad] = 0
    with torch.no_grad():
        alone = model(row, use_cache=False).logits[0].float()
        both = model(batch, attention_mask=mask, use_cache=False).logits.float()
        alone32 = ref32(row, use_cache=False).logits[0].float()
    e_pad, e_alone = rel(both[1, pad:], alone32), rel(alone, alone32)
    check("left-padded batch row vs the row alone (msa)", e_pad <= max(1e-2, 1.5 * e_alone),
          f"rel L2 to the float32 row alone: padded {e_pad:.2e}, alone {e_alone:.2e} "
          f"(padded vs alone {rel(both[1, pad:], alone):.2e})")
    del alone, both, alone32, ref32
    free()

    # 3. long context: one training step and generate through msa
    ids = torch.randint(3, cfg.vocab_size, (1, n_ctx), device=DEVICE)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    reset_peak()
    t0 = time.perf_counter()
    out = model(ids, labels=ids, use_cache=False)
    out.loss.backward()
    grads_ok = all(p.grad is None or torch.isfinite(p.grad).all().item() for p in model.parameters())
    attn_grads = [p.grad for n, p in model.named_parameters() if "self_attn" in n and ".indexer." not in n]
    opt.step()
    sync()
    check(f"training step at {n_ctx} tokens (msa)", torch.isfinite(out.loss).item() and grads_ok
          and all(g is not None for g in attn_grads),
          f"loss {out.loss.item():.4f}, {time.perf_counter() - t0:.2f} s, peak "
          f"{peak_gib():.1f} GiB")
    del out, opt
    model.zero_grad(set_to_none=True)
    model.eval()
    free()

    results = {}
    for cache in ("dynamic", "static"):
        reset_peak()
        t0 = time.perf_counter()
        with torch.no_grad():
            results[cache] = model.generate(ids, cache_implementation=cache, **gen)
        sync()
        toks = results[cache].sequences[0, n_ctx:]
        check(f"generate {new} tokens at {n_ctx} tokens, {cache} cache (msa)", len(toks) == new,
              f"{time.perf_counter() - t0:.2f} s, peak {peak_gib():.1f} GiB")
        free()
    ok, detail, _ = greedy_agree(results["dynamic"], results["static"])
    check("dynamic and static cache give the same tokens (msa)", ok, detail)

    # 4. sdpa at the long context, where it fits
    model.set_attn_implementation("sdpa")
    try:
        with torch.no_grad():
            ref = model(ids, use_cache=False, logits_to_keep=1).logits.float()
        model.set_attn_implementation("msa")
        with torch.no_grad():
            got = model(ids, use_cache=False, logits_to_keep=1).logits.float()
        e = rel(got, ref)
        check(f"last-token logits msa vs sdpa at {n_ctx} tokens", e < 2e-2, f"rel L2 {e:.2e}")
    except Exception as ex:  # noqa: BLE001
        if not is_oom(ex):
            raise
        print(f"INFO  sdpa does not fit at {n_ctx} tokens (out of memory): not compared there", flush=True)
    model.set_attn_implementation("msa")
    free()

    print(f"\n{len(check.failed)} failed" + (": " + ", ".join(check.failed) if check.failed else ""))
    return 1 if check.failed else 0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="run the correctness check instead of the benchmark")
    ap.add_argument("--part", choices=["layer", "model", "all"], default="all")
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384, 32768, 65536, 131072])
    ap.add_argument("--impls", nargs="+", default=["msa", "sdpa", "eager"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--decode-steps", type=int, default=8)
    ap.add_argument("--budget", type=float, default=480.0, help="seconds after which remaining cases are skipped")
    ap.add_argument("--context", type=int, default=65536)
    ap.add_argument("--compare-length", type=int, default=8192)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: checks that the script runs")
    args = ap.parse_args()
    global DEVICE, SMOKE
    if args.smoke:
        DEVICE, SMOKE = "cpu", True
    elif not torch.cuda.is_available():
        sys.exit("transformers_bench.py needs a CUDA GPU (and msa built with its CUDA backend)")
    sys.exit(run_check(args) if args.check else run_bench(args))


if __name__ == "__main__":
    main()
