#!/usr/bin/env python3
"""Prefill steps over a production manifest: msa's sparse step through the Python API against
PyTorch's dense attention on the same queries and keys, on one CUDA GPU.

Per case of the manifest (one JSON object a line, as `msa bench --prefill` reads it:
batch_size, query_lens, prefix_lens, final_kv_lens; optional case_id, tags,
representative_weight, stratum, count) and K/V cache format (bf16, FP8 E4M3):
  msa    one step: msa.inference.plan_paged_prefill + paged_indexer + paged_attention over a
         paged cache (pages of one random pool, each request's pages in scattered order; bf16
         index-K cache); the indexer is also timed alone for its share of the step;
  dense  torch.nn.functional.scaled_dot_product_attention per request of the batch (the times
         added up): the request's queries over its full K / V (64 heads; the 4 KV heads
         expanded with repeat_interleave before timing) with a bottom-right causal mask
         (torch.nn.attention.bias.causal_lower_right); the flash, cuDNN and memory-efficient
         backends are each tried with torch.nn.attention.sdpa_kernel and the fastest that
         accepts the shape is kept. Dense attention does not depend on the cache format.
Times are medians of CUDA-event measurements after warm-up runs, all in this process. msa's
CUDA memory comes from PyTorch's caching allocator (import msa.torch), as in a PyTorch engine.

Output: a table (msa ms, indexer share, dense ms, speed-up = dense / msa per case), totals per
stratum and over all cases weighted by production weight (speed-up = Σ w·dense / Σ w·msa), the
number of cases where msa is slower than dense; --json FILE writes it all, --chart PNG draws
the weighted speed-up per stratum (matplotlib, log scale).

  python bench/prefill_bench.py bench/data/prefill_benchmark_cases.jsonl [--cases representative|all|TAG]
                                [--formats bf16,fp8] [--reps 10] [--warmup 3] [--json FILE] [--chart PNG]
  python bench/prefill_bench.py --long 1m:16k:5 [...]

--long N:C[:K]: one prompt of N tokens prefilled in chunks of C (chunk c: prefix c * C); with K
only the middle chunk of each group of K consecutive chunks is timed (msa and dense) and
stands for its group, so the totals estimate the whole prompt.

Without PyTorch, a CUDA device or an msa built with CUDA it exits with code 2 and says which.
The manifest and the arguments are checked first (exit 2 with the line and field at fault).
--device cpu runs the same path on msa's CPU backend with wall-clock times: a functional check
of the script where there is no GPU (tests/python/test_prefill_bench.py), not a benchmark.
"""

import argparse
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field

PAGE = 128
MAX_KV = 8192 * PAGE  # the library's limit: 8192 pages a request
HQ, HKV, HI, DIM = 64, 4, 4, 128
FORMATS = ("bf16", "fp8")
# Where the timed part runs: "cuda", or "cpu" for --device cpu (a functional check of this
# script on a machine without a GPU: wall-clock times, not a benchmark).
DEVICE = "cuda"


class ManifestError(ValueError):
    """A manifest row or a --long value that cannot be used; the message names where."""


# ---- the workload ----------------------------------------------------------------------------

