"""PyTorch custom ops (torch.library) over the native module, with fake (meta) kernels and
autograd. Tensors reach the library through DLPack capsules: no copies, no stream
synchronisation; CUDA work is queued on PyTorch's current stream and no op waits for the
device. The attention ops build their plan on the device inside the call; the plan's memory
comes from PyTorch's caching allocator (installed by ``msa.torch``, see _allocator.py) and the
plan uploads its host metadata as kernel arguments, so the ops can be captured in CUDA graphs
(the plan is rebuilt from the new top-k on every replay). A layer step's forward, backward and
KL share one plan (_PlanCache: found by the top-k tensor it was built from); on CUDA such a
plan holds no scratch, each call takes its workspace from the allocator for its own duration.

Layout metadata (cu_seqlens, fragment_indices) are int32 CPU tensors: they are read on the
host, as the library plans on the host. Output shapes depend only on input shapes.
"""

import weakref
from typing import Optional, Tuple

import torch
from torch import Tensor

from .. import _calls, _native
from ..constants import GROUP_SIZE, TOPK


def layout_from_tensors(cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, fragment_indices: Optional[Tensor]):
    """A PackedLayout for integer host tensors, cached by value (layouts are immutable)."""
    return _calls.layout_from_cu_seqlens(cu_seqlens_q, cu_seqlens_k, fragment_indices, cached=True)


def _run(t: Tensor, deterministic: bool):
    return _calls.run_options(t, deterministic=deterministic)


class _PlanCache:
    """The plans of the selections the attention ops are working on, so that one layer step's
    forward, backward and KL build one plan instead of three. A plan is found by the top-k
    tensor it was built from: the same tensor object (held weakly: the entry goes with the
    tensor), unchanged since (its version counter), with the same layout, heads, options and
    stream. Any other call builds its own plan, as before. On CUDA the plans are built with
    ``workspace_per_call``: a kept plan costs its CSR and schedule only (its scratch would
    otherwise stay allocated from a layer's forward to its backward), and each op takes only
    its own call's scratch (``call_workspace_bytes``: at 16k tokens ~1.1 GB for the forward,
    ~0.9 GB for the backward, ~42 MB for the KL) for its own duration."""

    def __init__(self):
        self._plans = {}  # id(topk) -> (weakref to topk, key, plan)
        self.builds = 0   # plans built (the tests count them)

    def plan(self, topo, layout, topk: Tensor, run, hkv: int):
        stream = torch.cuda.current_stream(topk.device).cuda_stream if topk.is_cuda else 0
        key = (topk._version, layout, hkv, topk.shape, run.deterministic, stream)  # layouts compare by identity
        entry = self._plans.get(id(topk))
        if entry is not None and entry[0]() is topk and entry[1] == key:
            return entry[2]
        plan = _calls.build_plan(topo, layout, topk.contiguous(), run, workspace_per_call=topk.is_cuda)
        self.builds += 1
        plans, tid = self._plans, id(topk)

        def forget(ref):  # the top-k tensor is gone: so is its plan
            if tid in plans and plans[tid][0] is ref:
                del plans[tid]

        plans[tid] = (weakref.ref(topk, forget), key, plan)
        return plan


_plans = _PlanCache()


def _workspace(topo, layout, like: Tensor, call: str, deterministic: bool):
    """The scratch of one ``call`` on a plan of the cache (CUDA): only that call's regions
    (call_workspace_bytes), from PyTorch's allocator, for the call's duration; None on the CPU."""
    if not like.is_cuda:
        return None
    nbytes = _calls.call_workspace_bytes(topo, layout, call, deterministic, like.device)
    return torch.empty(nbytes, dtype=torch.uint8, device=like.device)


def _shape(t: Tensor, name: str, rank: int):
    if t.dim() != rank:
        raise _native.InvalidArgumentError(f"{name} must have {rank} dimensions, got shape {list(t.shape)}")
    return t.shape


# ---- indexer -------------------------------------------------------------------------------

@torch.library.custom_op("msa::select_blocks", mutates_args=())
def select_blocks(index_q: Tensor, index_k: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                  fragment_indices: Optional[Tensor], init_blocks: int, local_blocks: int, index_scale: float,
                  lse_temperature: float, with_lse: bool, deterministic: bool) -> Tuple[Tensor, Tensor]:
    """topk int32 [Hi, total_q, 16] and, with with_lse, selected_lse f32 [Hi, total_q] (else [0])."""
    total_q, hi, _ = _shape(index_q, "index_q", 3)
    layout = layout_from_tensors(cu_seqlens_q, cu_seqlens_k, fragment_indices)
    topo = _calls.topology(GROUP_SIZE * hi, hi, init_blocks=init_blocks, local_blocks=local_blocks,
                           index_scale=index_scale)
    topk = index_q.new_empty((hi, total_q, topo.topk), dtype=torch.int32)
    lse = index_q.new_empty((hi, total_q) if with_lse else (0,), dtype=torch.float32)
    _calls.select_blocks(topo, layout, index_q.contiguous(), index_k.contiguous(), topk, lse if with_lse else None,
                         lse_temperature, _run(index_q, deterministic))
    return topk, lse


