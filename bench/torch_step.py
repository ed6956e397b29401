#!/usr/bin/env python3
"""A training layer step through the msa.torch ops, against cuDNN dense attention, on one GPU.

One step, as a training loop runs it on one document of T tokens (MiniMax-M3 shapes: 64 query
heads, 4 KV heads, head dim 128, bf16): the indexer (select_blocks with its LSE), sparse
attention forward with LSE, the indexer's KL loss, and the backward of both. It is timed whole
(CUDA events, warm-up excluded, median of --repeats) and beside it cuDNN's dense causal forward
+ backward on the same q / k / v, the ratio the training issue asks about. Also printed: how
many plans the step built (msa.torch's plan cache, where the package has one).

Usage: python bench/torch_step.py [--seqlens 4096 16384] [--selection independent] [--json out.json]
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


def run(t, coherent, repeats, gen):
    cu = torch.tensor([0, t], dtype=torch.int32, device="cuda")
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
    msa_ms = try_run("msa step", lambda: time_ms(msa_step, 1, repeats))

    dq, dk, dv = (x.detach().transpose(0, 1)[None].contiguous().requires_grad_() for x in (q, k, v))
    ddo = dout.transpose(0, 1)[None].contiguous()

    def dense_step(_):
        out = sdpa_cudnn(dq, dk, dv)
        out.backward(ddo)

    dense_ms = try_run("cuDNN dense", lambda: time_ms(dense_step, 1, repeats))
    return dict(T=t, selection="coherent" if coherent else "independent", msa_step_ms=msa_ms,
                dense_fwd_bwd_ms=dense_ms, plans_built_per_step=builds,
                dense_over_msa=(dense_ms / msa_ms) if msa_ms and dense_ms else None)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqlens", type=int, nargs="+", default=[4096, 16384])
    p.add_argument("--selection", choices=["independent", "coherent"], default="independent")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="where to write the records")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("torch_step.py needs a CUDA GPU")
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    records = []
    print("| T | selection | msa layer step (ms) | plans built a step | cuDNN dense fwd+bwd (ms) | dense / msa |")
    print("|---|---|---|---|---|---|")
    for t in args.seqlens:
        r = run(t, args.selection == "coherent", args.repeats, gen)
        records.append(r)
        f = lambda x, fmt: "—" if x is None else format(x, fmt)  # noqa: E731
        print(f"| {t} | {r['selection']} | {f(r['msa_step_ms'], '.3f')} | {f(r['plans_built_per_step'], 'd')} | "
              f"{f(r['dense_fwd_bwd_ms'], '.3f')} | {f(r['dense_over_msa'], '.2f')}× |", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(records=records), fh, indent=1)


if __name__ == "__main__":
    main()
