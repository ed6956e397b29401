"""User-facing PyTorch functions over the msa custom ops.

Packed layout: tokens of all documents along one axis (q [total_q, Hq, 128], k/v
[total_k, Hkv, 128], index_q [total_q, Hi, 128], index_k [total_k, 1, 128], bf16), described
by cu_seqlens (lists, NumPy arrays or CPU tensors of integers). Selection is not differentiable; attention is
(dq, dk, dv); the index projections learn through ``indexer_kl_loss``.
"""


import numpy as np
import torch
from torch import Tensor

from .. import _calls, _native
from ..functional import make_layout
from . import _ops


def _host_int32(x, name):
    """Integer layout metadata (list, NumPy array, CPU tensor) as an integer CPU tensor. A tensor
    is checked by device and dtype only, so torch.compile traces this without reading it; the
    op checks the values (int32 range) where it reads them on the host."""
    if x is None:
        return None
    if isinstance(x, Tensor):
        if x.device.type != "cpu":
            raise _native.InvalidArgumentError(
                f"{name} must be a CPU tensor or a list (layout metadata is read on the host), got device {x.device}")
        if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
            raise _native.InvalidArgumentError(
                f"{name} must hold integers (an integer dtype such as int32), got dtype {x.dtype}; msa does not "
                f"round or truncate metadata")
        return x.contiguous()
    return torch.tensor(_calls.int_list(x, name), dtype=torch.int32)


def _cu(cu_seqlens_q, cu_seqlens_k, fragment_indices):
    cu_q = _host_int32(cu_seqlens_q, "cu_seqlens_q")
    cu_k = cu_q if cu_seqlens_k is None else _host_int32(cu_seqlens_k, "cu_seqlens_k")
    return cu_q, cu_k, _host_int32(fragment_indices, "fragment_indices")


def select_blocks(index_q: Tensor, index_k: Tensor, cu_seqlens_q, cu_seqlens_k=None, *, fragment_indices=None,
                  init_blocks: int = 0, local_blocks: int = 1, index_scale: float = 0.0, lse_temperature: float = 1.0,
                  return_lse: bool = False, deterministic: bool = False):
    """Indexer: int32 top-k [Hi, total_q, 16] (local block last, -1 padding), optionally with the
    selected LSE f32 [Hi, total_q] that ``indexer_kl_loss`` needs. ``index_q`` / ``index_k``:
    bfloat16 or float8_e4m3fn (scale 1). Not differentiable."""
    cu_q, cu_k, frag = _cu(cu_seqlens_q, cu_seqlens_k, fragment_indices)
    topk, lse = _ops.select_blocks(index_q.detach(), index_k.detach(), cu_q, cu_k, frag, init_blocks, local_blocks,
                                   index_scale, lse_temperature, return_lse, deterministic)
    return (topk, lse) if return_lse else topk


def sparse_attention(q: Tensor, k: Tensor, v: Tensor, topk: Tensor, cu_seqlens_q, cu_seqlens_k=None, *,
                     fragment_indices=None, softmax_scale: float = 0.0, deterministic: bool = False,
                     return_lse: bool = False):
    """Block-sparse causal GQA attention over the blocks in ``topk`` (differentiable in q, k, v).
    Returns out [total_q, Hq, 128] (dtype of q), and the LSE f32 [total_q, Hq] with ``return_lse``
    (the LSE itself carries no gradient)."""
    cu_q, cu_k, frag = _cu(cu_seqlens_q, cu_seqlens_k, fragment_indices)
    out, lse = _ops.sparse_attention_forward(q, k, v, topk, cu_q, cu_k, frag, softmax_scale, deterministic)
    return (out, lse) if return_lse else out


