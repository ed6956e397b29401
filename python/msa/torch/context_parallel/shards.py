"""Shard planning: which tokens a rank holds, and the rank-local layout (query fragments over
a rank-local KV buffer gathered from every rank). Host only and identical on every rank."""

from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import Tensor

from ... import _calls, _native
from .balance import ATTENTION_WINDOW, balanced_assignment, default_weights, token_costs


def _error(message: str):
    return _native.InvalidArgumentError(message)


def _cu_list(cu_seqlens) -> List[int]:
    cu = _calls.int_list(cu_seqlens, "cu_seqlens")  # integers only: a float array is refused
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


@dataclass
class ContextParallelShard:
    """What one rank holds and computes. Host tensors unless noted.

    tokens            int64 [n]: global packed rows of this rank's tokens, ascending (its
                      queries, and the keys it owns)
    positions         int32 [n]: in-document positions of those tokens (for RoPE)
    cu_seqlens_q/_k   int32 [F + 1], fragment_indices int32 [F]: the rank-local layout of its
                      F query fragments over the rank-local KV buffer (docs/semantics.md §2.3)
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
                 indexer_weight: Optional[float] = None, attention_window: int = ATTENTION_WINDOW):
        cu = _cu_list(cu_seqlens)
        world_size = _calls.integer(world_size, "world_size")
        chunk_size = _calls.integer(chunk_size, "chunk_size")
        if world_size < 1:
            raise _error(f"world_size must be >= 1, got {world_size}")
        if chunk_size < 1:
            raise _error(f"chunk_size must be >= 1, got {chunk_size}")
        total = cu[-1]
        num_chunks = (total + chunk_size - 1) // chunk_size
        if num_chunks < world_size:
            raise _error(f"a pack of {total} tokens gives {num_chunks} chunks of {chunk_size} tokens, fewer than "
                         f"world_size = {world_size}: every rank needs at least one chunk (use a smaller chunk_size)")
        dw_attn, dw_index = default_weights(num_q_heads, num_index_heads)
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
        self.chunks = balanced_assignment(self.chunk_costs, world_size)
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
