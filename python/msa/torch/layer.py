"""MiniMaxM3SparseAttention: the sparse attention layer of MiniMax-M3 on msa's ops.

    x [B, S, hidden] --fused projection (no biases)--> q, k, v, index_q, index_k
    q, k, index_q, index_k: Gemma RMSNorm (fp32 math), then partial NeoX RoPE (first 64 of
        128 dims, theta 5e6, positions restarting in every document); v unchanged
    indexer: top-16 blocks of 128 keys per (token, KV group)          (not differentiable)
    sparse attention over the selected blocks, causal, GQA 16 heads per KV head
    output projection -> [B, S, hidden], zeros at padding positions

The index branch (index projections and norms) learns from the sparse KL between the main
attention (teacher) and the index scores (student): in training mode the layer attaches
``indexer_kl_loss`` to its output, so one ``loss.backward()`` trains both branches (weight
``indexer_loss_weight``; 0 disables it).
"""

import math

import torch
from torch import Tensor, nn

from .. import _native
from ..constants import HEAD_DIM
from . import _ops
from .functional import PackingIndex, attach_loss


class GemmaRMSNorm(nn.Module):
    """y = x * rsqrt(mean(x^2) + eps) * (1 + w) in float32; w starts at 0. Returns float32."""

    def __init__(self, dim: int = HEAD_DIM, eps: float = 1e-6, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim, device=device, dtype=dtype))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight.float())


def rope_cos_sin(positions: Tensor, rotary_dim: int = 64, theta: float = 5e6):
    """cos, sin [tokens, rotary_dim / 2] in float32: angle = fp32(pos * fp32(theta^(-2j/rotary_dim)))."""
    half = rotary_dim // 2
    j = torch.arange(half, dtype=torch.float64, device=positions.device)
    inv_freq = (theta ** (-2.0 * j / rotary_dim)).float()
    angle = positions.float()[:, None] * inv_freq[None, :]
    return torch.cos(angle), torch.sin(angle)


def apply_partial_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """NeoX rotation of the first 2 * cos.shape[-1] dims of x [tokens, heads, dim] (float32)."""
    half = cos.shape[-1]
    c, s = cos[:, None, :], sin[:, None, :]
    x1, x2, rest = x[..., :half], x[..., half:2 * half], x[..., 2 * half:]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s, rest), dim=-1)


