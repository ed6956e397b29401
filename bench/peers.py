#!/usr/bin/env python3
"""msa against its peers on one GPU, in one process, on the same inputs.

For one document of T tokens (MiniMax-M3 shapes: 64 query heads, 4 KV heads, head dim 128,
bf16) and both selection distributions of the architecture notes (§5):

  msa                 sparse attention forward / backward (plan built once, outside the timing),
                      plus the indexer (select_blocks) and the torch op with its per-call plan
  cudnn dense         causal SDPA through the cuDNN backend (GQA by enable_gqa, else expanded K/V)
  flex block mask     FlexAttention with a block mask built from the same selection
                      (union of the 128 queries' blocks per query block + a per-token mask_mod)
  sdpa dense mask     SDPA with a dense boolean mask of the selection (the generic path)

Timing: CUDA events, warm-up excluded, median of --repeats, inputs rotated so that the
working set exceeds twice the L2 cache. A peer's backward is timed alone, each call on a
fresh forward graph (the forward runs untimed before it); compiled peers compile once. FLOPs (FlashAttention convention): forward =
4 * Hq * 128 * visible (query, key) pairs, backward = 2.5 x forward. "useful" TFLOP/s divide
the sparse pairs' FLOPs by each method's time; dense methods also report their own FLOPs.

Usage: python bench/peers.py [--seqlens 4096 8192 ...] [--json out.json]
Requires an NVIDIA GPU, PyTorch with CUDA and msa built with its CUDA backend.
"""

import argparse
import json
import math
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import msa
import msa.torch as mt

HQ, HKV, D, BLOCK, TOPK = 64, 4, 128, 128, 16
GROUP = HQ // HKV


# ---- inputs and selections ----------------------------------------------------------------