@select_blocks.register_fake
def _(index_q, index_k, cu_seqlens_q, cu_seqlens_k, fragment_indices, init_blocks, local_blocks, index_scale,
      lse_temperature, with_lse, deterministic):
    total_q, hi, _ = index_q.shape
    topk = index_q.new_empty((hi, total_q, TOPK), dtype=torch.int32)
    lse = index_q.new_empty((hi, total_q) if with_lse else (0,), dtype=torch.float32)
    return topk, lse


# ---- sparse attention ---------------------------------------------------------------------

@torch.library.custom_op("msa::sparse_attention_forward", mutates_args=())
def sparse_attention_forward(q: Tensor, k: Tensor, v: Tensor, topk: Tensor, cu_seqlens_q: Tensor,
                             cu_seqlens_k: Tensor, fragment_indices: Optional[Tensor], softmax_scale: float,
                             deterministic: bool) -> Tuple[Tensor, Tensor]:
    """out [total_q, Hq, 128] (dtype of q) and lse f32 [total_q, Hq] (natural log)."""
    total_q, hq, _ = _shape(q, "q", 3)
    hkv = _shape(k, "k", 3)[1]
    layout = layout_from_tensors(cu_seqlens_q, cu_seqlens_k, fragment_indices)
    topo = _calls.topology(hq, hkv, softmax_scale=softmax_scale)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = q.new_empty((total_q, hq), dtype=torch.float32)
    run = _run(q, deterministic)
    plan = _plans.plan(topo, layout, topk, run, hkv)
    # topk None: the plan's own copy of the selection it was built from (nothing to compare).
    _calls.sparse_attention_forward(topo, layout, plan, q.contiguous(), k.contiguous(), v.contiguous(), None, out, lse,
                                    run, _workspace(topo, layout, q, "forward", deterministic))
    return out, lse


@sparse_attention_forward.register_fake
def _(q, k, v, topk, cu_seqlens_q, cu_seqlens_k, fragment_indices, softmax_scale, deterministic):
    return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty(q.shape[:2], dtype=torch.float32)


@torch.library.custom_op("msa::sparse_attention_backward", mutates_args=())
def sparse_attention_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, topk: Tensor, out: Tensor, lse: Tensor,
                              cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, fragment_indices: Optional[Tensor],
                              softmax_scale: float, deterministic: bool,
                              kv_grad_dtype: Optional[torch.dtype] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv (dtypes of q, k, v; dk and dv in ``kv_grad_dtype`` when given, float32 or
    bfloat16); dk/dv summed over the 16 query heads of a group."""
    hq, hkv = _shape(q, "q", 3)[1], _shape(k, "k", 3)[1]
    layout = layout_from_tensors(cu_seqlens_q, cu_seqlens_k, fragment_indices)
    topo = _calls.topology(hq, hkv, softmax_scale=softmax_scale)
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=kv_grad_dtype or k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=kv_grad_dtype or v.dtype, device=v.device)
    run = _run(q, deterministic)
    plan = _plans.plan(topo, layout, topk, run, hkv)
    _calls.sparse_attention_backward(topo, layout, plan, q.contiguous(), k.contiguous(), v.contiguous(), None,
                                     out.contiguous(), lse.contiguous(), dout.contiguous(), dq, dk, dv, run,
                                     _workspace(topo, layout, q, "backward", deterministic))
    return dq, dk, dv


@sparse_attention_backward.register_fake
def _(dout, q, k, v, topk, out, lse, cu_seqlens_q, cu_seqlens_k, fragment_indices, softmax_scale, deterministic,
      kv_grad_dtype=None):
    contiguous = torch.contiguous_format
    return (torch.empty_like(q, memory_format=contiguous),
            torch.empty_like(k, memory_format=contiguous, dtype=kv_grad_dtype or k.dtype),
            torch.empty_like(v, memory_format=contiguous, dtype=kv_grad_dtype or v.dtype))


def _attention_setup(ctx, inputs, output):
    q, k, v, topk, cu_q, cu_k, frag, softmax_scale, deterministic = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, topk, out, lse, cu_q, cu_k, frag)
    ctx.softmax_scale = softmax_scale
    ctx.deterministic = deterministic
    ctx.mark_non_differentiable(lse)


def _attention_backward(ctx, grad_out, grad_lse):
    q, k, v, topk, out, lse, cu_q, cu_k, frag = ctx.saved_tensors
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    dq, dk, dv = sparse_attention_backward(grad_out, q, k, v, topk, out, lse, cu_q, cu_k, frag, ctx.softmax_scale,
                                           ctx.deterministic)
    return dq, dk, dv, None, None, None, None, None, None


sparse_attention_forward.register_autograd(_attention_backward, setup_context=_attention_setup)


# ---- indexer training (KL) ----------------------------------------------------------------

@torch.library.custom_op("msa::kl_backward", mutates_args=())
def kl_backward(q: Tensor, k: Tensor, lse: Tensor, index_q: Tensor, index_k: Tensor, index_lse: Tensor, topk: Tensor,
                cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, fragment_indices: Optional[Tensor], softmax_scale: float,
                index_scale: float, grad_scale: float, deterministic: bool) -> Tuple[Tensor, Tensor]:
    """f32 gradients of the indexer's KL(teacher || student) w.r.t. index_q and index_k."""
    hq, hkv = _shape(q, "q", 3)[1], _shape(k, "k", 3)[1]
    layout = layout_from_tensors(cu_seqlens_q, cu_seqlens_k, fragment_indices)
    topo = _calls.topology(hq, hkv, softmax_scale=softmax_scale, index_scale=index_scale)
    diq = index_q.new_empty(index_q.shape, dtype=torch.float32)
    dik = index_k.new_empty(index_k.shape, dtype=torch.float32)
    run = _run(q, deterministic)
    plan = _plans.plan(topo, layout, topk, run, hkv)
    _calls.kl_backward(topo, layout, plan, q.contiguous(), k.contiguous(), lse.contiguous(), index_q.contiguous(),
                       index_k.contiguous(), index_lse.contiguous(), None, diq, dik, grad_scale, run,
                       _workspace(topo, layout, q, "kl_backward", deterministic))
    return diq, dik


