"""Load balancing: the useful work of a token and the dealing of chunks to ranks so that every
rank gets the same number of chunks and about the same work (host only, deterministic, so
every rank computes the same assignment)."""

from typing import List, Tuple

import numpy as np

from ...constants import BLOCK_SIZE, HEAD_DIM, TOPK

# Keys a query attends at most: its 16 selected blocks of 128.
ATTENTION_WINDOW = TOPK * BLOCK_SIZE


def token_costs(positions, attention_weight: float, indexer_weight: float,
                attention_window: int = ATTENTION_WINDOW) -> np.ndarray:
    """Useful work of a query at in-document position p (float64):
    attention_weight * min(p + 1, attention_window) + indexer_weight * (p + 1)."""
    p1 = np.asarray(positions, dtype=np.float64) + 1.0
    return attention_weight * np.minimum(p1, float(attention_window)) + indexer_weight * p1


def default_weights(num_q_heads: int, num_index_heads: int) -> Tuple[float, float]:
    """(attention_weight, indexer_weight) per (query, key) pair from the FLOPs
    (docs/context_parallel.md): attention forward 4 * Hq * 128 and backward 2.5x that; the
    indexer scores 2 * Hi * 128 over every causal key."""
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


def balanced_assignment(costs: np.ndarray, world_size: int, slack: float = 1e-3) -> List[List[int]]:
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