def indexer_kl_loss(q: Tensor, k: Tensor, lse: Tensor, index_q: Tensor, index_k: Tensor, index_lse: Tensor,
                    topk: Tensor, cu_seqlens_q, cu_seqlens_k=None, *, fragment_indices=None,
                    softmax_scale: float = 0.0, index_scale: float = 0.0, grad_scale: float = 0.0,
                    deterministic: bool = False) -> Tensor:
    """The indexer's training signal. Returns a scalar whose *value is 0* and whose gradient
    w.r.t. index_q and index_k is that of KL(teacher || student) averaged over index heads and
    tokens (grad_scale 0 = 1 / (Hi * total_q)); teacher = mean over a group's 16 heads of the
    main attention probabilities (from q, k, lse, detached), student = softmax of the index
    scores, both over the selected causal keys. Add it (times a weight) to the loss."""
    cu_q, cu_k, frag = _cu(cu_seqlens_q, cu_seqlens_k, fragment_indices)
    return _ops.indexer_kl_loss(q.detach(), k.detach(), lse.detach(), index_q, index_k, index_lse.detach(),
                                topk, cu_q, cu_k, frag, softmax_scale, index_scale, grad_scale, deterministic)


def merge_states(out_partials: Tensor, lse_partials: Tensor, *, deterministic: bool = False):
    """Merges partial states out [S, rows, H, D], lse [S, rows, H] (natural log) into (out, lse)."""
    return _ops.merge_states(out_partials, lse_partials, deterministic)


class _AttachLoss(torch.autograd.Function):
    """Identity on `x` whose backward also sends gradient 1 to the scalar `loss`: a loss that is
    not part of the output's value still receives its gradient from ``loss.backward()``."""

    @staticmethod
    def forward(ctx, x, loss):
        ctx.loss_meta = (loss.dtype, loss.device)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad_x):
        dtype, device = ctx.loss_meta
        return grad_x, torch.ones((), dtype=dtype, device=device)


def attach_loss(x: Tensor, loss: Tensor) -> Tensor:
    """Returns x unchanged; its backward also back-propagates ``loss`` (a scalar) with weight 1."""
    return _AttachLoss.apply(x, loss)


# ---- padding <-> packed (differentiable, any device) ----------------------------------------

class PackingIndex:
    """Host-side description of a batch: the layout, the packed positions of the real tokens
    and their in-document positions. Build once per batch and reuse across layers."""

    def __init__(self, batch: int, seq: int, document_map=None, cu_seqlens=None, device=None):
        if (document_map is None) == (cu_seqlens is None):
            raise _native.InvalidArgumentError("give exactly one of document_map [batch, seq] or cu_seqlens")
        if document_map is not None:
            if tuple(document_map.shape) != (batch, seq):
                raise _native.InvalidArgumentError(
                    f"document_map must have shape [batch, seq] = [{batch}, {seq}], got {list(document_map.shape)}")
            self.layout = make_layout(document_map=document_map)
            rows = np.asarray(self.layout.packed_row_of_padded)
            gather = np.nonzero(rows >= 0)[0]
            self.all_real = len(gather) == batch * seq
        else:
            self.layout = make_layout(cu_seqlens)
            if self.layout.total_q != batch * seq:
                # Fewer would silently zero the rest; padding is what document_map describes.
                raise _native.InvalidArgumentError(
                    f"cu_seqlens must cover the input's batch * seq = {batch * seq} tokens (cu_seqlens[-1] = "
                    f"{batch * seq}), got cu_seqlens[-1] = {self.layout.total_q}; describe padding with a "
                    f"document_map (0 = padding)")
            gather = np.arange(self.layout.total_q)
            self.all_real = True
        self.batch, self.seq = batch, seq
        self.total = int(self.layout.total_q)  # a plain int: torch.compile reads it as a constant
        self.cu_seqlens = torch.from_numpy(np.asarray(self.layout.cu_seqlens_q, dtype=np.int32))
        self.gather = torch.from_numpy(gather.astype(np.int64)).to(device)
        self.positions = torch.from_numpy(np.asarray(self.layout.query_positions, dtype=np.int32)).to(device)

    def pack(self, x: Tensor) -> Tensor:
        """[batch, seq, ...] -> [tokens, ...]."""
        flat = x.reshape(self.batch * self.seq, *x.shape[2:])
        return flat if self.all_real else flat.index_select(0, self.gather)

    def unpack(self, y: Tensor) -> Tensor:
        """[tokens, ...] -> [batch, seq, ...] with zeros at padding."""
        if self.all_real:
            return y.reshape(self.batch, self.seq, *y.shape[1:])
        full = y.new_zeros((self.batch * self.seq, *y.shape[1:]))
        return full.index_copy(0, self.gather, y).reshape(self.batch, self.seq, *y.shape[1:])