def index_vectors(t, heads, coherent, gen):
    """[t, heads, 128] bf16: i.i.d. normal * 0.2, or a slow drift along the sequence."""
    if not coherent:
        return (torch.randn(t, heads, D, generator=gen, device="cuda") * 0.2).bfloat16()
    # Anchors every 512 tokens, linearly interpolated: neighbours see nearly the same vector.
    step = 512
    anchors = torch.randn(t // step + 2, heads, D, generator=gen, device="cuda")
    pos = torch.arange(t, device="cuda", dtype=torch.float32) / step
    i0 = pos.floor().long()
    w = (pos - i0)[:, None, None]
    x = anchors[i0] * (1 - w) + anchors[i0 + 1] * w
    x = x + 0.05 * torch.randn(t, heads, D, generator=gen, device="cuda")
    return (x * 0.2).bfloat16()


def selection_stats(topk, t):
    """Visible (query, key) pairs per query head summed over heads, and the mean union size of
    8 consecutive tokens' selections."""
    valid = topk >= 0                                                    # [Hkv, T, 16]
    pos = torch.arange(t, device=topk.device)[None, :, None]
    keys = torch.clamp(pos - topk.clamp_min(0) * BLOCK + 1, 0, BLOCK)
    pairs = (keys * valid).sum().item() * GROUP
    nb = (t + BLOCK - 1) // BLOCK
    onehot = torch.zeros(HKV, t, nb + 1, dtype=torch.bool, device=topk.device)
    onehot.scatter_(2, torch.where(valid, topk, nb).long(), True)
    onehot = onehot[..., :nb]
    w = t // 8 * 8
    union = onehot[:, :w].view(HKV, w // 8, 8, nb).any(2).sum(-1).float().mean().item()
    return pairs, union, onehot


# ---- timing -------------------------------------------------------------------------------

def time_ms(fn, n_inputs, repeats, warmup=3):
    """Median ms of fn(i) over `repeats` calls, rotating i over n_inputs input sets."""
    for i in range(warmup):
        fn(i % n_inputs)
    torch.cuda.synchronize()
    times = []
    for r in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(r % n_inputs)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def time_ms_after(setup, fn, n_inputs, repeats, warmup=3):
    """As time_ms, for fn(state) where state = setup(i) runs before each call, outside the
    timing (a backward needs a fresh forward graph per call: compiled functions such as
    FlexAttention's donate their saved buffers to the backward, so a graph cannot be
    back-propagated twice, retain_graph or not)."""
    for i in range(warmup):
        fn(setup(i % n_inputs))
    torch.cuda.synchronize()
    times = []
    for r in range(repeats):
        state = setup(r % n_inputs)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(state)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
        state = None
    return statistics.median(times)


def rotation_count(bytes_per_set):
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    return max(1, min(8, math.ceil(2 * l2 / max(bytes_per_set, 1))))


def try_run(label, fn):
    try:
        return fn()
    except torch.cuda.OutOfMemoryError:
        print(f"    {label}: out of memory", flush=True)
    except Exception as e:  # a peer that cannot run this shape is reported, not fatal
        print(f"    {label}: {type(e).__name__}: {str(e).splitlines()[0][:160]}", flush=True)
    torch.cuda.empty_cache()
    return None


# ---- peers --------------------------------------------------------------------------------

def sdpa_cudnn(q, k, v):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        try:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        except (RuntimeError, TypeError):
            k = k.repeat_interleave(GROUP, dim=1)
            v = v.repeat_interleave(GROUP, dim=1)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def flex_block_mask(onehot, t):
    """BlockMask: per query block the union of its tokens' selected blocks; blocks selected by
    all 128 tokens and strictly earlier are 'full' (no mask_mod); the mask_mod checks the
    token's own selection and causality."""
    from torch.nn.attention.flex_attention import BlockMask

    nb = onehot.shape[-1]
    qb = t // BLOCK
    per_qblock = onehot[:, :qb * BLOCK].view(HKV, qb, BLOCK, nb)
    union, inter = per_qblock.any(2), per_qblock.all(2)
    earlier = torch.arange(nb, device="cuda")[None, None, :] < torch.arange(qb, device="cuda")[None, :, None]
    full = inter & earlier
    partial = union & ~full

    def to_indices(m):
        m = m.repeat_interleave(GROUP, dim=0)[None]                       # [1, Hq, QB, NB]
        counts = m.sum(-1).to(torch.int32)
        idx = torch.argsort((~m).to(torch.int8), dim=-1, stable=True).to(torch.int32)
        return counts, idx

    sel = onehot

    def mask_mod(b, h, q_idx, kv_idx):
        return sel[h // GROUP, q_idx, kv_idx // BLOCK] & (kv_idx <= q_idx)

    kv_num, kv_idx = to_indices(partial)
    full_num, full_idx = to_indices(full)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=BLOCK, mask_mod=mask_mod)


# ---- one case -----------------------------------------------------------------------------

def run_case(t, coherent, args, gen):
    dist = "coherent" if coherent else "independent"
    iq = index_vectors(t, HKV, coherent, gen)
    ik = index_vectors(t, 1, coherent, gen)
    cu = torch.tensor([0, t], dtype=torch.int32)
    layout = msa.make_layout([0, t])
    topk = mt.select_blocks(iq, ik, cu)
    torch.cuda.synchronize()
    pairs, union8, onehot = selection_stats(topk, t)
    fwd_flops = 4.0 * D * pairs
    dense_fwd_flops = 4.0 * D * HQ * t * (t + 1) / 2
    print(f"\nT={t} {dist}: sparse fwd {fwd_flops / 1e12:.3f} TFLOP (dense causal {dense_fwd_flops / 1e12:.3f}), "
          f"mean union of 8 tokens' blocks {union8:.1f}", flush=True)
    records = []

    def record(method, direction, ms, own_flops=None):
        useful = fwd_flops * (2.5 if direction == "bwd" else 1.0)
        rec = dict(T=t, selection=dist, method=method, direction=direction, ms=ms,
                   useful_tflops=useful / ms / 1e9, union8=union8, sparse_fwd_tflop=fwd_flops / 1e12)
        if own_flops is not None:
            rec["own_tflops"] = own_flops * (2.5 if direction == "bwd" else 1.0) / ms / 1e9
        records.append(rec)
        own = f", own {rec['own_tflops']:.0f} TFLOP/s" if own_flops is not None else ""
        print(f"    {method:<22} {direction}  {ms:9.3f} ms  useful {rec['useful_tflops']:7.1f} TFLOP/s{own}", flush=True)

    set_bytes = t * (HQ + 2 * HKV) * D * 2 * 2  # q, k, v, dout/out in bf16
    n = rotation_count(set_bytes)
    g = lambda *s: (torch.randn(*s, generator=gen, device="cuda") * 0.2).bfloat16()  # noqa: E731
    sets = [dict(q=g(t, HQ, D), k=g(t, HKV, D), v=g(t, HKV, D), do=g(t, HQ, D)) for _ in range(n)]

    # msa: the plan is built once per layer and micro-batch, as in training.
    stream = torch.cuda.current_stream().cuda_stream
    topo = msa.Topology()
    plan = msa.build_plan(topk, layout)
    dl = torch.utils.dlpack.to_dlpack
    outs = [dict(out=torch.empty_like(s["q"]), lse=torch.empty(t, HQ, device="cuda"), dq=torch.empty_like(s["q"]),
                 dk=torch.empty_like(s["k"]), dv=torch.empty_like(s["v"])) for s in sets]
    native = msa._native

    def msa_fwd(i):
        s, o = sets[i], outs[i]
        native.sparse_attention_forward(topo, layout, plan, dl(s["q"]), dl(s["k"]), dl(s["v"]), dl(topk), dl(o["out"]),
                                        dl(o["lse"]), deterministic=args.deterministic, stream=stream)

    def msa_bwd(i):
        s, o = sets[i], outs[i]
        native.sparse_attention_backward(topo, layout, plan, dl(s["q"]), dl(s["k"]), dl(s["v"]), dl(topk),
                                         dl(o["out"]), dl(o["lse"]), dl(s["do"]), dl(o["dq"]), dl(o["dk"]),
                                         dl(o["dv"]), deterministic=args.deterministic, stream=stream)

    ms_fwd = try_run("msa fwd", lambda: time_ms(msa_fwd, n, args.repeats))
    for i in range(n):
        msa_fwd(i)
    ms_bwd = try_run("msa bwd", lambda: time_ms(msa_bwd, n, args.repeats))
    if ms_fwd:
        record("msa", "fwd", ms_fwd)
    if ms_bwd:
        record("msa", "bwd", ms_bwd)
    ms = try_run("msa op", lambda: time_ms(lambda i: mt.sparse_attention(sets[i]["q"], sets[i]["k"], sets[i]["v"],
                                                                          topk, cu), n, args.repeats))
    if ms:
        record("msa torch op (+plan)", "fwd", ms)
    ms = try_run("msa indexer", lambda: time_ms(lambda i: mt.select_blocks(iq, ik, cu), 1, args.repeats))
    if ms:
        records.append(dict(T=t, selection=dist, method="msa indexer", direction="fwd", ms=ms,
                            own_tflops=2.0 * 128 * HKV * t * (t + 1) / 2 / ms / 1e9))
        print(f"    {'msa indexer':<22} fwd  {ms:9.3f} ms  own {records[-1]['own_tflops']:7.1f} TFLOP/s", flush=True)
    outs = plan = None  # free the outputs and the plan's scratch before the peers run

    # Peers take [1, H, T, 128].
    peer_sets = [dict(q=s["q"].transpose(0, 1)[None].contiguous().requires_grad_(),
                      k=s["k"].transpose(0, 1)[None].contiguous().requires_grad_(),
                      v=s["v"].transpose(0, 1)[None].contiguous().requires_grad_(),
                      do=s["do"].transpose(0, 1)[None].contiguous()) for s in sets]

    def bench_peer(name, attn, own_flops, allow_bwd=True):
        def fwd_only(i):
            with torch.no_grad():
                attn(peer_sets[i])

        fwd = try_run(f"{name} fwd", lambda: time_ms(fwd_only, n, args.repeats))
        if fwd is None:
            return
        record(name, "fwd", fwd, own_flops)
        if not allow_bwd:
            return

        def forward(i):  # a fresh autograd graph for every timed backward (untimed)
            return i, attn(peer_sets[i])

        def backward(state):
            i, out = state
            p = peer_sets[i]
            torch.autograd.grad(out, (p["q"], p["k"], p["v"]), p["do"])

        bwd = try_run(f"{name} bwd", lambda: time_ms_after(forward, backward, n, args.repeats))
        if bwd is not None:
            record(name, "bwd", bwd, own_flops)

    if t <= args.dense_max:
        bench_peer("cudnn dense causal", lambda p: sdpa_cudnn(p["q"], p["k"], p["v"]), dense_fwd_flops)
    if t <= args.flex_max:
        def flex_setup():
            from torch.nn.attention.flex_attention import flex_attention

            bm = flex_block_mask(onehot, t)
            compiled = torch.compile(flex_attention)
            return lambda p: compiled(p["q"], p["k"], p["v"], block_mask=bm, enable_gqa=True)

        attn = try_run("flex setup", flex_setup)
        if attn is not None:
            bench_peer("flex block mask", attn, None)
    if t <= args.dense_mask_max:
        def mask_setup():
            token_mask = torch.gather(onehot, 2, (torch.arange(t, device="cuda") // BLOCK)[None, None, :]
                                      .expand(HKV, t, t))
            token_mask &= torch.ones(t, t, dtype=torch.bool, device="cuda").tril()
            mask = token_mask.repeat_interleave(GROUP, dim=0)[None]        # [1, Hq, T, T]

            def attn(p):
                k = p["k"].repeat_interleave(GROUP, dim=1)
                v = p["v"].repeat_interleave(GROUP, dim=1)
                return F.scaled_dot_product_attention(p["q"], k, v, attn_mask=mask)

            return attn

        attn = try_run("dense mask setup", mask_setup)
        if attn is not None:
            bench_peer("sdpa dense mask", attn, dense_fwd_flops, allow_bwd=args.dense_mask_bwd)
    peer_sets = sets = None
    torch.cuda.empty_cache()

    by = {(r["method"], r["direction"]): r["ms"] for r in records}
    for direction in ("fwd", "bwd"):
        base = by.get(("msa", direction))
        if not base:
            continue
        for (method, d), ms in sorted(by.items()):
            if d == direction and method != "msa" and not method.startswith("msa"):
                print(f"    speed-up of msa {direction} over {method}: {ms / base:.2f}x", flush=True)
        for r in records:
            if r["direction"] == direction and r["method"] != "msa" and not r["method"].startswith("msa"):
                r["msa_speedup"] = r["ms"] / base
    return records


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqlens", type=int, nargs="+", default=[4096, 8192, 16384, 32768, 65536, 131072])
    p.add_argument("--selections", nargs="+", default=["independent", "coherent"], choices=["independent", "coherent"])
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--dense-max", type=int, default=131072, help="longest T for cuDNN dense")
    p.add_argument("--flex-max", type=int, default=65536, help="longest T for FlexAttention")
    p.add_argument("--dense-mask-max", type=int, default=8192, help="longest T for the dense-mask SDPA path")
    p.add_argument("--dense-mask-bwd", action="store_true", help="also time the dense-mask backward")
    p.add_argument("--deterministic", action="store_true", help="msa deterministic mode")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="peers.json", help="where to write the records")
    args = p.parse_args()

    if not torch.cuda.is_available() or not msa.built_with_cuda():
        sys.exit("bench/peers.py needs a CUDA GPU and msa built with its CUDA backend")
    props = torch.cuda.get_device_properties(0)
    env = dict(device=props.name, torch=torch.__version__, cuda=torch.version.cuda,
               cudnn=torch.backends.cudnn.version(), msa=msa.__version__, time=time.strftime("%Y-%m-%d %H:%M:%S"))
    print(" ".join(f"{k}={v}" for k, v in env.items()), flush=True)
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    records = []
    for t in args.seqlens:
        if t % BLOCK:
            sys.exit(f"--seqlens must be multiples of {BLOCK}, got {t}")
        for dist in args.selections:
            records += run_case(t, dist == "coherent", args, gen)
    with open(args.json, "w") as f:
        json.dump(dict(environment=env, records=records), f, indent=1)
    print(f"\nwrote {len(records)} records to {args.json}")


if __name__ == "__main__":
    main()
