#!/usr/bin/env python3
"""Context-parallel scaling of MSA training: tokens/s and memory per rank at 1, 2, 4, 8 GPUs
for real 192k-token packs (bench/data/training_packs_192k.jsonl, MiniMax-AI/MSA, MIT license).

One training step of one sparse layer's attention per pack, every rank running
msa.torch.context_parallel on its share of the pack (chunks of --chunk-size tokens dealt by
useful work): all-gather of K, V and index-K, indexer (select_blocks), sparse attention forward,
backward with the indexer's KL gradient, reduce-scatter of dK, dV and d index-K. Inputs are
random bf16 projections of MiniMax-M3's shapes (64 query heads, 4 KV / index heads, head dim
128); --layer runs the whole MiniMaxM3SparseAttention layer (projections, norms, RoPE) instead.

Reported per pack and world size (rank 0 prints, --json appends one line per pack):
  step_ms      median over --repeats of the slowest rank's forward + backward (after a barrier)
  fwd_ms       median forward time (slowest rank)
  tokens_per_s pack tokens / step time (the whole group's throughput)
  peak_mib     peak allocated memory per rank (max and min over ranks; CUDA only)
  imbalance    max / mean of the planned per-rank work; kv_tokens: mean gathered keys per rank

GPU, one node (NCCL), one world size per launch:
    torchrun --standalone --nproc-per-node 8 bench/cp_scaling.py --packs 0 3 9 37
All of 1, 2, 4, 8 in turn (each a torchrun child), with a summary table:
    python bench/cp_scaling.py --launch 1 2 4 8 --json cp_scaling.jsonl
CPU smoke mode (gloo, packs scaled down by --scale, 16 query heads / 1 KV head):
    python bench/cp_scaling.py --smoke --launch 1 2
"""

import argparse
import datetime
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist

import msa.torch as mt
from msa.torch import context_parallel as cp

HERE = pathlib.Path(__file__).resolve().parent
DATA = HERE / "data" / "training_packs_192k.jsonl"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=str(DATA), help="JSON lines with cu_seqlens (default: %(default)s)")
    ap.add_argument("--packs", type=int, nargs="+", default=[0, 3, 9, 37],
                    help="case_id of the packs to run (default: 2 long documents, 40 documents, 154 "
                         "documents, one 196,608-token document)")
    ap.add_argument("--chunk-size", type=int, default=1024, help="tokens per chunk of the split")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--layer", action="store_true", help="time the whole MiniMax-M3 layer (hidden 6144)")
    ap.add_argument("--save-gathered", action="store_true",
                    help="keep the gathered K/V for backward instead of gathering again")
    ap.add_argument("--deterministic", action="store_true")
    ap.add_argument("--smoke", action="store_true",
                    help="CPU + gloo, packs scaled down by --scale, 16 query heads and 1 KV head, 1 repeat")
    ap.add_argument("--scale", type=int, default=96, help="smoke mode: divide document lengths by this")
    ap.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda unless --smoke")
    ap.add_argument("--json", default=None, help="append one JSON line per (pack, world size) here")
    ap.add_argument("--launch", type=int, nargs="+", default=None,
                    help="run torchrun once per world size listed (1 node) and print a summary")
    return ap.parse_args(argv)


# ---- the launcher ------------------------------------------------------------------------------

def launch(args, argv):
    """Runs this script under torchrun for each world size; prints the collected table."""
    import tempfile

    rest = _without_options(argv, ("--launch", "--json"))
    out = args.json or tempfile.mktemp(suffix=".jsonl")
    with open(out, "a+") as f:
        f.seek(0)
        start = sum(1 for _ in f)
    for world in args.launch:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
               str(pathlib.Path(__file__).resolve()), *rest, "--json", out]
        print("$", " ".join(cmd), flush=True)
        env = dict(os.environ)
        if args.smoke:
            env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // world)))
        rc = subprocess.call(cmd, env=env)
        if rc != 0:
            print(f"world size {world}: exit code {rc}", file=sys.stderr)
            return rc
    with open(out) as f:
        rows = [json.loads(line) for i, line in enumerate(f) if i >= start]
    print_summary(rows)
    return 0


def _without_options(argv, options):
    """argv less the listed options and their values."""
    rest, skipping = [], False
    for a in argv:
        if a in options:
            skipping = True
            continue
        if skipping and not a.startswith("--"):
            continue
        skipping = False
        rest.append(a)
    return rest


def print_summary(rows):
    if not rows:
        return
    print()
    print("pack  docs  world  tokens/s     speedup  step ms   fwd ms   peak MiB/rank   imbalance  kv tokens/rank")
    base = {}
    for r in sorted(rows, key=lambda r: (r["case_id"], r["world_size"])):
        if r["world_size"] == 1:
            base[r["case_id"]] = r["tokens_per_s"]
        speed = r["tokens_per_s"] / base[r["case_id"]] if r["case_id"] in base else float("nan")
        peak = f"{r['peak_mib_max']:.0f}" if r.get("peak_mib_max") is not None else "-"
        print(f"{r['case_id']:>4}  {r['num_documents']:>4}  {r['world_size']:>5}  {r['tokens_per_s']:>11.0f}  "
              f"{speed:>7.2f}  {r['step_ms']:>8.1f}  {r['fwd_ms']:>7.1f}  {peak:>14}  {r['imbalance']:>9.3f}  "
              f"{r['kv_tokens_mean']:>14.0f}")


