"""A plain PyTorch reference of MiniMaxM3SparseAttention: float32 throughout, dense boolean
masks, no msa ops. Written for tests and for readers; memory grows as B * Hq * S^2.

It has the same parameters (names and shapes) as MiniMaxM3SparseAttention, so
``ref.load_state_dict(layer.state_dict())`` compares the two. After a forward,
``last_indexer_kl`` holds the indexer's KL(teacher || student) averaged over index heads and
real tokens (teacher detached): the loss whose gradient the layer's indexer receives.
"""

import torch
from torch import Tensor, nn

from ..constants import BLOCK_SIZE, HEAD_DIM, TOPK
from .layer import GemmaRMSNorm, apply_partial_rope, rope_cos_sin


def document_positions(doc: Tensor) -> Tensor:
    """Position of every token inside its document for a [B, S] document map (0 at padding)."""
    b, s = doc.shape
    idx = torch.arange(s, device=doc.device).expand(b, s)
    starts = torch.ones_like(doc, dtype=torch.bool)
    starts[:, 1:] = doc[:, 1:] != doc[:, :-1]
    start_idx = torch.where(starts, idx, torch.zeros_like(idx)).cummax(dim=1).values
    return torch.where(doc != 0, idx - start_idx, torch.zeros_like(idx))


def document_map_from_cu_seqlens(cu_seqlens, batch: int, seq: int, device=None) -> Tensor:
    """[B, S] document map (ids 1, 2, ...) for cu_seqlens over the flattened B * S tokens."""
    cu = [int(c) for c in (cu_seqlens.tolist() if isinstance(cu_seqlens, Tensor) else cu_seqlens)]
    flat = torch.zeros(batch * seq, dtype=torch.int32)
    for i in range(len(cu) - 1):
        flat[cu[i]:cu[i + 1]] = i + 1
    return flat.view(batch, seq).to(device)


