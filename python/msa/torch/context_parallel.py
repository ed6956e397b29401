"""Context parallelism for MSA training through torch.distributed.

The tokens of a packed batch (documents described by ``cu_seqlens``) are cut into chunks of
``chunk_size`` tokens and the chunks are dealt to the ranks so that every rank gets the same
number of chunks and about the same *useful work* (not the same number of tokens: a query at
document position p attends at most 16 blocks of 128 keys, ~min(p + 1, 2048) keys, while the
indexer scores all p + 1 earlier keys). A rank holds the queries, keys and values of its own
tokens. Per layer call it

  1. all-gathers K, V and index-K of every rank (one ``all_gather_into_tensor``),
  2. copies out the documents its queries need, each document's key prefix stored once, and
     describes its queries as *fragments* (spec §5.1): fragment b reads keys
     [cu_seqlens_k[fragment_indices[b]], cu_seqlens_k[b + 1]) and is the causal suffix of
     that range, so query positions are the global document positions,
  3. runs the indexer, the sparse attention and (training) the indexer's KL gradient on its
     queries only,

and in backward it writes its float32 dK, dV and d index-K into a buffer laid out like the
gathered one and reduce-scatters it (``reduce_scatter_tensor``, sum) so each rank receives the
complete gradients of the keys it owns. Reduce-scatter rather than all-reduce + slice: it moves
half the bytes ((W - 1) / W of the buffer per rank instead of 2 (W - 1) / W) and never holds
the reduced full buffer; backends without it (gloo in some builds) fall back to all-reduce.

The results equal the single-device results up to summation order: the same keys are seen by
every query, and the partial key gradients are summed in float32 and rounded to the key dtype
once, at the owner.

Typical use (every rank runs the same code)::

    split = split_for_context_parallel(cu_seqlens, world_size, chunk_size=1024)
    shard = split.shard(rank)                       # host-side plan, no communication
    q, k, v, iq, ik = <this rank's projections of its tokens shard.tokens>
    out = context_parallel_sparse_attention(q, k, v, iq, ik, shard)
    loss(out).backward()                            # collectives run inside backward

Collectives run inside autograd, so every rank must call forward and backward the same number
of times in the same order (as with any context-parallel layer).
"""

import contextlib
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn

from .. import _native
from . import _ops
from .functional import attach_loss

__all__ = [
    "ContextParallelSplit", "ContextParallelShard", "split_for_context_parallel", "token_costs",
    "context_parallel_sparse_attention", "ContextParallelSparseAttention", "gather_tokens",
]

BLOCK = 128
TOPK = 16
HEAD_DIM = 128


def _error(message: str):
    return _native.InvalidArgumentError(message)


# ---- the split (host only, identical on every rank) --------------------------------------------

def _cu_list(cu_seqlens) -> List[int]:
    if isinstance(cu_seqlens, Tensor):
        cu_seqlens = cu_seqlens.tolist()
    cu = [int(c) for c in cu_seqlens]
    if len(cu) < 2 or cu[0] != 0:
        raise _error(f"cu_seqlens must start at 0 and hold at least 2 entries, got {cu[:4]}...")
    for i in range(1, len(cu)):
        if cu[i] < cu[i - 1]:
            raise _error(f"cu_seqlens must be non-decreasing, got cu_seqlens[{i - 1}] = {cu[i - 1]} > "
                         f"cu_seqlens[{i}] = {cu[i]}")
    if cu[-1] <= 0:
        raise _error("cu_seqlens describes no tokens")
    return cu


def _document_positions(cu: Sequence[int]) -> Tuple[np.ndarray, np.ndarray]:
    """Document id and in-document position of every packed token (int64 [T] each)."""
    lengths = np.diff(np.asarray(cu, dtype=np.int64))
    doc = np.repeat(np.arange(len(lengths), dtype=np.int64), lengths)
    pos = np.arange(cu[-1], dtype=np.int64) - np.asarray(cu[:-1], dtype=np.int64)[doc]
    return doc, pos


def token_costs(positions, attention_weight: float, indexer_weight: float,
                attention_window: int = TOPK * BLOCK) -> np.ndarray:
    """Useful work of a query at in-document position p (float64):
    attention_weight * min(p + 1, attention_window) + indexer_weight * (p + 1)."""
    p1 = np.asarray(positions, dtype=np.float64) + 1.0
    return attention_weight * np.minimum(p1, float(attention_window)) + indexer_weight * p1


