#!/usr/bin/env python3
"""A training layer step through the msa.torch ops, against cuDNN dense attention, on one GPU.

One step, as a training loop runs it on one document of T tokens (MiniMax-M3 shapes: 64 query
heads, 4 KV heads, head dim 128, bf16): the indexer (select_blocks with its LSE), sparse
attention forward with LSE, the indexer's KL loss, and the backward of both. It is timed whole
(CUDA events, warm-up excluded, median of --repeats) and beside it cuDNN's dense causal forward
+ backward on the same q / k / v, the ratio the training issue asks about. Also printed: how
many plans the step built (msa.torch's plan cache, where the package has one), the memory its
forward keeps for the backward (what each layer of a model holds until its backward) and the
step's peak, both above the inputs.

Usage: python bench/torch_step.py [--seqlens 4096 16384] [--selection independent] [--profile] [--no-dense] [--json out.json]
Requires an NVIDIA GPU, PyTorch with CUDA and msa built with its CUDA backend.
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import msa.torch as mt  # noqa: E402
from peers import D, HKV, HQ, index_vectors, sdpa_cudnn, time_ms, try_run  # noqa: E402


def plans_built():
    cache = getattr(getattr(mt, "_ops", None), "_plans", None)
    return getattr(cache, "builds", None)


def run(t, coherent, repeats, gen, profile=False, dense=True):
    cu = torch.tensor([0, t], dtype=torch.int32)  # layout metadata: on the host
    leaf = lambda x: x.detach().requires_grad_()  # noqa: E731
    g = lambda *s: (torch.randn(*s, generator=gen, device="cuda") * 0.2).bfloat16()  # noqa: E731
    q, k, v = leaf(g(t, HQ, D)), leaf(g(t, HKV, D)), leaf(g(t, HKV, D))
    iq, ik = leaf(index_vectors(t, HKV, coherent, gen)), leaf(index_vectors(t, 1, coherent, gen))
    dout = g(t, HQ, D)
    one = torch.ones((), device="cuda")

    def msa_step(_):
        topk, index_lse = mt.select_blocks(iq, ik, cu, return_lse=True)
        out, lse = mt.sparse_attention(q, k, v, topk, cu, return_lse=True)
        loss = mt.indexer_kl_loss(q, k, lse, iq, ik, index_lse, topk, cu)
        torch.autograd.backward([out, loss], [dout, one])

    before = plans_built()
    msa_step(0)
    torch.cuda.synchronize()
    builds = None if before is None else plans_built() - before
    # Memory: what the step's forward keeps for its backward (a training model holds this per
    # layer until the backward reaches it), and the step's peak.
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    topk, index_lse = mt.select_blocks(iq, ik, cu, return_lse=True)
    out, lse = mt.sparse_attention(q, k, v, topk, cu, return_lse=True)
    loss = mt.indexer_kl_loss(q, k, lse, iq, ik, index_lse, topk, cu)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - base
    torch.autograd.backward([out, loss], [dout, one])
    del topk, index_lse, out, lse, loss
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    msa_ms = try_run("msa step", lambda: time_ms(msa_step, 1, repeats))
    if profile:
        print_profile(msa_step, t)

    dense_ms = None
    if dense:
        dq, dk, dv = (x.detach().transpose(0, 1)[None].contiguous().requires_grad_() for x in (q, k, v))
        ddo = dout.transpose(0, 1)[None].contiguous()

        def dense_step(_):
            out = sdpa_cudnn(dq, dk, dv)
            out.backward(ddo)

        dense_ms = try_run("cuDNN dense", lambda: time_ms(dense_step, 1, repeats))
    return dict(T=t, selection="coherent" if coherent else "independent", msa_step_ms=msa_ms,
                dense_fwd_bwd_ms=dense_ms, plans_built_per_step=builds,
                held_for_backward_gib=held / 2**30, step_peak_gib=peak / 2**30,
                dense_over_msa=(dense_ms / msa_ms) if msa_ms and dense_ms else None)


def print_profile(step, t):
    """The step's kernels (torch.profiler: GPU time per kernel name, summed over 5 steps) and
    how much of the step's wall time the GPU was busy: where a short step's time goes."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(5):
            step(i)
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type.name == "CUDA"]
    busy = sum(e.device_time_total for e in events if e.device_time_total > 0) / 5 / 1e3
    first = min((e.time_range.start for e in events), default=0)
    last = max((e.time_range.end for e in events), default=0)
    print(f"\nT={t}: GPU busy {busy:.3f} ms a step; first to last GPU event over 5 steps {(last - first) / 5e3:.3f} ms a step")
    print(prof.key_averages().table(sort_by="device_time_total", row_limit=25, max_name_column_width=70))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqlens", type=int, nargs="+", default=[4096, 16384])
    p.add_argument("--selection", choices=["independent", "coherent"], default="independent")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="where to write the records")
    p.add_argument("--profile", action="store_true", help="also print the step's kernels (torch.profiler)")
    p.add_argument("--no-dense", action="store_true", help="skip the cuDNN dense peer (its time grows with T^2)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("torch_step.py needs a CUDA GPU")
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    records = []
    print("| T | selection | msa layer step (ms) | plans built a step | held fwd→bwd (GiB) | step peak (GiB) | "
          "cuDNN dense fwd+bwd (ms) | dense / msa |")
    print("|---|---|---|---|---|---|---|---|")
    for t in args.seqlens:
        r = run(t, args.selection == "coherent", args.repeats, gen, args.profile, not args.no_dense)
        records.append(r)
        f = lambda x, fmt: "—" if x is None else format(x, fmt)  # noqa: E731
        print(f"| {t} | {r['selection']} | {f(r['msa_step_ms'], '.3f')} | {f(r['plans_built_per_step'], 'd')} | "
              f"{r['held_for_backward_gib']:.2f} | {r['step_peak_gib']:.2f} | {f(r['dense_fwd_bwd_ms'], '.3f')} | "
              f"{f(r['dense_over_msa'], '.2f')}× |", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(records=records), fh, indent=1)


if __name__ == "__main__":
    main()
