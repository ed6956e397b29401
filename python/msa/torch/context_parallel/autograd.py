"""The context-parallel attention as an autograd function over msa's registered torch ops
(torch.ops.msa.select_blocks, sparse_attention_forward / _backward, kl_backward): forward
gathers the keys and runs the indexer and the attention on this rank's queries; backward
computes this rank's float32 key gradients and reduce-scatters them to the keys' owners."""

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from ... import _native
from .. import _ops
from ..functional import attach_loss
from .collectives import feature_widths, gather_kv, reduce_scatter
from .shards import ContextParallelShard


@dataclass(frozen=True)
class ContextParallelOptions:
    """Settings of one context-parallel attention call (see context_parallel_sparse_attention)."""

    init_blocks: int = 0
    local_blocks: int = 1
    softmax_scale: float = 0.0
    index_scale: float = 0.0
    train_indexer: bool = False   # compute the indexer's KL gradient in backward
    deterministic: bool = False
    save_gathered: bool = False   # keep the gathered K / V / index-K for backward


def _layout_tensors(shard: ContextParallelShard):
    return shard.cu_seqlens_q, shard.cu_seqlens_k, shard.fragment_indices


class _ContextParallelAttention(torch.autograd.Function):
    """(q, k, v, index_q, index_k of this rank's tokens) -> out, lse, topk, kl (a zero scalar
    whose gradient scales the indexer's KL gradients)."""

    @staticmethod
    def forward(ctx, q, k, v, index_q, index_k, shard: ContextParallelShard, group, options: ContextParallelOptions):
        o = options
        layout = _layout_tensors(shard)
        k_buf, v_buf, ik_buf = gather_kv(k, v, index_k, shard, group)
        topk, index_lse = _ops.select_blocks(index_q, ik_buf, *layout, o.init_blocks, o.local_blocks, o.index_scale,
                                             1.0, o.train_indexer, o.deterministic)
        # The op builds its plan and drops it: on CUDA a plan holds a workspace of 16 partial
        # outputs per query and head, which should not stay allocated until backward.
        out, lse = _ops.sparse_attention_forward(q, k_buf, v_buf, topk, *layout, o.softmax_scale, o.deterministic)
        saved = [q, k, v, index_q, index_k, out, lse, topk, index_lse]
        if o.save_gathered:
            saved += [k_buf, v_buf, ik_buf]
        ctx.save_for_backward(*saved)
        ctx.shard, ctx.group, ctx.options = shard, group, options
        ctx.mark_non_differentiable(lse, topk)
        kl = torch.zeros((), dtype=torch.float32, device=q.device)
        return out, lse, topk, kl

    @staticmethod
    def backward(ctx, dout, _dlse, _dtopk, dkl):
        o: ContextParallelOptions = ctx.options
        shard, group = ctx.shard, ctx.group
        layout = _layout_tensors(shard)
        saved = ctx.saved_tensors
        q, k, v, index_q, index_k, out, lse, topk, index_lse = saved[:9]
        if o.save_gathered:
            k_buf, v_buf, ik_buf = saved[9:]
        else:
            k_buf, v_buf, ik_buf = gather_kv(k, v, index_k, shard, group)
        m = k_buf.shape[0]
        widths = feature_widths(k, v, index_k)
        index = shard.kv_index_on(q.device)
        # This rank's float32 key gradients, laid out like the gathered buffer and side by side,
        # [world_size * capacity, dK | dV | d index-K]; rows of keys it did not read stay 0.
        full = torch.zeros((shard.world_size * shard.capacity, sum(widths)), dtype=torch.float32, device=q.device)
        full_dk, full_dv, full_dik = full.split(widths, dim=1)
        # Key gradients in float32: they are summed over ranks and rounded once, at the owner.
        dq, dk32, dv32 = _ops.sparse_attention_backward(dout, q, k_buf, v_buf, topk, out, lse, *layout,
                                                        o.softmax_scale, o.deterministic, torch.float32)
        full_dk.index_copy_(0, index, dk32.view(m, -1))  # kv_index has no repeats
        full_dv.index_copy_(0, index, dv32.view(m, -1))
        del dk32, dv32
        diq = None
        if o.train_indexer:
            # grad_scale 1 / (Hi * T) with the *global* token count: the single-device mean.
            grad_scale = 1.0 / (index_q.shape[1] * shard.total_tokens)
            diq32, dik32 = _ops.kl_backward(q, k_buf, lse, index_q, ik_buf, index_lse, topk, *layout,
                                            o.softmax_scale, o.index_scale, grad_scale, o.deterministic)
            full_dik.index_copy_(0, index, (dik32 * dkl).view(m, -1))
            diq = (diq32 * dkl).to(index_q.dtype)
            del dik32
        del k_buf, v_buf, ik_buf
        # Sum over ranks; each rank keeps the rows of the keys it owns.
        mine = reduce_scatter(full, shard.world_size, group)[:k.shape[0]]
        dk, dv, dik = (t.reshape(s.shape).to(s.dtype) for t, s in zip(mine.split(widths, dim=1), (k, v, index_k)))
        if not o.train_indexer:
            dik = None
        return dq, dk, dv, diq, dik, None, None, None


def _error(message: str):
    return _native.InvalidArgumentError(message)


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
    options = ContextParallelOptions(init_blocks=int(init_blocks), local_blocks=int(local_blocks),
                                     softmax_scale=float(softmax_scale), index_scale=float(index_scale),
                                     train_indexer=bool(train_indexer), deterministic=bool(deterministic),
                                     save_gathered=bool(save_gathered))
    out, lse, topk, kl = _ContextParallelAttention.apply(q, k, v, index_q, index_k, shard, group, options)
    if train_indexer:
        out = attach_loss(out, kl * indexer_loss_weight)
    result = (out,)
    if return_lse:
        result += (lse,)
    if return_topk:
        result += (topk,)
    return result[0] if len(result) == 1 else result