@kl_backward.register_fake
def _(q, k, lse, index_q, index_k, index_lse, topk, cu_seqlens_q, cu_seqlens_k, fragment_indices, softmax_scale,
      index_scale, grad_scale, deterministic):
    return (index_q.new_empty(index_q.shape, dtype=torch.float32),
            index_k.new_empty(index_k.shape, dtype=torch.float32))


@torch.library.custom_op("msa::indexer_kl_loss", mutates_args=())
def indexer_kl_loss(q: Tensor, k: Tensor, lse: Tensor, index_q: Tensor, index_k: Tensor, index_lse: Tensor,
                    topk: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, fragment_indices: Optional[Tensor],
                    softmax_scale: float, index_scale: float, grad_scale: float, deterministic: bool) -> Tensor:
    """A scalar whose value is 0 and whose gradient w.r.t. index_q / index_k is the KL gradient
    (kl_backward); q, k and lse (the teacher) get no gradient from it."""
    return torch.zeros((), dtype=torch.float32, device=index_q.device)


@indexer_kl_loss.register_fake
def _(q, k, lse, index_q, index_k, index_lse, topk, cu_seqlens_q, cu_seqlens_k, fragment_indices, softmax_scale,
      index_scale, grad_scale, deterministic):
    return index_q.new_empty((), dtype=torch.float32)


def _kl_setup(ctx, inputs, output):
    (q, k, lse, index_q, index_k, index_lse, topk, cu_q, cu_k, frag, softmax_scale, index_scale, grad_scale,
     deterministic) = inputs
    ctx.save_for_backward(q, k, lse, index_q, index_k, index_lse, topk, cu_q, cu_k, frag)
    ctx.args = (softmax_scale, index_scale, grad_scale, deterministic)


def _kl_loss_backward(ctx, grad):
    q, k, lse, index_q, index_k, index_lse, topk, cu_q, cu_k, frag = ctx.saved_tensors
    diq, dik = kl_backward(q, k, lse, index_q, index_k, index_lse, topk, cu_q, cu_k, frag, *ctx.args)
    return (None, None, None, (diq * grad).to(index_q.dtype), (dik * grad).to(index_k.dtype), None, None, None, None,
            None, None, None, None, None)


indexer_kl_loss.register_autograd(_kl_loss_backward, setup_context=_kl_setup)


# ---- merge of partial states ----------------------------------------------------------------

@torch.library.custom_op("msa::merge_states", mutates_args=())
def merge_states(out_partials: Tensor, lse_partials: Tensor, deterministic: bool) -> Tuple[Tensor, Tensor]:
    """out [rows, H, D] (dtype of out_partials) and lse f32 [rows, H] merged over S partials."""
    _shape(out_partials, "out_partials", 4)
    out = out_partials.new_empty(out_partials.shape[1:])
    lse = out_partials.new_empty(out_partials.shape[1:3], dtype=torch.float32)
    _calls.merge_states(out_partials.contiguous(), lse_partials.contiguous(), out, lse,
                        _run(out_partials, deterministic))
    return out, lse


@merge_states.register_fake
def _(out_partials, lse_partials, deterministic):
    return (out_partials.new_empty(out_partials.shape[1:]),
            out_partials.new_empty(out_partials.shape[1:3], dtype=torch.float32))
