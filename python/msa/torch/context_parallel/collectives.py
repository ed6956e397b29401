"""The collectives of context parallelism: all-gather of the keys (as bytes, any dtype) and
reduce-scatter of their float32 gradients, with fallbacks for gloo builds that lack them."""

import torch
import torch.distributed as dist
from torch import Tensor

from .shards import ContextParallelShard, ContextParallelSplit


def _backend(group) -> str:
    return str(dist.get_backend(group)).lower()


def all_gather(shard_rows: Tensor, world_size: int, group) -> Tensor:
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


def reduce_scatter(full: Tensor, world_size: int, group) -> Tensor:
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


def feature_widths(k: Tensor, v: Tensor, index_k: Tensor):
    """Row widths of K, V and index-K side by side in one gathered buffer."""
    return [k[0].numel(), v[0].numel(), index_k[0].numel()]


def gather_kv(k: Tensor, v: Tensor, index_k: Tensor, shard: ContextParallelShard, group):
    """This rank's K, V, index-K [n, ...] -> rank-local KV buffers [local_k, ...] (one all-gather)."""
    n = k.shape[0]
    widths = feature_widths(k, v, index_k)
    rows = k.new_zeros((shard.capacity, sum(widths)))  # [capacity, Hkv*128 + Hkv*128 + 128] bf16
    torch.cat([k.reshape(n, -1), v.reshape(n, -1), index_k.reshape(n, -1)], dim=1, out=rows[:n])
    gathered = all_gather(rows, shard.world_size, group)
    local = gathered.index_select(0, shard.kv_index_on(k.device))
    kb, vb, ib = local.split(widths, dim=1)
    m = local.shape[0]
    return (kb.reshape(m, *k.shape[1:]).contiguous(), vb.reshape(m, *v.shape[1:]).contiguous(),
            ib.reshape(m, *index_k.shape[1:]).contiguous())


def gather_tokens(x: Tensor, split: ContextParallelSplit, group=None) -> Tensor:
    """Reassembles per-rank rows x [n_rank, ...] into the global packed order [T, ...] on every
    rank (not differentiable; for checks and logging)."""
    world = split.world_size
    rows = x.new_zeros((split.capacity, *x.shape[1:]))
    rows[:x.shape[0]] = x.detach()
    gathered = all_gather(rows, world, group) if world > 1 else rows
    index = split.owner * split.capacity + split.row_in_owner
    return gathered.index_select(0, torch.from_numpy(index).to(x.device))