class MiniMaxM3SparseAttention(nn.Module):
    """MiniMax-M3's sparse attention layer. Defaults are the full model's (hidden 6144, 64 query
    heads, 4 KV heads); small configurations such as hidden 256 with 16 / 1 heads work too
    (num_q_heads = 16 * num_kv_heads, head dims 128).

    forward(hidden_states [B, S, hidden], document_map=None | cu_seqlens=None, packing=None)
      document_map: [B, S] int32 (CPU preferred), 0 = padding, other values = document ids, each
        document one contiguous run; cu_seqlens: cumulative lengths over the row-major flattened
        B * S tokens, covering all of them (cu_seqlens[-1] = B * S; padding needs a
        document_map); packing: a PackingIndex reused across layers (then neither of the other two).
    Parameters may be float32 or bf16 (``layer.to(torch.bfloat16)``); hidden_states must have the
    parameters' dtype, as for nn.Linear. Attention always runs in bf16 with fp32 accumulation.
    """

    def __init__(self, hidden_size: int = 6144, num_q_heads: int = 64, num_kv_heads: int = 4,
                 head_dim: int = HEAD_DIM, index_head_dim: int = HEAD_DIM, rotary_dim: int = 64,
                 rope_theta: float = 5e6, rms_norm_eps: float = 1e-6,
                 init_blocks: int = 0, local_blocks: int = 1, indexer_loss_weight: float = 1.0,
                 deterministic: bool = False, device=None, dtype=None):
        super().__init__()
        self.hidden_size = hidden_size
        self.num_q_heads, self.num_kv_heads, self.num_index_heads = num_q_heads, num_kv_heads, num_kv_heads
        self.head_dim, self.index_head_dim = head_dim, index_head_dim
        self.rotary_dim, self.rope_theta = rotary_dim, rope_theta
        self.init_blocks, self.local_blocks = init_blocks, local_blocks
        self.indexer_loss_weight = indexer_loss_weight
        self.deterministic = deterministic
        self.split_sizes = [num_q_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim,
                            self.num_index_heads * index_head_dim, index_head_dim]
        factory = dict(device=device, dtype=dtype)
        # One fused projection emitting [q | k | v | index_q | index_k].
        self.qkv_proj = nn.Linear(hidden_size, sum(self.split_sizes), bias=False, **factory)
        self.o_proj = nn.Linear(num_q_heads * head_dim, hidden_size, bias=False, **factory)
        self.q_norm = GemmaRMSNorm(head_dim, rms_norm_eps, **factory)
        self.k_norm = GemmaRMSNorm(head_dim, rms_norm_eps, **factory)
        self.index_q_norm = GemmaRMSNorm(index_head_dim, rms_norm_eps, **factory)
        self.index_k_norm = GemmaRMSNorm(index_head_dim, rms_norm_eps, **factory)
        self.last_topk = None  # the selection of the last forward (int32 [Hi, tokens, 16]), for inspection

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, num_q_heads={self.num_q_heads}, num_kv_heads={self.num_kv_heads}, "
                f"rotary_dim={self.rotary_dim}, rope_theta={self.rope_theta:g}")

    def project(self, x: Tensor, positions: Tensor):
        """Packed tokens [T, hidden] -> q [T, Hq, 128], k, v [T, Hkv, 128], index_q [T, Hi, 128],
        index_k [T, 1, 128] in float32 after norm and RoPE (v: projection only)."""
        t = x.shape[0]
        q, k, v, iq, ik = self.qkv_proj(x).split(self.split_sizes, dim=-1)
        cos, sin = rope_cos_sin(positions, self.rotary_dim, self.rope_theta)
        q = apply_partial_rope(self.q_norm(q.view(t, self.num_q_heads, self.head_dim)), cos, sin)
        k = apply_partial_rope(self.k_norm(k.view(t, self.num_kv_heads, self.head_dim)), cos, sin)
        iq = apply_partial_rope(self.index_q_norm(iq.view(t, self.num_index_heads, self.index_head_dim)), cos, sin)
        ik = apply_partial_rope(self.index_k_norm(ik.view(t, 1, self.index_head_dim)), cos, sin)
        return q, k, v.reshape(t, self.num_kv_heads, self.head_dim), iq, ik

    def forward(self, hidden_states: Tensor, document_map=None, cu_seqlens=None, packing: PackingIndex = None):
        batch, seq, _ = hidden_states.shape
        if hidden_states.dtype != self.qkv_proj.weight.dtype:
            raise _native.InvalidArgumentError(
                f"hidden_states is {hidden_states.dtype} but the layer's parameters are {self.qkv_proj.weight.dtype}: "
                f"convert one of them (e.g. layer.to({hidden_states.dtype}) or hidden_states.to("
                f"{self.qkv_proj.weight.dtype}))")
        if packing is None:
            packing = PackingIndex(batch, seq, document_map=document_map, cu_seqlens=cu_seqlens,
                                   device=hidden_states.device)
        cu = packing.cu_seqlens
        x = packing.pack(hidden_states)
        q, k, v, iq, ik = self.project(x, packing.positions)
        bf16 = torch.bfloat16
        q, k, v, iq, ik = q.to(bf16), k.to(bf16), v.to(bf16), iq.to(bf16), ik.to(bf16)

        train_indexer = (self.training and torch.is_grad_enabled() and self.indexer_loss_weight > 0
                         and (iq.requires_grad or ik.requires_grad))
        topk, index_lse = _ops.select_blocks(iq.detach(), ik.detach(), cu, cu, None, self.init_blocks,
                                             self.local_blocks, 0.0, 1.0, train_indexer, self.deterministic)
        self.last_topk = topk
        out, lse = _ops.sparse_attention_forward(q, k, v, topk, cu, cu, None, 0.0, self.deterministic)
        if train_indexer:
            kl = _ops.indexer_kl_loss(q.detach(), k.detach(), lse.detach(), iq, ik, index_lse, topk, cu, cu, None,
                                      0.0, 0.0, 0.0, self.deterministic)
            out = attach_loss(out, kl * self.indexer_loss_weight)
        y = self.o_proj(out.reshape(packing.total, -1).to(self.o_proj.weight.dtype))
        return packing.unpack(y)

    def reset_parameters(self, std: float = None):
        """Normal init of the projections (std = 1/sqrt(fan_in) by default), norm weights 0."""
        for lin in (self.qkv_proj, self.o_proj):
            nn.init.normal_(lin.weight, std=std if std is not None else 1.0 / math.sqrt(lin.in_features))
        for norm in (self.q_norm, self.k_norm, self.index_q_norm, self.index_k_norm):
            nn.init.zeros_(norm.weight)