# ---- one rank -----------------------------------------------------------------------------------

def scaled(cu, scale):
    lengths = [max(1, round((b - a) / scale)) for a, b in zip(cu[:-1], cu[1:])]
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


def read_packs(path, ids):
    packs = {}
    with open(path) as f:
        for line in f:
            row = json.loads(line)
            if row["case_id"] in ids:
                packs[row["case_id"]] = row["cu_seqlens"]
    missing = [i for i in ids if i not in packs]
    if missing:
        raise SystemExit(f"case_id {missing} not in {path}")
    return [(i, packs[i]) for i in ids]


def random_inputs(n, hq, hkv, layer, device, seed):
    """This rank's leaves (q, k, v, index_q, index_k, or the layer's hidden states) and dout."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def rand(*shape):
        return (torch.randn(*shape, generator=gen, device=device) * 0.2).to(torch.bfloat16)

    if layer is None:
        leaves = [rand(n, hq, 128), rand(n, hkv, 128), rand(n, hkv, 128), rand(n, hkv, 128), rand(n, 1, 128)]
        return [t.requires_grad_(True) for t in leaves], rand(n, hq, 128)
    return [rand(n, layer.hidden_size).requires_grad_(True)], rand(n, layer.hidden_size)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_step(args, shard, leaves, dout, cp_layer, device):
    """One forward + backward after a barrier: (forward ms, step ms) on this rank."""
    for t in leaves:
        t.grad = None
    if cp_layer is not None:
        cp_layer.zero_grad(set_to_none=True)
    dist.barrier()
    sync(device)
    t0 = time.perf_counter()
    if cp_layer is None:
        out = cp.context_parallel_sparse_attention(*leaves, shard, deterministic=args.deterministic,
                                                   save_gathered=args.save_gathered)
    else:
        out = cp_layer(leaves[0], shard)
    sync(device)
    t1 = time.perf_counter()
    out.backward(dout)
    sync(device)
    t2 = time.perf_counter()
    return (t1 - t0) * 1e3, (t2 - t0) * 1e3


def run_rank(args):
    device_type = args.device or ("cpu" if args.smoke else "cuda")
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if "MASTER_ADDR" not in os.environ:  # a plain `python bench/cp_scaling.py`: one rank
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29533"))
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(minutes=10))
    hq, hkv = (16, 1) if args.smoke else (64, 4)
    chunk = max(16, args.chunk_size // args.scale) if args.smoke else args.chunk_size
    repeats, warmup = (1, 0) if args.smoke else (args.repeats, args.warmup)

    layer = cp_layer = None
    if args.layer:
        torch.manual_seed(0)
        layer = mt.MiniMaxM3SparseAttention(hidden_size=256 if args.smoke else 6144, num_q_heads=hq,
                                            num_kv_heads=hkv, deterministic=args.deterministic, device=device,
                                            dtype=torch.bfloat16)
        layer.reset_parameters()
        cp_layer = cp.ContextParallelSparseAttention(layer, save_gathered=args.save_gathered)

    for case_id, cu in read_packs(args.data, args.packs):
        if args.smoke:
            cu = scaled(cu, args.scale)
        split = cp.split_for_context_parallel(cu, world, chunk, num_q_heads=hq, num_index_heads=hkv)
        shard = split.shard(rank)
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        leaves, dout = random_inputs(shard.num_tokens, hq, hkv, layer, device, seed=1000 + rank)
        for _ in range(warmup):
            timed_step(args, shard, leaves, dout, cp_layer, device)
        fwd, total = [], []
        for _ in range(repeats):
            # The group is as fast as its slowest rank.
            t = torch.tensor(timed_step(args, shard, leaves, dout, cp_layer, device), dtype=torch.float64,
                             device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            fwd.append(t[0].item())
            total.append(t[1].item())
        on_gpu = device.type == "cuda"
        mine = torch.tensor([torch.cuda.max_memory_allocated(device) / 2**20 if on_gpu else -1.0,
                             float(shard.num_kv_tokens)], dtype=torch.float64, device=device)
        every = [torch.zeros_like(mine) for _ in range(world)]
        dist.all_gather(every, mine)
        del leaves, dout
        if rank != 0:
            continue
        step_ms = statistics.median(total)
        mem = [p[0].item() for p in every]
        row = {
            "case_id": case_id, "num_documents": len(cu) - 1, "total_tokens": cu[-1], "world_size": world,
            "device": torch.cuda.get_device_name(device) if on_gpu else "cpu", "smoke": bool(args.smoke),
            "layer": bool(args.layer), "chunk_size": chunk, "num_q_heads": hq, "num_kv_heads": hkv,
            "step_ms": step_ms, "fwd_ms": statistics.median(fwd), "tokens_per_s": cu[-1] / (step_ms / 1e3),
            "peak_mib_max": max(mem) if on_gpu else None, "peak_mib_min": min(mem) if on_gpu else None,
            "imbalance": split.imbalance(), "kv_tokens_mean": sum(p[1].item() for p in every) / world,
            "save_gathered": bool(args.save_gathered), "repeats": repeats,
        }
        print(json.dumps(row), flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(row) + "\n")
    dist.destroy_process_group()


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.launch:
        return launch(args, argv)
    run_rank(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