@dataclass
class Case:
    case_id: str
    query_lens: list
    prefix_lens: list
    line: int = 0  # manifest line; 0 for a chunk of a long prompt
    tags: list = field(default_factory=list)
    stratum: str = ""
    weight: float = 1.0  # production weight; for a chunk, the chunks it stands for
    chunk: int = -1

    @property
    def batch(self):
        return len(self.query_lens)

    @property
    def total_q(self):
        return sum(self.query_lens)

    @property
    def kv_lens(self):
        return [p + q for p, q in zip(self.prefix_lens, self.query_lens)]

    @property
    def max_kv(self):
        return max(self.kv_lens)

    @property
    def pages(self):
        return sum(-(-kv // PAGE) for kv in self.kv_lens)

    @property
    def short_id(self):
        rest = self.case_id[len("prefill_"):] if self.case_id.startswith("prefill_") else self.case_id
        return rest[:8] if len(rest) > 12 else rest


def _shown(value):
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _integer(value, name, lo, hi, where):
    if isinstance(value, bool) or not isinstance(value, int):
        raise ManifestError(f"{where}: {name} must be an integer, got {_shown(value)}")
    if not lo <= value <= hi:
        raise ManifestError(f"{where}: {name} must be in [{lo}, {hi}], got {value}")
    return value


def _integers(row, name, count, lo, hi, where):
    if row.get(name) is None:
        raise ManifestError(f"{where}: field '{name}' is missing")
    values = row[name]
    if not isinstance(values, list):
        raise ManifestError(f"{where}: {name} must be an array of integers, got {_shown(values)}")
    if len(values) != count:
        raise ManifestError(f"{where}: {name} must have batch_size = {count} entries, got {len(values)}")
    return [_integer(v, f"{name}[{i}]", lo, hi, where) for i, v in enumerate(values)]


def weight_of(row, where="row"):
    """The production weight: representative_weight; 0 when it is null (the benchmark-case set's
    diagnostic rows, left out of its production aggregate); without the field the row's call
    count, else 1. The same rule as `msa bench --prefill`."""
    if "representative_weight" in row:
        w = row["representative_weight"]
        if w is None:
            return 0.0
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w < 0:
            raise ManifestError(f"{where}: representative_weight must be a number >= 0 or null, got {_shown(w)}")
        return float(w)
    if row.get("count") is not None:
        return float(_integer(row["count"], "count", 0, 2**63 - 1, where))
    return 1.0


def parse_row(row, line, path="manifest"):
    """One manifest row as a Case, checked as `msa bench --prefill` checks it."""
    where = f"{path}: line {line}"
    if not isinstance(row, dict):
        raise ManifestError(f"{where}: expected a JSON object, got {_shown(row)}")
    for name in ("case_id", "stratum"):
        if row.get(name) is not None and not isinstance(row[name], str):
            raise ManifestError(f"{where}: {name} must be a string or null, got {_shown(row[name])}")
    tags = row.get("tags")
    if tags is None:
        tags = []
    elif not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
        raise ManifestError(f"{where}: tags must be an array of strings or null, got {_shown(tags)}")
    weight = weight_of(row, where)
    if row.get("batch_size") is None:
        raise ManifestError(f"{where}: field 'batch_size' is missing")
    batch = _integer(row["batch_size"], "batch_size", 1, 1 << 20, where)
    query = _integers(row, "query_lens", batch, 1, MAX_KV, where)
    prefix = _integers(row, "prefix_lens", batch, 0, MAX_KV, where)
    for b, (p, q) in enumerate(zip(prefix, query)):
        if p + q > MAX_KV:
            raise ManifestError(f"{where}: prefix_lens[{b}] + query_lens[{b}] = {p + q} exceeds {MAX_KV} tokens "
                                f"(8192 pages, the most a request may have)")
    if row.get("final_kv_lens") is not None:
        final = _integers(row, "final_kv_lens", batch, 0, 2**63 - 1, where)
        for b, (kv, p, q) in enumerate(zip(final, prefix, query)):
            if kv != p + q:
                raise ManifestError(f"{where}: final_kv_lens[{b}] = {kv} must equal prefix_lens[{b}] + "
                                    f"query_lens[{b}] = {p + q}")
    return Case(case_id=row.get("case_id") or f"line {line}", query_lens=query, prefix_lens=prefix, line=line,
                tags=list(tags), stratum=row.get("stratum") or "", weight=weight)


def read_manifest_lines(lines, path="manifest"):
    """(cases, any_tags) of manifest text lines; blank lines are skipped, line numbers kept."""
    cases, any_tags = [], False
    for number, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        try:
            row = json.loads(text)
        except json.JSONDecodeError as e:
            raise ManifestError(f"{path}: line {number} is not valid JSON ({e.msg} at column {e.colno})") from None
        any_tags = any_tags or (isinstance(row, dict) and row.get("tags") is not None)
        cases.append(parse_row(row, number, path))
    if not cases:
        raise ManifestError(f"{path}: the manifest has no rows")
    return cases, any_tags


def read_manifest(path):
    if os.path.isdir(path):
        raise ManifestError(f"{path}: is a directory, expected a manifest file")
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise ManifestError(f"{path}: cannot be read ({e.strerror})") from None
    return read_manifest_lines(lines, path)


def select_cases(cases, any_tags, which=None, path="manifest"):
    """(selected cases, a label for the report). which: 'all', a tag, or None for the default:
    the 'representative' rows, or every row of a manifest without tags."""
    chosen = which if which else ("representative" if any_tags else "all")
    selected = [c for c in cases if chosen == "all" or chosen in c.tags]
    if not selected:
        tags = sorted({t for c in cases for t in c.tags})
        known = f"its tags: {', '.join(tags)}" if tags else "its rows have no tags; --cases all times every row"
        raise ManifestError(f"--cases {chosen}: no row of {path} is tagged '{chosen}' ({known})")
    note = ", the manifest has no tags" if not which and not any_tags else ""
    return selected, f"{chosen} ({len(selected)} of {len(cases)} rows{note})"


def parse_token_count(text, name):
    """'16384', '16k', '1m' -> tokens in [1, MAX_KV]."""
    digits, unit = text, 1
    if digits[-1:] in ("k", "K"):
        digits, unit = digits[:-1], 1024
    elif digits[-1:] in ("m", "M"):
        digits, unit = digits[:-1], 1024 * 1024
    if not digits.isdigit() or len(digits) > 9:
        raise ManifestError(f"--long N:C[:K]: {name} must be a token count (e.g. 16384 or 16k), got '{text}'")
    value = int(digits) * unit
    if not 1 <= value <= MAX_KV:
        raise ManifestError(f"--long N:C[:K]: {name} must be in [1, {MAX_KV}] tokens, got '{text}'")
    return value


def parse_long(text):
    """'N:C' or 'N:C:K' -> (tokens, chunk, sample)."""
    parts = text.split(":")
    if len(parts) not in (2, 3):
        raise ManifestError(f"--long must be N:C or N:C:K (e.g. 1m:16k:5), got '{text}'")
    tokens, chunk = parse_token_count(parts[0], "N"), parse_token_count(parts[1], "C")
    sample = 1
    if len(parts) == 3:
        if not parts[2].isdigit() or not 1 <= int(parts[2]) <= 1 << 20:
            raise ManifestError(f"--long N:C:K: K must be an integer in [1, {1 << 20}], got '{parts[2]}'")
        sample = int(parts[2])
    return tokens, chunk, sample


def long_chunks(tokens, chunk, sample=1):
    """The timed chunks of a prompt of `tokens` prefilled in chunks of `chunk`: the middle chunk
    (the lower middle one of an even group) of each group of `sample` consecutive chunks, with
    weight = the group's size. For a cost that grows linearly along the prompt the middle
    chunk's cost is its group's mean, so Σ weight · time estimates the whole prompt."""
    chunk = min(chunk, tokens)
    count = -(-tokens // chunk)
    sample = max(1, min(sample, count))
    cases = []
    for first in range(0, count, sample):
        group = min(sample, count - first)
        c = first + (group - 1) // 2
        cases.append(Case(case_id=f"chunk {c}", query_lens=[min(chunk, tokens - c * chunk)], prefix_lens=[c * chunk],
                          weight=float(group), chunk=c))
    return cases


# ---- totals and reports ----------------------------------------------------------------------

def totals(results, long_prompt=False):
    """Weighted sums per (stratum, cache) and per cache over every row ('all'), in that order;
    a long prompt's totals are per cache only. Each result: a dict with 'case' (a Case),
    'cache', 'msa_ms', 'dense_ms' (None when no dense backend took the shape).
    speedup = Σ w·dense / Σ w·msa over the rows that have a dense time; slower counts the rows
    whose own dense time is below msa's."""
    out = []
    for cache in dict.fromkeys(r["cache"] for r in results):
        rows = [r for r in results if r["cache"] == cache]
        groups = {}
        if not long_prompt:
            for r in rows:
                groups.setdefault(r["case"].stratum or "-", []).append(r)
            if list(groups) == ["-"]:
                groups = {}
        groups = dict(sorted(groups.items()))
        groups["all"] = rows
        for stratum, members in groups.items():
            timed = [r for r in members if r["dense_ms"] is not None]
            w_msa = sum(r["case"].weight * r["msa_ms"] for r in timed)
            w_dense = sum(r["case"].weight * r["dense_ms"] for r in timed)
            out.append({
                "stratum": stratum, "cache": cache, "cases": len(members),
                "weight": sum(r["case"].weight for r in members),
                "weighted_msa_ms": sum(r["case"].weight * r["msa_ms"] for r in members),
                "weighted_dense_ms": w_dense if timed else None,
                "speedup": w_dense / w_msa if timed and w_msa > 0 and w_dense > 0 else None,
                "slower": sum(1 for r in timed if r["dense_ms"] < r["msa_ms"]),
                "without_dense": len(members) - len(timed),
            })
    return out


def format_table(header, rows, right=None):
    """Plain-text table like the msa tool's: two spaces between columns, a rule under the header."""
    right = right or [False] * len(header)
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(header)]

    def line(cells):
        text = "  ".join(c.rjust(w) if ri else c.ljust(w) for c, w, ri in zip(cells, widths, right))
        return text.rstrip()

    return "\n".join([line(header), "-" * (sum(widths) + 2 * (len(widths) - 1))] + [line(r) for r in rows])


def _ms(v):
    return "-" if v is None else f"{v:.3f}"


def _ratio(v):
    return "-" if v is None else f"{v:.2f}x"


def _weight(w):
    return f"{w:.0f}" if float(w).is_integer() else f"{w:.2f}"


def result_table(results, long_prompt):
    if long_prompt:
        header = ["chunk", "prefix", "queries", "stands for"]
    else:
        header = ["case", "stratum", "weight", "batch", "queries", "max kv"]
    header += ["cache", "msa ms", "idx %", "dense ms", "dense backend", "speed-up"]
    rows = []
    for r in results:
        c = r["case"]
        cells = ([str(c.chunk), str(c.prefix_lens[0]), str(c.total_q), _weight(c.weight)] if long_prompt else
                 [c.short_id, c.stratum or "-", _weight(c.weight), str(c.batch), str(c.total_q), str(c.max_kv)])
        cells += [r["cache"], _ms(r["msa_ms"]), f"{100 * r['indexer_share']:.1f}", _ms(r["dense_ms"]),
                  r["dense_backend"] or "-", _ratio(r["speedup"])]
        rows.append(cells)
    right = [not (not long_prompt and i < 2) for i in range(len(header))]
    right[len(header) - 6] = right[len(header) - 2] = False  # cache, dense backend
    return format_table(header, rows, right)


def totals_table(total_rows, long_prompt):
    header = ["stratum", "cache", "cases", "weight" if not long_prompt else "chunks", "sum w*msa ms",
              "sum w*dense ms", "speed-up", "slower"]
    rows = [[t["stratum"], t["cache"], str(t["cases"]), _weight(t["weight"]), _ms(t["weighted_msa_ms"]),
             _ms(t["weighted_dense_ms"]), _ratio(t["speedup"]), str(t["slower"])] for t in total_rows]
    return format_table(header, rows, [False, False, True, True, True, True, True, True])


def draw_chart(total_rows, path, title, results=None, long_prompt=False):
    """Bar chart of the speed-up over dense (log scale): per stratum and 'all' (one bar per cache
    format); for a long prompt, per timed chunk (by prefix). Needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    caches = list(dict.fromkeys(t["cache"] for t in total_rows))
    if long_prompt:
        labels = list(dict.fromkeys(f"{r['case'].prefix_lens[0] // 1024}k" for r in results))
        value = {(f"{r['case'].prefix_lens[0] // 1024}k", r["cache"]): r["speedup"] for r in results}
    else:
        labels = list(dict.fromkeys(t["stratum"] for t in total_rows))
        value = {(t["stratum"], t["cache"]): t["speedup"] for t in total_rows}
    # Horizontal bars: one row per stratum (a manifest has dozens), one bar per format.
    height = 0.8 / max(1, len(caches))
    fig, ax = plt.subplots(figsize=(8.0, max(3.0, 0.22 * len(labels) * max(1, len(caches)) + 1.5)))
    for i, cache in enumerate(caches):
        ys = [j + (i - (len(caches) - 1) / 2) * height for j in range(len(labels))]
        xs = [value.get((label, cache)) or float("nan") for label in labels]
        ax.barh(ys, xs, height, label=f"msa {cache} cache")
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("speed-up over dense SDPA (x, log scale; production-weighted per group)")
    ax.set_yticks(range(len(labels)))
    ax.set_yticklabels(labels, fontsize=7)
    ax.set_ylim(len(labels) - 0.5, -0.5)  # first label on top, no empty margin
    ax.set_ylabel("prefix of the timed chunk" if long_prompt else "stratum (all: every case)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- the GPU side ----------------------------------------------------------------------------

def load_torch():
    """(torch, msa.inference) ready for DEVICE, or SystemExit(2) saying what is missing."""
    try:
        import torch
    except ImportError:
        raise SystemExit("prefill_bench.py: PyTorch is not installed; this benchmark needs PyTorch with CUDA") \
            from None
    if DEVICE == "cpu":
        import msa.inference as inference

        return torch, inference
    if not torch.cuda.is_available():
        raise SystemExit("prefill_bench.py: no CUDA device is usable by PyTorch; this benchmark runs on a GPU only")
    try:
        import msa
        import msa.inference as inference
        import msa.torch  # noqa: F401  (routes msa's CUDA allocations to PyTorch's caching allocator)
    except ImportError as e:
        raise SystemExit(f"prefill_bench.py: the msa Python package cannot be imported ({e})") from None
    if not msa.built_with_cuda() or msa.cuda_device_count() < 1:
        raise SystemExit("prefill_bench.py: this msa was built without its CUDA backend (or sees no device); "
                         "reinstall it with MSA_ENABLE_CUDA=ON")
    return torch, inference


def median_ms(torch, work, warmup, reps, before=None):
    """Median CUDA-event time of `work` on the current stream, after `warmup` untimed calls;
    `before` runs ahead of every timed call, outside the events. CPU: wall clock."""
    for _ in range(warmup):
        if before:
            before()
        work()
    if DEVICE == "cpu":
        times = []
        for _ in range(reps):
            if before:
                before()
            start = time.perf_counter()
            work()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        if before:
            before()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        work()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


class Pool:
    """Random cache pages for every case (as many as the largest case reads): bf16 index-K, and
    K / V in each format timed (FP8 E4M3 with a per-tensor scale of 1)."""

    def __init__(self, torch, pages, formats, generator):
        def random(*shape):
            return (torch.randn(*shape, generator=generator, device=DEVICE, dtype=torch.float32) * 0.5).to(torch.bfloat16)

        self.pages = pages
        self.index_k = random(pages, PAGE, DIM)
        self.caches = {}
        for fmt in formats:
            k, v = random(pages, HKV, PAGE, DIM), random(pages, HKV, PAGE, DIM)
            if fmt == "fp8":
                one = torch.ones(1, device=DEVICE, dtype=torch.float32)
                self.caches[fmt] = dict(k=k.to(torch.float8_e4m3fn), v=v.to(torch.float8_e4m3fn), k_scale=one,
                                        v_scale=one)
            else:
                self.caches[fmt] = dict(k=k, v=v)


def page_table(case, order):
    """cu_seqlens_q, seq_lens and page_table (NumPy int32) of a case whose pages take `order`
    (physical page ids) request by request."""
    import numpy as np

    kv = case.kv_lens
    pages = [-(-n // PAGE) for n in kv]
    table = np.zeros((case.batch, max(pages)), dtype=np.int32)
    used = 0
    for b, n in enumerate(pages):
        table[b, :n] = order[used:used + n]
        used += n
    cu = np.concatenate([[0], np.cumsum(case.query_lens)]).astype(np.int32)
    return cu, np.asarray(kv, dtype=np.int32), table


def plan_host_ms(plan, reps):
    """Median host wall time of `plan()` (planning queues its uploads without waiting for the
    device, so this is the host's share of a step), every plan kept until all are made (a
    release gives memory back, which would land in the next timing)."""
    kept, times = [], []
    for _ in range(max(3, reps)):
        start = time.perf_counter()
        kept.append(plan())
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def time_msa(torch, inference, case, order, pool, formats, generator, warmup, reps):
    """({format: (step ms, indexer ms)}, plan host ms): plan + indexer + attention, the indexer
    alone, and the plan's host time."""
    cu, seq, table = page_table(case, order)
    q = (torch.randn(case.total_q, HQ, DIM, generator=generator, device=DEVICE) * 0.5).to(torch.bfloat16)
    index_q = (torch.randn(case.total_q, HI, DIM, generator=generator, device=DEVICE) * 0.5).to(torch.bfloat16)
    plans = []  # the plans of the timed steps, freed between runs (outside the timed window)

    def plan():
        return inference.plan_paged_prefill(cu, seq, table, device=DEVICE)

    result = {}
    ready = plan()
    host_ms = plan_host_ms(plan, reps)
    indexer_ms = median_ms(torch, lambda: inference.paged_indexer(ready, index_q, pool.index_k), warmup, reps)
    for fmt in formats:
        cache = pool.caches[fmt]
        extra = dict(format=inference.KvFormat.fp8_e4m3, k_scale=cache["k_scale"], v_scale=cache["v_scale"]) \
            if fmt == "fp8" else {}

        def step():
            p = plan()
            plans.append(p)
            topk = inference.paged_indexer(p, index_q, pool.index_k)
            inference.paged_attention(p, q, cache["k"], cache["v"], topk, out_dtype="bfloat16", **extra)

        result[fmt] = (median_ms(torch, step, warmup, reps, before=plans.clear), indexer_ms)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    return result, host_ms


def sdpa_backends(torch):
    from torch.nn.attention import SDPBackend

    names = (("flash", "FLASH_ATTENTION"), ("cudnn", "CUDNN_ATTENTION"), ("efficient", "EFFICIENT_ATTENTION"))
    return [(label, getattr(SDPBackend, name)) for label, name in names if hasattr(SDPBackend, name)]


# A materialised [q, kv] bool mask (the cuDNN backend's way to a bottom-right causal mask) is
# built only up to this size.
MAX_MASK_BYTES = 8 << 30


def dense_request(torch, q_len, kv_len, generator, warmup, reps):
    """(backend, ms) of the fastest SDPA backend that takes one request's shape, or None.

    Flash and memory-efficient take the bottom-right causal mask as a CausalBias (PyTorch
    dispatches it to their causal kernels). With only cuDNN enabled a CausalBias would be
    materialised inside every call, so cuDNN gets the materialised bool mask, built before the
    timed calls. The tensors live until the function returns (one request at a time)."""
    import warnings

    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    # Built (and GQA-expanded) outside the timed calls.
    q = (torch.randn(1, HQ, q_len, DIM, generator=generator, device=DEVICE) * 0.5).to(torch.bfloat16)
    k = (torch.randn(1, HKV, kv_len, DIM, generator=generator, device=DEVICE) * 0.5).to(torch.bfloat16)
    v = (torch.randn(1, HKV, kv_len, DIM, generator=generator, device=DEVICE) * 0.5).to(torch.bfloat16)
    k, v = k.repeat_interleave(HQ // HKV, dim=1), v.repeat_interleave(HQ // HKV, dim=1)
    bias = causal_lower_right(q_len, kv_len)
    best = None
    for label, backend in sdpa_backends(torch):
        if label == "cudnn" and q_len * kv_len > MAX_MASK_BYTES:
            continue
        try:
            mask = bias._materialize(q.device) if label == "cudnn" else bias

            def attend():
                F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

            with sdpa_kernel([backend]), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # each refusing backend warns why
                ms = median_ms(torch, attend, warmup, reps)
        except RuntimeError:  # this backend does not take the shape (or runs out of memory)
            if DEVICE == "cuda":
                torch.cuda.synchronize()
            continue
        if best is None or ms < best[1]:
            best = (label, ms)
    return best


def time_dense(torch, case, generator, warmup, reps):
    """(ms, backends): SDPA over each request's full K / V, the fastest backend per request,
    times added over the batch; (None, reason) when no backend takes a request's shape."""
    total, used = 0.0, []
    for q_len, kv_len in zip(case.query_lens, case.kv_lens):
        best = dense_request(torch, q_len, kv_len, generator, warmup, reps)
        if best is None:
            return None, "none took the shape"
        used.append(best[0])
        total += best[1]
    return total, "+".join(dict.fromkeys(used))


def run(args, cases, label, long_info):
    global DEVICE
    DEVICE = args.device
    torch, inference = load_torch()
    generator = torch.Generator(device=DEVICE).manual_seed(args.seed)
    pool_pages = max(c.pages for c in cases)
    print(f"[prefill_bench] filling a pool of {pool_pages} pages", file=sys.stderr, flush=True)
    pool = Pool(torch, pool_pages, args.formats, generator)
    prompt_order = torch.randperm(pool_pages, generator=generator, device=DEVICE).cpu().numpy() if long_info else None

    results = []
    for i, case in enumerate(cases):
        print(f"[prefill_bench] {i + 1}/{len(cases)} {case.case_id}: batch {case.batch}, {case.total_q} queries, "
              f"max kv {case.max_kv}", file=sys.stderr, flush=True)
        order = prompt_order if long_info else \
            torch.randperm(pool_pages, generator=generator, device=DEVICE)[:case.pages].cpu().numpy()
        msa_times, plan_ms = time_msa(torch, inference, case, order, pool, args.formats, generator, args.warmup,
                                      args.reps)
        dense_ms, backend = time_dense(torch, case, generator, args.warmup, args.reps)
        for fmt in args.formats:
            step_ms, indexer_ms = msa_times[fmt]
            results.append(dict(case=case, cache=fmt, msa_ms=step_ms, indexer_ms=indexer_ms, plan_host_ms=plan_ms,
                                indexer_share=indexer_ms / step_ms if step_ms > 0 else 0.0, dense_ms=dense_ms,
                                dense_backend=backend if dense_ms is not None else None,
                                speedup=dense_ms / step_ms if dense_ms is not None and step_ms > 0 else None))
            print(f"[prefill_bench]   {fmt}: msa {step_ms:.3f} ms (indexer {indexer_ms:.3f}, plan on the host "
                  f"{plan_ms:.3f}), dense "
                  f"{_ms(dense_ms)} ms ({backend})", file=sys.stderr, flush=True)

    total_rows = totals(results, long_prompt=bool(long_info))
    device = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"
    timing = "CUDA events" if DEVICE == "cuda" else "wall clock: a functional check, not a benchmark"
    print(f"prefill step on {device}: msa (plan + indexer + attention, Python API) vs dense SDPA (bottom-right causal, "
          f"GQA expanded), MiniMax-M3 heads ({HQ} / {HKV} / {HI}); medians of {args.reps} runs after {args.warmup} "
          f"warm-up, {timing}")
    if long_info:
        tokens, chunk, sample = long_info
        count = -(-tokens // min(chunk, tokens))
        timed = "every chunk timed" if sample == 1 else (
            f"{len(cases)} of {count} chunks timed (the middle chunk of each group of {sample}, standing for the "
            f"group: totals are estimates)")
        print(f"long prompt: {tokens} tokens in chunks of {chunk} ({count} chunks); {timed}")
    else:
        print(f"manifest {args.manifest}, cases: {label}")
    print()
    print(result_table(results, bool(long_info)))
    print()
    print("Whole prompt per cache format (sum over the timed chunks of time x the chunks each stands for):" if long_info
          else "Production-weighted totals (weight: representative_weight; 0 when null, the row's count without the "
               "field, else 1); speed-up = sum w*dense / sum w*msa:")
    print(totals_table(total_rows, bool(long_info)))
    for t in total_rows:
        if t["stratum"] == "all":
            print(f"{t['cache']}: msa slower than dense in {t['slower']} of {t['cases'] - t['without_dense']} cases"
                  + (f" ({t['without_dense']} without a dense time)" if t["without_dense"] else ""))
    report = {
        "bench": "prefill_python", "device_name": device, "torch": torch.__version__, "reps": args.reps,
        "warmup": args.warmup,
        "timing": "CUDA events on the current stream, medians" if DEVICE == "cuda" else "wall clock, medians",
        "msa_step": "plan_paged_prefill + paged_indexer + paged_attention (out bf16), msa.torch allocator; "
                    "plan_host_ms: host wall time of plan_paged_prefill alone (median)",
        "dense": "scaled_dot_product_attention per request, causal_lower_right, K/V repeat_interleave'd before "
                 "timing, fastest of the flash / cuDNN / efficient backends that take the shape",
        "results": [dict({k: v for k, v in r.items() if k != "case"}, case_id=r["case"].case_id,
                         line=r["case"].line, stratum=r["case"].stratum or None, weight=r["case"].weight,
                         batch=r["case"].batch, query_lens=r["case"].query_lens,
                         prefix_lens=r["case"].prefix_lens, chunk=r["case"].chunk) for r in results],
        "totals": total_rows,
    }
    if long_info:
        report["long_prompt"] = dict(zip(("tokens", "chunk", "sample"), long_info))
    else:
        report["manifest"] = {"path": args.manifest, "cases": label}
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {args.json}")
    if args.chart:
        draw_chart(total_rows, args.chart, f"msa prefill step vs dense SDPA on {device}", results, bool(long_info))
        print(f"wrote {args.chart}")
    return 0


# ---- arguments -------------------------------------------------------------------------------

def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="prefill_bench.py",
                                     description="msa's sparse prefill step vs PyTorch's dense SDPA over a manifest "
                                                 "of prefill shapes (CUDA only).")
    parser.add_argument("manifest", nargs="?", help="one JSON object a line (batch_size, query_lens, prefix_lens, ...)")
    parser.add_argument("--long", metavar="N:C[:K]",
                        help="one prompt of N tokens in chunks of C, timing the middle chunk of every K (e.g. 1m:16k:5)")
    parser.add_argument("--cases", help="manifest rows: representative (default; every row without tags), all, or a tag")
    parser.add_argument("--formats", default="bf16,fp8", help="msa K/V cache formats: bf16, fp8 (default both)")
    parser.add_argument("--reps", type=int, default=10, help="timed runs per measurement (default 10)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed runs before them (default 3)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: run the script's whole path on the CPU backend with wall-clock times, a functional "
                             "check for machines without a GPU (not a benchmark)")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    parser.add_argument("--chart", metavar="PNG", help="draw the weighted speed-up per stratum (matplotlib)")
    parser.add_argument("--replot", metavar="JSON",
                        help="draw --chart from the totals of an earlier manifest run's --json (no GPU needed)")
    args = parser.parse_args(argv)
    if args.replot is not None:
        if args.manifest is not None or args.long is not None or args.chart is None:
            parser.error("--replot JSON draws --chart PNG from an earlier run: give both, and no manifest or --long")
    elif (args.manifest is None) == (args.long is None):
        parser.error("give a manifest or --long N:C[:K], one of them")
    if args.long is not None and args.cases is not None:
        parser.error("--cases selects manifest rows; --long has none")
    formats = [f for f in args.formats.split(",")]
    for f in formats:
        if f not in FORMATS:
            parser.error(f"--formats must be a comma-separated list of {', '.join(FORMATS)}, got '{f}'")
    args.formats = list(dict.fromkeys(formats))
    if args.reps < 1:
        parser.error(f"--reps must be at least 1, got {args.reps}")
    if args.warmup < 0:
        parser.error(f"--warmup must be at least 0, got {args.warmup}")
    for name in ("json", "chart"):
        path = getattr(args, name)
        if path is not None and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            parser.error(f"--{name}: the folder {os.path.dirname(os.path.abspath(path))} does not exist")
    return args


def replot(args):
    """--replot: the chart of an earlier manifest run's JSON report."""
    try:
        with open(args.replot, encoding="utf-8") as f:
            report = json.load(f)
        total_rows = report["totals"]
        if "long_prompt" in report:
            raise ValueError("it is a --long report (its chart needs the run itself)")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"prefill_bench.py: --replot {args.replot}: not a manifest report of this script ({e})") \
            from None
    draw_chart(total_rows, args.chart, f"msa prefill step vs dense SDPA on {report.get('device_name', '?')}")
    print(f"wrote {args.chart}")
    return 0


def main(argv=None):
    args = parse_args(argv)
    if args.replot is not None:
        return replot(args)
    try:
        if args.long is not None:
            long_info = parse_long(args.long)
            cases, label = long_chunks(*long_info), None
        else:
            long_info = None
            rows, any_tags = read_manifest(args.manifest)
            cases, label = select_cases(rows, any_tags, args.cases, args.manifest)
    except ManifestError as e:
        print(f"prefill_bench.py: error: {e}", file=sys.stderr)
        return 2
    try:
        return run(args, cases, label, long_info)
    except SystemExit as e:
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