def _default_weights(num_q_heads: int, num_index_heads: int) -> Tuple[float, float]:
    # FLOPs per (query, key) pair (docs/context_parallel.md): attention forward 4 * Hq * 128
    # and backward 2.5x that; indexer scores 2 * Hi * 128 over every causal key.
    return 4.0 * num_q_heads * HEAD_DIM * 3.5, 2.0 * num_index_heads * HEAD_DIM


def _greedy(costs: np.ndarray, room: List[int]) -> List[List[int]]:
    """Items, largest cost first, into the least loaded bin that has room (room[r] items)."""
    load = [0.0] * len(room)
    bins: List[List[int]] = [[] for _ in room]
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        r = min((r for r in range(len(room)) if len(bins[r]) < room[r]), key=lambda r: (load[r], r))
        bins[r].append(i)
        load[r] += float(costs[i])
    return bins


def _refine(costs: np.ndarray, chunks: List[List[int]], max_steps: int) -> List[List[int]]:
    """Swaps one chunk of the most loaded rank with one of another rank while that lowers the
    larger of the two loads (the best such swap each step). Chunk counts do not change."""
    chunks = [list(c) for c in chunks]
    load = np.array([costs[c].sum() for c in chunks], dtype=np.float64)
    for _ in range(max_steps):
        hi = int(np.argmax(load))
        mine = np.asarray(chunks[hi])
        best = None  # (new max of the pair, lo, position in hi, position in lo)
        for lo in range(len(chunks)):
            if lo == hi or not chunks[lo]:
                continue
            theirs = np.asarray(chunks[lo])
            delta = costs[mine][:, None] - costs[theirs][None, :]
            pair_max = np.where(delta > 0, np.maximum(load[hi] - delta, load[lo] + delta), np.inf)
            at = int(np.argmin(pair_max))
            value = float(pair_max.flat[at])
            if value < load[hi] * (1 - 1e-12) and (best is None or value < best[0]):
                best = (value, lo, at // len(theirs), at % len(theirs))
        if best is None:
            break
        _, lo, i, j = best
        a, b = chunks[hi][i], chunks[lo][j]
        chunks[hi][i], chunks[lo][j] = b, a
        load[hi] += costs[b] - costs[a]
        load[lo] += costs[a] - costs[b]
    return [sorted(c) for c in chunks]


def _max_over_mean(costs: np.ndarray, chunks: List[List[int]]) -> float:
    loads = np.array([costs[c].sum() for c in chunks])
    return float(loads.max() / loads.mean())


def _balanced_assignment(costs: np.ndarray, world_size: int, slack: float = 1e-3) -> List[List[int]]:
    """Chunks -> ranks with equal chunk counts (to within one) and balanced summed cost.

    Two candidates: (a) single chunks dealt largest first to the least loaded rank with room;
    (b) runs of g adjacent chunks (about 4 runs per rank) dealt the same way. Both are then
    refined by single-chunk swaps. (b) gives each rank few, long runs of tokens, hence few
    query fragments and fuller attention tiles; it is taken unless its imbalance exceeds (a)'s
    by more than `slack`."""
    n = len(costs)
    room = [n // world_size + (1 if r < n % world_size else 0) for r in range(world_size)]
    single = _refine(costs, _greedy(costs, room), 4 * n)
    per = n // world_size
    g = max([d for d in range(2, per // 4 + 1) if per % d == 0], default=1)
    if n % world_size or g == 1:
        return single
    units = _greedy(costs.reshape(-1, g).sum(axis=1), [per // g] * world_size)
    runs = _refine(costs, [[u * g + j for u in us for j in range(g)] for us in units], 4 * n)
    return runs if _max_over_mean(costs, runs) <= _max_over_mean(costs, single) + slack else single


@dataclass
class ContextParallelShard:
    """What one rank holds and computes. Host tensors unless noted.

    tokens            int64 [n]: global packed rows of this rank's tokens, ascending (its
                      queries, and the keys it owns)
    positions         int32 [n]: in-document positions of those tokens (for RoPE)
    cu_seqlens_q/_k   int32 [F + 1], fragment_indices int32 [F]: the rank-local layout of its
                      F query fragments over the rank-local KV buffer (spec §5.1)
    kv_index          int64 [local_k]: rows of the gathered buffer ([world_size * capacity],
                      rank-major) that form the rank-local KV buffer, documents in order, each
                      document's key prefix [0, last needed position] once
    capacity          tokens per rank in the gathered buffer (the largest shard; smaller shards
                      are padded)
    """

    rank: int
    world_size: int
    total_tokens: int
    capacity: int
    chunks: List[int]
    tokens: Tensor
    positions: Tensor
    cu_seqlens_q: Tensor
    cu_seqlens_k: Tensor
    fragment_indices: Tensor
    kv_index: Tensor
    cost: float
    _device_index: dict = field(default_factory=dict, repr=False)

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.numel())

    @property
    def num_kv_tokens(self) -> int:
        return int(self.kv_index.numel())

    @property
    def num_fragments(self) -> int:
        return int(self.fragment_indices.numel())

    def take(self, x: Tensor) -> Tensor:
        """This rank's rows of a global packed tensor [T, ...] (for tests and data loading)."""
        return x.index_select(0, self._index(self.tokens, x.device))

    def _index(self, t: Tensor, device) -> Tensor:
        key = (id(t), str(device))
        cached = self._device_index.get(key)
        if cached is None:
            cached = t.to(device)
            self._device_index[key] = cached
        return cached

    def kv_index_on(self, device) -> Tensor:
        return self._index(self.kv_index, device)


class ContextParallelSplit:
    """The assignment of a pack's chunks to ranks (same on every rank; host only).

    chunks[r]  ascending chunk ids of rank r; chunk c covers tokens [c * chunk_size,
               min((c + 1) * chunk_size, T))
    costs[r]   summed token cost of rank r (``token_costs``)
    """

    def __init__(self, cu_seqlens, world_size: int, chunk_size: int = 1024, *, num_q_heads: int = 64,
                 num_index_heads: int = 4, attention_weight: Optional[float] = None,
                 indexer_weight: Optional[float] = None, attention_window: int = TOPK * BLOCK):
        cu = _cu_list(cu_seqlens)
        if world_size < 1:
            raise _error(f"world_size must be >= 1, got {world_size}")
        if chunk_size < 1:
            raise _error(f"chunk_size must be >= 1, got {chunk_size}")
        total = cu[-1]
        num_chunks = (total + chunk_size - 1) // chunk_size
        if num_chunks < world_size:
            raise _error(f"a pack of {total} tokens gives {num_chunks} chunks of {chunk_size} tokens, fewer than "
                         f"world_size = {world_size}: every rank needs at least one chunk (use a smaller chunk_size)")
        dw_attn, dw_index = _default_weights(num_q_heads, num_index_heads)
        self.attention_weight = dw_attn if attention_weight is None else float(attention_weight)
        self.indexer_weight = dw_index if indexer_weight is None else float(indexer_weight)
        self.cu_seqlens = cu
        self.world_size = world_size
        self.chunk_size = chunk_size
        self.total_tokens = total
        self.num_chunks = num_chunks

        self.document, self.position = _document_positions(cu)  # int64 [T] each
        cost = token_costs(self.position, self.attention_weight, self.indexer_weight, attention_window)
        padded = np.zeros(num_chunks * chunk_size)
        padded[:total] = cost
        self.chunk_costs = padded.reshape(num_chunks, chunk_size).sum(axis=1)
        self.chunks = _balanced_assignment(self.chunk_costs, world_size)
        self.costs = [float(self.chunk_costs[c].sum()) for c in self.chunks]

        # Owner rank and row inside the owner's shard of every global token.
        self.rank_tokens = []
        self.owner = np.empty(total, dtype=np.int64)
        self.row_in_owner = np.empty(total, dtype=np.int64)
        for r, cs in enumerate(self.chunks):
            toks = np.concatenate([np.arange(c * chunk_size, min((c + 1) * chunk_size, total)) for c in cs])
            self.rank_tokens.append(toks)
            self.owner[toks] = r
            self.row_in_owner[toks] = np.arange(len(toks))
        self.capacity = max(len(t) for t in self.rank_tokens)

    def imbalance(self) -> float:
        """max / mean of the per-rank costs (1.0 = perfect)."""
        return max(self.costs) / (sum(self.costs) / self.world_size)

    def shard(self, rank: int) -> ContextParallelShard:
        if not 0 <= rank < self.world_size:
            raise _error(f"rank must be in [0, {self.world_size}), got {rank}")
        toks = self.rank_tokens[rank]
        doc, pos = self.document[toks], self.position[toks]
        # Fragments: maximal runs of consecutive tokens of one document.
        breaks = np.nonzero((np.diff(toks) != 1) | (np.diff(doc) != 0))[0] + 1
        starts = np.concatenate([[0], breaks])
        ends = np.concatenate([breaks, [len(toks)]])
        cu_q, cu_k, frag, kv_rows = [0], [0], [], []
        kv_base = 0
        f = 0
        while f < len(starts):
            d = int(doc[starts[f]])
            first = f
            last_end = 0
            while f < len(starts) and int(doc[starts[f]]) == d:
                q_len = int(ends[f] - starts[f])
                end_pos = int(pos[ends[f] - 1]) + 1  # keys [0, end_pos) of document d
                cu_q.append(cu_q[-1] + q_len)
                cu_k.append(kv_base + end_pos)
                frag.append(first)
                last_end = end_pos
                f += 1
            g0 = self.cu_seqlens[d]
            kv_rows.append(np.arange(g0, g0 + last_end))
            kv_base += last_end
        kv_global = np.concatenate(kv_rows)
        kv_index = self.owner[kv_global] * self.capacity + self.row_in_owner[kv_global]
        i32 = torch.int32
        return ContextParallelShard(
            rank=rank, world_size=self.world_size, total_tokens=self.total_tokens, capacity=self.capacity,
            chunks=list(self.chunks[rank]), tokens=torch.from_numpy(toks.astype(np.int64)),
            positions=torch.from_numpy(pos.astype(np.int32)), cu_seqlens_q=torch.tensor(cu_q, dtype=i32),
            cu_seqlens_k=torch.tensor(cu_k, dtype=i32), fragment_indices=torch.tensor(frag, dtype=i32),
            kv_index=torch.from_numpy(kv_index.astype(np.int64)), cost=self.costs[rank])


def split_for_context_parallel(cu_seqlens, world_size: int, chunk_size: int = 1024, **cost_options):
    """Splits a packed batch (cu_seqlens over T tokens) over world_size ranks in chunks of
    chunk_size tokens, balanced by useful work. ``cost_options``: num_q_heads (64),
    num_index_heads (4), attention_weight / indexer_weight (per key, default from FLOPs),
    attention_window (2048). Returns a ContextParallelSplit; ``.shard(rank)`` is one rank's plan."""
    return ContextParallelSplit(cu_seqlens, world_size, chunk_size, **cost_options)


# ---- collectives ---------------------------------------------------------------------------------

def _backend(group) -> str:
    return str(dist.get_backend(group)).lower()


def _all_gather(shard_rows: Tensor, world_size: int, group) -> Tensor:
    """[capacity, F] -> [world_size * capacity, F], rank-major. Moved as bytes so that every
    backend gathers every dtype (gathering does no arithmetic)."""
    out = shard_rows.new_empty((world_size * shard_rows.shape[0], *shard_rows.shape[1:]))
    if world_size == 1:
        out.copy_(shard_rows)
        return out
    src, dst = shard_rows.view(torch.uint8), out.view(torch.uint8)
    try:
        dist.all_gather_into_tensor(dst, src, group=group)
    except (RuntimeError, NotImplementedError):
        if _backend(group) != "gloo":
            raise
        # Older gloo builds have no all_gather_into_tensor: gather into views of the output.
        dist.all_gather(list(dst.chunk(world_size)), src, group=group)
    return out


def _reduce_scatter(full: Tensor, world_size: int, group) -> Tensor:
    """Sum over ranks of full [world_size * capacity, F] (float32), keeping this rank's rows."""
    if world_size == 1:
        return full
    rows = full.shape[0] // world_size
    out = full.new_empty((rows, *full.shape[1:]))
    try:
        dist.reduce_scatter_tensor(out, full, op=dist.ReduceOp.SUM, group=group)
    except (RuntimeError, NotImplementedError):
        if _backend(group) != "gloo":
            raise
        # Older gloo builds have no reduce-scatter: all-reduce and keep this rank's rows.
        dist.all_reduce(full, op=dist.ReduceOp.SUM, group=group)
        rank = dist.get_rank(group)
        out = full[rank * rows:(rank + 1) * rows]
    return out


# ---- the autograd function -----------------------------------------------------------------------

def _dl(t: Tensor):
    return torch.utils.dlpack.to_dlpack(t.detach())


def _run(t: Tensor, deterministic: bool):
    stream = torch.cuda.current_stream(t.device).cuda_stream if t.is_cuda else 0
    return dict(deterministic=bool(deterministic), num_threads=0, stream=stream)


def _device_of(t: Tensor):
    """Makes t's CUDA device current (the library launches on the tensors' device)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def _feature_widths(k: Tensor, v: Tensor, index_k: Tensor):
    return [k[0].numel(), v[0].numel(), index_k[0].numel()]


def _gather_kv(k: Tensor, v: Tensor, index_k: Tensor, shard: ContextParallelShard, group):
    """This rank's K, V, index-K [n, ...] -> rank-local KV buffers [local_k, ...]."""
    n = k.shape[0]
    widths = _feature_widths(k, v, index_k)
    rows = k.new_zeros((shard.capacity, sum(widths)))  # [capacity, Hkv*128 + Hkv*128 + 128] bf16
    torch.cat([k.reshape(n, -1), v.reshape(n, -1), index_k.reshape(n, -1)], dim=1, out=rows[:n])
    gathered = _all_gather(rows, shard.world_size, group)
    local = gathered.index_select(0, shard.kv_index_on(k.device))
    kb, vb, ib = local.split(widths, dim=1)
    m = local.shape[0]
    return (kb.reshape(m, *k.shape[1:]).contiguous(), vb.reshape(m, *v.shape[1:]).contiguous(),
            ib.reshape(m, *index_k.shape[1:]).contiguous())


class _ContextParallelAttention(torch.autograd.Function):
    """(q, k, v, index_q, index_k of this rank's tokens) -> out, lse, topk, kl (a zero scalar
    whose gradient scales the indexer's KL gradients)."""

    @staticmethod
    def forward(ctx, q, k, v, index_q, index_k, shard, group, options):
        (init_blocks, local_blocks, softmax_scale, index_scale, train_indexer, deterministic, save_gathered) = options
        k_buf, v_buf, ik_buf = _gather_kv(k, v, index_k, shard, group)
        hq, hkv = q.shape[1], k.shape[1]
        topo = _native.Topology(num_q_heads=int(hq), num_kv_heads=int(hkv), num_index_heads=int(hkv),
                                init_blocks=int(init_blocks), local_blocks=int(local_blocks),
                                softmax_scale=float(softmax_scale), index_scale=float(index_scale))
        layout = _ops.layout_from_tensors(shard.cu_seqlens_q, shard.cu_seqlens_k, shard.fragment_indices)
        run = _run(q, deterministic)
        total_q = q.shape[0]
        topk = q.new_empty((hkv, total_q, topo.topk), dtype=torch.int32)
        index_lse = q.new_empty((hkv, total_q) if train_indexer else (0,), dtype=torch.float32)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        lse = q.new_empty((total_q, hq), dtype=torch.float32)
        with _device_of(q):
            qc, iqc = q.contiguous(), index_q.contiguous()
            _native.select_blocks(topo, layout, _dl(iqc), _dl(ik_buf), _dl(topk),
                                  _dl(index_lse) if train_indexer else None, 1.0, **run)
            plan = _native.build_plan(topo, layout, _dl(topk), 8, **run)
            _native.sparse_attention_forward(topo, layout, plan, _dl(qc), _dl(k_buf), _dl(v_buf), _dl(topk),
                                             _dl(out), _dl(lse), **run)
        saved = [q, k, v, index_q, index_k, out, lse, topk, index_lse]
        if save_gathered:
            saved += [k_buf, v_buf, ik_buf]
        ctx.save_for_backward(*saved)
        # The plan is not kept: on CUDA it holds a workspace of 16 partial outputs per query and
        # head, which would stay allocated for every layer until its backward. Backward rebuilds it.
        ctx.topo, ctx.layout, ctx.run = topo, layout, run
        ctx.shard, ctx.group, ctx.options = shard, group, options
        ctx.mark_non_differentiable(lse, topk)
        kl = torch.zeros((), dtype=torch.float32, device=q.device)
        return out, lse, topk, kl

    @staticmethod
    def backward(ctx, dout, _dlse, _dtopk, dkl):
        train_indexer, save_gathered = ctx.options[4], ctx.options[6]
        saved = ctx.saved_tensors
        q, k, v, index_q, index_k, out, lse, topk, index_lse = saved[:9]
        shard, group = ctx.shard, ctx.group
        if save_gathered:
            k_buf, v_buf, ik_buf = saved[9:]
        else:
            k_buf, v_buf, ik_buf = _gather_kv(k, v, index_k, shard, group)
        topo, layout, run = ctx.topo, ctx.layout, ctx.run
        m = k_buf.shape[0]
        widths = _feature_widths(k, v, index_k)
        index = shard.kv_index_on(q.device)
        # This rank's float32 key gradients, laid out like the gathered buffer and side by side,
        # [world_size * capacity, dK | dV | d index-K]; rows of keys it did not read stay 0.
        full = torch.zeros((shard.world_size * shard.capacity, sum(widths)), dtype=torch.float32, device=q.device)
        full_dk, full_dv, full_dik = full.split(widths, dim=1)
        dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        diq = None
        with _device_of(q):
            dk32 = torch.empty(k_buf.shape, dtype=torch.float32, device=q.device)
            dv32 = torch.empty(v_buf.shape, dtype=torch.float32, device=q.device)
            plan = _native.build_plan(topo, layout, _dl(topk), 8, **run)
            _native.sparse_attention_backward(topo, layout, plan, _dl(q.contiguous()), _dl(k_buf), _dl(v_buf),
                                              _dl(topk), _dl(out), _dl(lse), _dl(dout.contiguous()), _dl(dq),
                                              _dl(dk32), _dl(dv32), **run)
            full_dk.index_copy_(0, index, dk32.view(m, -1))  # kv_index has no repeats
            full_dv.index_copy_(0, index, dv32.view(m, -1))
            del dk32, dv32
            if train_indexer:
                diq32 = torch.empty(index_q.shape, dtype=torch.float32, device=q.device)
                dik32 = torch.empty(ik_buf.shape, dtype=torch.float32, device=q.device)
                # grad_scale 1 / (Hi * T) with the *global* token count: the single-device mean.
                grad_scale = 1.0 / (index_q.shape[1] * shard.total_tokens)
                _native.kl_backward(topo, layout, plan, _dl(q.contiguous()), _dl(k_buf), _dl(lse),
                                    _dl(index_q.contiguous()), _dl(ik_buf), _dl(index_lse), _dl(topk), _dl(diq32),
                                    _dl(dik32), grad_scale, **run)
                full_dik.index_copy_(0, index, (dik32 * dkl).view(m, -1))
                diq = (diq32 * dkl).to(index_q.dtype)
                del dik32
        del k_buf, v_buf, ik_buf
        # Sum over ranks; each rank keeps the rows of the keys it owns.
        mine = _reduce_scatter(full, shard.world_size, group)[:k.shape[0]]
        dk, dv, dik = (t.reshape(s.shape).to(s.dtype) for t, s in zip(mine.split(widths, dim=1), (k, v, index_k)))
        if not train_indexer:
            dik = None
        return dq, dk, dv, diq, dik, None, None, None


def context_parallel_sparse_attention(q: Tensor, k: Tensor, v: Tensor, index_q: Tensor, index_k: Tensor,
                                      shard: ContextParallelShard, *, group=None, train_indexer: Optional[bool] = None,
                                      indexer_loss_weight: float = 1.0, init_blocks: int = 0, local_blocks: int = 1,
                                      softmax_scale: float = 0.0, index_scale: float = 0.0,
                                      deterministic: bool = False, save_gathered: bool = False,
                                      return_lse: bool = False, return_topk: bool = False):
    """MSA over a context-parallel shard: selection, sparse attention and (training) the
    indexer's KL gradient for this rank's queries against the full keys of their documents.

    q [n, Hq, 128], k, v [n, Hkv, 128], index_q [n, Hi, 128], index_k [n, 1, 128] (bf16) are the
    projections of this rank's tokens (``shard.tokens``, in that order; positions for RoPE in
    ``shard.positions``). Returns out [n, Hq, 128] (+ lse f32 [n, Hq], + topk int32 [Hi, n, 16]).

    Differentiable in q, k, v (dK, dV reach the owners of the keys through a reduce-scatter)
    and, when ``train_indexer`` (default: grad enabled and index_q / index_k require grad and
    the weight is > 0), in index_q / index_k through the KL(teacher || student) gradient,
    averaged over index heads and the pack's *global* tokens and scaled by
    ``indexer_loss_weight`` (as ``MiniMaxM3SparseAttention`` does on one device).

    ``save_gathered`` keeps the gathered K/V/index-K for backward instead of gathering again
    (faster backward, more memory per layer). group: the context-parallel process group
    (None = the default group; its size must be shard.world_size)."""
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    if world != shard.world_size:
        raise _error(f"the process group has {world} ranks but the shard was planned for {shard.world_size}")
    if world > 1 and dist.get_rank(group) != shard.rank:
        raise _error(f"this process is rank {dist.get_rank(group)} of the group but holds the shard of rank "
                     f"{shard.rank}")
    n = shard.num_tokens
    for name, t, heads in (("q", q, None), ("k", k, None), ("v", v, k.shape[1] if k.dim() == 3 else None),
                           ("index_q", index_q, None), ("index_k", index_k, 1)):
        if t.dim() != 3 or t.shape[0] != n or (heads is not None and t.shape[1] != heads):
            want = f"[{n}, {'H' if heads is None else heads}, 128]"
            raise _error(f"{name} must have shape {want} (this rank's {n} tokens), got {list(t.shape)}")
    if train_indexer is None:
        train_indexer = (torch.is_grad_enabled() and indexer_loss_weight > 0
                         and (index_q.requires_grad or index_k.requires_grad))
    options = (init_blocks, local_blocks, softmax_scale, index_scale, bool(train_indexer), deterministic,
               save_gathered)
    out, lse, topk, kl = _ContextParallelAttention.apply(q, k, v, index_q, index_k, shard, group, options)
    if train_indexer:
        out = attach_loss(out, kl * indexer_loss_weight)
    result = (out,)
    if return_lse:
        result += (lse,)
    if return_topk:
        result += (topk,)
    return result[0] if len(result) == 1 else result


def gather_tokens(x: Tensor, split: ContextParallelSplit, group=None) -> Tensor:
    """Reassembles per-rank rows x [n_rank, ...] into the global packed order [T, ...] on every
    rank (not differentiable; for checks and logging)."""
    world = split.world_size
    rows = x.new_zeros((split.capacity, *x.shape[1:]))
    rows[:x.shape[0]] = x.detach()
    gathered = _all_gather(rows, world, group) if world > 1 else rows
    index = split.owner * split.capacity + split.row_in_owner
    return gathered.index_select(0, torch.from_numpy(index).to(x.device))


# ---- the MiniMax-M3 layer over a shard -----------------------------------------------------------

class ContextParallelSparseAttention(nn.Module):
    """Runs a ``MiniMaxM3SparseAttention`` (its parameters, shared, not copied) over a
    context-parallel shard: forward(hidden [n, hidden], shard) -> [n, hidden] for this rank's
    tokens. Parameter gradients are this rank's contribution; sum them over the group (as data
    parallelism or FSDP does) to obtain the single-device gradients."""

    def __init__(self, layer, group=None, save_gathered: bool = False):
        super().__init__()
        self.layer = layer
        self.group = group
        self.save_gathered = save_gathered

    def forward(self, hidden_states: Tensor, shard: ContextParallelShard) -> Tensor:
        layer = self.layer
        positions = shard.positions.to(hidden_states.device)
        q, k, v, iq, ik = layer.project(hidden_states, positions)
        bf16 = torch.bfloat16
        q, k, v, iq, ik = q.to(bf16), k.to(bf16), v.to(bf16), iq.to(bf16), ik.to(bf16)
        train_indexer = (layer.training and torch.is_grad_enabled() and layer.indexer_loss_weight > 0
                         and (iq.requires_grad or ik.requires_grad))
        out, topk = context_parallel_sparse_attention(
            q, k, v, iq, ik, shard, group=self.group, train_indexer=train_indexer,
            indexer_loss_weight=layer.indexer_loss_weight, init_blocks=layer.init_blocks,
            local_blocks=layer.local_blocks, deterministic=layer.deterministic, save_gathered=self.save_gathered,
            return_topk=True)
        layer.last_topk = topk
        return layer.o_proj(out.reshape(shard.num_tokens, -1).to(layer.o_proj.weight.dtype))