def select_blocks_dense(block_scores: Tensor, pos: Tensor, valid: Tensor, topk: int = TOPK, block: int = BLOCK_SIZE,
                        init_blocks: int = 0, local_blocks: int = 1) -> Tensor:
    """Selected-block mask [..., S, NB] from block scores [..., S, NB] (max-pooled, -inf where not
    visible), query positions pos [B, S] and real-token mask valid [B, S].

    Forced blocks: init [0, min(I, nvis)) and local [nvis - L, nvis); the rest of the min(topk,
    nvis) slots go to the best other visible blocks by (score desc, id asc); NaN never wins."""
    nb = block_scores.shape[-1]
    ids = torch.arange(nb, device=block_scores.device)
    nvis = (pos // block + 1)[:, None, :, None]                              # [B, 1, S, 1]
    visible = ids < nvis
    forced = visible & ((ids < init_blocks) | (ids >= nvis - local_blocks))
    count = torch.clamp(nvis, max=topk)
    free = count - forced.sum(-1, keepdim=True)
    score = torch.nan_to_num(block_scores, nan=-torch.inf)
    rank_score = torch.where(visible & ~forced, score, torch.full_like(score, -torch.inf))
    # Stable sort of -score keeps lower ids first among equal scores.
    order = torch.sort(-rank_score, dim=-1, stable=True).indices
    rank = torch.empty_like(order).scatter_(-1, order, ids.expand_as(order))
    chosen = forced | (visible & ~forced & (rank < free) & (rank_score > -torch.inf))
    return chosen & valid[:, None, :, None]


class ReferenceSparseAttention(nn.Module):
    """Dense float32 reference of MiniMaxM3SparseAttention (same constructor and parameters)."""

    def __init__(self, hidden_size: int = 6144, num_q_heads: int = 64, num_kv_heads: int = 4,
                 head_dim: int = HEAD_DIM, index_head_dim: int = HEAD_DIM, rotary_dim: int = 64,
                 rope_theta: float = 5e6, rms_norm_eps: float = 1e-6,
                 init_blocks: int = 0, local_blocks: int = 1, topk: int = TOPK, block_size: int = BLOCK_SIZE,
                 device=None, dtype=None, **unused):
        super().__init__()
        self.num_q_heads, self.num_kv_heads, self.num_index_heads = num_q_heads, num_kv_heads, num_kv_heads
        self.head_dim, self.index_head_dim = head_dim, index_head_dim
        self.rotary_dim, self.rope_theta = rotary_dim, rope_theta
        self.init_blocks, self.local_blocks, self.topk, self.block_size = init_blocks, local_blocks, topk, block_size
        self.split_sizes = [num_q_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim,
                            num_kv_heads * index_head_dim, index_head_dim]
        factory = dict(device=device, dtype=dtype)
        self.qkv_proj = nn.Linear(hidden_size, sum(self.split_sizes), bias=False, **factory)
        self.o_proj = nn.Linear(num_q_heads * head_dim, hidden_size, bias=False, **factory)
        self.q_norm = GemmaRMSNorm(head_dim, rms_norm_eps, **factory)
        self.k_norm = GemmaRMSNorm(head_dim, rms_norm_eps, **factory)
        self.index_q_norm = GemmaRMSNorm(index_head_dim, rms_norm_eps, **factory)
        self.index_k_norm = GemmaRMSNorm(index_head_dim, rms_norm_eps, **factory)
        self.last_indexer_kl = None
        self.last_selection = None  # bool [B, Hi, S, NB]

    def _inputs(self, hidden_states: Tensor, document_map, cu_seqlens):
        """Projections, norms and RoPE, the visibility mask and the indexer's block scores."""
        b, s, _ = hidden_states.shape
        dev = hidden_states.device
        if document_map is None:
            document_map = document_map_from_cu_seqlens(cu_seqlens, b, s, dev)
        doc = torch.as_tensor(document_map, device=dev).to(torch.int64)
        valid = doc != 0
        pos = document_positions(doc)
        hq, hkv, hi, d = self.num_q_heads, self.num_kv_heads, self.num_index_heads, self.head_dim

        x = hidden_states.float()
        q, k, v, iq, ik = (x @ self.qkv_proj.weight.float().T).split(self.split_sizes, dim=-1)
        cos, sin = rope_cos_sin(pos.reshape(-1), self.rotary_dim, self.rope_theta)
        n = b * s

        def norm_rope(t, norm, heads, dim):
            return apply_partial_rope(norm(t.reshape(n, heads, dim)), cos, sin).view(b, s, heads, dim)

        q = norm_rope(q, self.q_norm, hq, d)
        k = norm_rope(k, self.k_norm, hkv, d)
        v = v.reshape(b, s, hkv, d)
        iq = norm_rope(iq, self.index_q_norm, hi, self.index_head_dim)
        ik = norm_rope(ik, self.index_k_norm, 1, self.index_head_dim)

        # Keys visible to each query: same document, causal (documents are contiguous runs).
        same_doc = (doc[:, :, None] == doc[:, None, :]) & valid[:, :, None]
        causal = torch.ones(s, s, dtype=torch.bool, device=dev).tril()
        visible = same_doc & causal                                          # [B, S(q), S(k)]

        # Indexer: token scores, max-pooled per document-local block of the key.
        scores = torch.einsum("bqgd,bkd->bgqk", iq, ik[:, :, 0]) * self.index_head_dim ** -0.5  # [B, Hi, S, S]
        key_block = pos // self.block_size                                   # [B, S]
        nb = (s + self.block_size - 1) // self.block_size + 1
        masked = torch.where(visible[:, None], scores, torch.full_like(scores, -torch.inf))
        block_scores = torch.full((b, hi, s, nb), -torch.inf, device=dev)
        block_scores = block_scores.scatter_reduce(-1, key_block[:, None, None, :].expand(b, hi, s, s), masked,
                                                   reduce="amax", include_self=True)
        return dict(valid=valid, pos=pos, q=q, k=k, v=v, visible=visible, scores=scores, key_block=key_block,
                    block_scores=block_scores)

    def select(self, hidden_states: Tensor, document_map=None, cu_seqlens=None) -> Tensor:
        """The reference indexer's selection alone: bool [B, Hi, S, NB]."""
        t = self._inputs(hidden_states, document_map, cu_seqlens)
        return select_blocks_dense(t["block_scores"], t["pos"], t["valid"], self.topk, self.block_size,
                                   self.init_blocks, self.local_blocks)

    def forward(self, hidden_states: Tensor, document_map=None, cu_seqlens=None, selection: Tensor = None) -> Tensor:
        """selection (optional): bool [B, Hi, S, NB] of selected blocks to use instead of the
        reference indexer (e.g. to compare attention under another implementation's choice)."""
        t = self._inputs(hidden_states, document_map, cu_seqlens)
        valid, visible, key_block = t["valid"], t["visible"], t["key_block"]
        b, s = valid.shape
        hq, hkv, hi, d = self.num_q_heads, self.num_kv_heads, self.num_index_heads, self.head_dim
        if selection is None:
            selection = select_blocks_dense(t["block_scores"], t["pos"], valid, self.topk, self.block_size,
                                            self.init_blocks, self.local_blocks)
        self.last_selection = selection
        # Token mask: key in a selected block of the query's group, and visible.
        key_selected = torch.gather(selection, -1, key_block[:, None, None, :].expand(b, hi, s, s))
        mask = key_selected & visible[:, None]                               # [B, Hkv, S, S]

        # Main attention (GQA: query head h uses KV head h // 16).
        group = hq // hkv
        mask_h = mask.repeat_interleave(group, dim=1)                        # [B, Hq, S, S]
        z = torch.einsum("bqhd,bkhd->bhqk", t["q"], t["k"].repeat_interleave(group, dim=2)) * d ** -0.5
        z = z.masked_fill(~mask_h, -torch.inf)
        p = torch.softmax(z, dim=-1).nan_to_num(0.0)                         # rows without keys -> 0
        out = torch.einsum("bhqk,bkhd->bqhd", p, t["v"].repeat_interleave(group, dim=2))
        y = out.reshape(b, s, hq * d) @ self.o_proj.weight.float().T
        y = torch.where(valid[..., None], y, torch.zeros_like(y))

        # Indexer KL(teacher || student) over the selected causal keys (teacher detached).
        teacher = p.detach().view(b, hkv, group, s, s).mean(dim=2)           # [B, Hi, S, S]
        log_student = torch.log_softmax(t["scores"].masked_fill(~mask, -torch.inf), dim=-1)
        terms = torch.where(mask & (teacher > 0), teacher * (torch.log(teacher.clamp_min(1e-30)) - log_student),
                            torch.zeros_like(teacher))
        self.last_indexer_kl = terms.sum() / (hi * valid.sum())
        return y.to(hidden_states.dtype)
