"""MiniMax-M3 in Hugging Face transformers with its sparse layers on msa.

    import msa.integrations.transformers as msa_hf
    msa_hf.register()
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="msa")

``register()`` adds the attention implementation ``"msa"`` to transformers' public attention
interfaces (``AttentionInterface`` for the attention function, ``AttentionMaskInterface`` for
its mask) and routes the ``minimax_m3_sparse`` layers' indexer (``MiniMaxM3VLIndexer``) to msa
while a model runs with ``"msa"``. In such a model:

* sparse layers: the indexer keeps transformers' projections, norms, RoPE and index-K cache,
  but skips its dense score matrix ``[B, H_idx, S_q, S_k]``; the attention function packs the
  batch into msa's layout (padding dropped, packed documents split), selects blocks with
  ``msa.torch.select_blocks`` and attends with ``msa.torch.sparse_attention`` (autograd through
  msa's backward);
* full-attention layers (and any other attention module of the model) run transformers' own
  SDPA attention with the mask SDPA would have had.

Training, ``generate`` with the dynamic and static caches, padded batches (left or right
padding) and packed sequences (``position_ids`` restarting at 0, no attention mask, no cache)
work. What the model's own code cannot express is refused with an ``msa.InvalidArgumentError``
naming the cause. docs/transformers.md lists the semantic differences to transformers' own
indexer (ties, padding, packing) and what is not supported.
"""

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import torch.nn.attention

from .. import _native
from ..constants import BLOCK_SIZE, GROUP_SIZE, HEAD_DIM, TOPK

ATTN_IMPLEMENTATION = "msa"
SPARSE_LAYER_TYPE = "minimax_m3_sparse"

# Options of register(); read by the attention function at call time.
_options = {"indexer_loss_weight": 0.0, "deterministic": False}
_original_indexer_forward = None


def _error(message: str) -> Exception:
    return _native.InvalidArgumentError(message)


# ---- the mask: keeps what SDPA's mask would be made from, builds it only for dense layers ----

class MsaAttentionMask:
    """What ``create_causal_mask`` hands every layer of a model running with ``"msa"``.

    It keeps the arguments of transformers' mask construction: full-attention layers get
    ``dense()`` (exactly the mask SDPA would have had, built on first use), sparse layers read
    the 2D padding mask (``padding``, ``[B, kv_length]`` bool, None without padding) and never
    materialise a ``[B, 1, S_q, S_k]`` tensor. One object serves all layers of one forward, so
    the packed layout is computed once per forward (``layout_cache``)."""

    def __init__(self, mask_kwargs: dict):
        self._kwargs = mask_kwargs
        self._dense = None
        self._dense_built = False
        self.layout_cache = {}
        from transformers.masking_utils import prepare_padding_mask

        mask = mask_kwargs.get("attention_mask")
        kv_length, kv_offset = mask_kwargs["kv_length"], mask_kwargs.get("kv_offset", 0)
        if mask is not None and kv_offset:
            raise _error(f"msa: a kv_offset ({kv_offset}) in the mask arguments (sliding-window caches) is not "
                         f"supported by the sparse layers")
        padding = prepare_padding_mask(mask, kv_length, kv_offset) if mask is not None else None
        if padding is not None:
            padding = padding[:, :kv_length].to(torch.bool)
        self.padding = padding

    def dense(self):
        if not self._dense_built:
            from transformers.masking_utils import sdpa_mask

            self._dense = sdpa_mask(**self._kwargs)
            self._dense_built = True
        return self._dense


def _msa_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None, attention_mask=None,
              allow_is_causal_skip=True, **kwargs):
    from transformers.masking_utils import causal_mask_function

    mask_kwargs = dict(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                       kv_offset=kv_offset, mask_function=mask_function or causal_mask_function,
                       attention_mask=attention_mask, allow_is_causal_skip=allow_is_causal_skip, **kwargs)
    for unused in ("config", "dtype"):
        mask_kwargs.pop(unused, None)
    return MsaAttentionMask(mask_kwargs)


# ---- the indexer: transformers' projections, norms, RoPE and cache; selection left to msa ----

@dataclass
class MsaIndexerState:
    """What the routed indexer returns in place of ``block_indices``: the index queries
    ``[B, H_idx, S_q, 128]``, the index keys of the whole history ``[B, 1, S_k, 128]`` (from the
    index-K cache layer when there is a cache), whether a cache was used and, for a static
    cache, its filled length (the rest of the buffer is unwritten)."""

    index_q: torch.Tensor
    index_k: torch.Tensor
    has_cache: bool
    filled: Optional[torch.Tensor] = None


def _indexer_forward(self, hidden_states, position_embeddings, past_key_values, position_ids):
    if self.config._attn_implementation != ATTN_IMPLEMENTATION:
        return _original_indexer_forward(self, hidden_states, position_embeddings, past_key_values, position_ids)
    from transformers.models.minimax_m3_vl import modeling_minimax_m3_vl as mm

    batch, q_len, _ = hidden_states.shape
    idx_q = self.q_proj(hidden_states).view(batch, q_len, -1, self.head_dim)
    idx_q = self.q_norm(idx_q).transpose(1, 2)
    idx_k = self.k_proj(hidden_states).view(batch, q_len, 1, self.head_dim)
    idx_k = self.k_norm(idx_k).transpose(1, 2)
    cos, sin = position_embeddings
    idx_q, idx_k = mm.apply_rotary_pos_emb(idx_q, idx_k, cos[..., :self.head_dim], sin[..., :self.head_dim])
    filled = None
    if past_key_values is not None:
        layer = past_key_values.layers[self.layer_idx]
        if not hasattr(layer, "update_index"):
            raise _error(f"msa: cache layer {self.layer_idx} ({type(layer).__name__}) has no index-K cache; build the "
                         f"cache with the model's config (e.g. DynamicCache(config=model.config)) so that sparse "
                         f"layers get their index-K cache layer")
        idx_k = layer.update_index(idx_k)
        filled = getattr(layer, "idx_cumulative_length", None)
    return MsaIndexerState(idx_q, idx_k, past_key_values is not None, filled)


# ---- layout: transformers' padded [B, S] batch -> msa's packed documents --------------------

@dataclass
class _Layout:
    cu_q: np.ndarray          # int32 [docs + 1]
    cu_k: np.ndarray
    q_rows: Optional[torch.Tensor]  # (batch, slot) of every packed query; None: all B * S_q in order
    q_slots: Optional[torch.Tensor]
    k_rows: Optional[torch.Tensor]
    k_slots: Optional[torch.Tensor]
    total_q: int


def _host(t):
    return None if t is None else t.detach().to("cpu")


def _build_layout(padding, position_ids, has_cache, filled, batch, q_len, k_len, device) -> _Layout:
    """Documents of the batch. Row b's real keys (padding mask, limited to the filled part of a
    static cache) must be one contiguous run; its queries are the last q_len filled slots and
    sit at the bottom right of their document, whose blocks start at its first real token.
    Without a padding mask and a cache, position_ids that do not step by 1 split a row into
    packed documents (transformers' rule for its SDPA mask); elsewhere they must step by 1."""
    length = k_len if filled is None else int(filled.reshape(-1)[0].item())
    if length < q_len or length > k_len:
        raise _error(f"msa: the cache holds {length} tokens after this step but the step has {q_len} queries and the "
                     f"key tensor {k_len} slots")
    past = length - q_len
    valid = None if padding is None else _host(padding)[:, :length].numpy()
    pos = None if position_ids is None else _host(position_ids).expand(batch, q_len).numpy().astype(np.int64)
    packing = padding is None and not has_cache and pos is not None
    cu_q, cu_k, qr, qs, kr, ks_ = [0], [0], [], [], [], []
    identity = True
    for b in range(batch):
        if valid is None:
            start, end = 0, length
        else:
            real = np.flatnonzero(valid[b])
            if len(real) == 0:
                identity = False
                continue
            start, end = int(real[0]), int(real[-1]) + 1
            if end - start != len(real):
                raise _error(f"msa: attention_mask row {b} has padding between real tokens (real slots {start}.."
                             f"{end - 1} hold {len(real)} tokens); msa takes one contiguous run of real tokens per "
                             f"row (left or right padding)")
            if start != 0 or end != length:
                identity = False
        bounds = [start, end]
        if packing:
            restarts = np.flatnonzero(np.diff(pos[b, start:end]) != 1) + start + 1
            bounds = [start] + restarts.tolist() + [end]
        for a, e in zip(bounds[:-1], bounds[1:]):
            q0 = max(a, past)
            if q0 >= e:
                continue
            if pos is not None:
                # RoPE is relative: a constant offset of a document's positions (e.g. slot positions
                # under left padding) changes nothing; a jump inside it is a document msa cannot see.
                got = pos[b, q0 - past:e - past]
                jumps = np.flatnonzero(np.diff(got) != 1)
                if len(jumps):
                    i = q0 + int(jumps[0]) + 1
                    raise _error(
                        f"msa: position_ids of row {b} jump from {got[jumps[0]]} to {got[jumps[0] + 1]} at slot {i} "
                        f"inside one sequence; packed sequences (position_ids restarting) need attention_mask=None "
                        f"and no cache (use_cache=False), as transformers' own masks separate them only then")
            cu_q.append(cu_q[-1] + e - q0)
            cu_k.append(cu_k[-1] + e - a)
            qr.append(np.full(e - q0, b))
            qs.append(np.arange(q0, e) - past)
            kr.append(np.full(e - a, b))
            ks_.append(np.arange(a, e))
    if cu_q[-1] == 0:
        raise _error("msa: the batch has no real query token (all-padding attention_mask)")
    cu_q, cu_k = np.asarray(cu_q, np.int32), np.asarray(cu_k, np.int32)
    if identity and length == k_len:  # every row whole: packing is a reshape (documents or not)
        return _Layout(cu_q, cu_k, None, None, None, None, int(cu_q[-1]))

    def idx(parts):
        return torch.from_numpy(np.concatenate(parts).astype(np.int64)).to(device)

    return _Layout(cu_q, cu_k, idx(qr), idx(qs), idx(kr), idx(ks_), int(cu_q[-1]))


def _pack(x, rows, slots):
    """[B, H, S, D] -> [tokens, H, D] (all B * S tokens when rows is None)."""
    xt = x.transpose(1, 2)
    return xt.reshape(-1, *xt.shape[2:]) if rows is None else xt[rows, slots]


# ---- the attention function ----------------------------------------------------------------

def _check_config(module):
    if getattr(module, "_msa_checked", False):
        return
    cfg = module.config
    hq, hkv, hi = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.index_n_heads
    problems = []
    if module.head_dim != HEAD_DIM:
        problems.append(f"head_dim = {HEAD_DIM} (got {module.head_dim})")
    if cfg.index_head_dim != HEAD_DIM:
        problems.append(f"index_head_dim = {HEAD_DIM} (got {cfg.index_head_dim})")
    if cfg.index_block_size != BLOCK_SIZE:
        problems.append(f"index_block_size = {BLOCK_SIZE} (got {cfg.index_block_size})")
    if cfg.index_topk_blocks != TOPK:
        problems.append(f"index_topk_blocks = {TOPK} (got {cfg.index_topk_blocks})")
    if hq != GROUP_SIZE * hkv:
        problems.append(f"num_attention_heads = {GROUP_SIZE} * num_key_value_heads (got {hq} and {hkv})")
    if hi != hkv:
        problems.append(f"index_n_heads = num_key_value_heads (got {hi} and {hkv})")
    if not 1 <= cfg.index_local_blocks <= TOPK:
        problems.append(f"index_local_blocks in [1, {TOPK}] (got {cfg.index_local_blocks})")
    if problems:
        raise _error(f"msa: layer {module.layer_idx} cannot run on msa: it needs " + "; ".join(problems))
    module._msa_checked = True


# Decode and speculative steps of full-attention layers: SDPA's cuDNN backend builds an
# execution plan for every new key length, i.e. at every decode step (tens of ms on an H200,
# docs/transformers.md); the other fused backends have no per-shape cost.
_SHORT_STEP = 64
_SHORT_STEP_BACKENDS = [torch.nn.attention.SDPBackend.FLASH_ATTENTION, torch.nn.attention.SDPBackend.EFFICIENT_ATTENTION,
                        torch.nn.attention.SDPBackend.MATH]


# Kept out of torch.compile (generate compiles the model's forward by itself with a static
# cache): the layout is host work, and tracing into it splits the graph at every sync.
@torch.compiler.disable
def msa_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                          block_indices=None, **kwargs):
    """The function registered as attention implementation ``"msa"``: sparse layers (those with
    an indexer) on msa, every other attention module on transformers' SDPA."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if getattr(module, "indexer", None) is None:
        mask = attention_mask.dense() if isinstance(attention_mask, MsaAttentionMask) else attention_mask
        if query.shape[2] > _SHORT_STEP or not query.is_cuda:
            return sdpa_attention_forward(module, query, key, value, mask, dropout=dropout, scaling=scaling, **kwargs)
        with torch.nn.attention.sdpa_kernel(_SHORT_STEP_BACKENDS):
            return sdpa_attention_forward(module, query, key, value, mask, dropout=dropout, scaling=scaling, **kwargs)

    _check_config(module)
    if not isinstance(block_indices, MsaIndexerState):
        raise _error("msa: the sparse layer's indexer did not run through msa; call "
                     "msa.integrations.transformers.register() before running the model")
    if attention_mask is not None and not isinstance(attention_mask, MsaAttentionMask):
        raise _error(f"msa: sparse layers take the 2D padding mask [batch, seq] (got a prepared mask of shape "
                     f"{list(getattr(attention_mask, 'shape', []))}); custom 4D masks cannot be expressed as msa "
                     f"documents")
    if dropout and module.training:
        raise _error(f"msa: attention dropout is not supported (config.attention_dropout = {dropout})")
    if kwargs.get("output_attentions"):
        raise _error("msa: output_attentions=True is not supported by the sparse layers (no dense weights exist)")

    import msa.torch as mt

    state = block_indices
    batch, hq, q_len, _ = query.shape
    k_len = key.shape[2]
    if state.index_k.shape[2] != k_len:
        raise _error(f"msa: index-K history has {state.index_k.shape[2]} tokens but the KV history {k_len}")
    padding = attention_mask.padding if attention_mask is not None else None
    position_ids = kwargs.get("position_ids")
    cache_key = (q_len, k_len, state.has_cache)
    cache = attention_mask.layout_cache if attention_mask is not None else {}
    layout = cache.get(cache_key)
    if layout is None:
        layout = _build_layout(padding, position_ids, state.has_cache, state.filled, batch, q_len, k_len,
                               query.device)
        cache[cache_key] = layout

    bf16 = torch.bfloat16
    q = _pack(query, layout.q_rows, layout.q_slots).to(bf16)
    k = _pack(key, layout.k_rows, layout.k_slots).to(bf16)
    v = _pack(value, layout.k_rows, layout.k_slots).to(bf16)
    iq = _pack(state.index_q, layout.q_rows, layout.q_slots).to(bf16)
    ik = _pack(state.index_k, layout.k_rows, layout.k_slots).to(bf16)
    cu_q, cu_k = layout.cu_q, layout.cu_k
    cfg = module.config
    weight = _options["indexer_loss_weight"]
    deterministic = _options["deterministic"]
    train_indexer = (module.training and torch.is_grad_enabled() and weight > 0
                     and (iq.requires_grad or ik.requires_grad))
    selected = mt.select_blocks(iq, ik, cu_q, cu_k, local_blocks=cfg.index_local_blocks, return_lse=train_indexer,
                                deterministic=deterministic)
    topk, index_lse = selected if train_indexer else (selected, None)
    out, lse = mt.sparse_attention(q, k, v, topk, cu_q, cu_k, softmax_scale=float(scaling or 0.0),
                                   deterministic=deterministic, return_lse=True)
    if train_indexer:
        kl = mt.indexer_kl_loss(q, k, lse, iq, ik, index_lse, topk, cu_q, cu_k, softmax_scale=float(scaling or 0.0),
                                deterministic=deterministic)
        out = mt.attach_loss(out, kl * weight)
    module.msa_last_topk = topk.detach() if _options.get("keep_topk") else None
    out = out.to(query.dtype)
    if layout.q_rows is None:
        return out.view(batch, q_len, hq, -1), None
    full = out.new_zeros((batch, q_len, hq, out.shape[-1]))
    return full.index_put((layout.q_rows, layout.q_slots), out), None


# ---- registration --------------------------------------------------------------------------

def register(*, indexer_loss_weight: float = 0.0, deterministic: bool = False, keep_topk: bool = False) -> str:
    """Registers the attention implementation ``"msa"`` with transformers and routes the
    MiniMax-M3 indexer to msa for models that use it. Idempotent; returns ``"msa"``.

    indexer_loss_weight: in training mode, attach msa's indexer KL loss (teacher: the main
      attention over the selected keys) with this weight, so that ``loss.backward()`` trains
      the index projections. 0 (default) matches transformers, whose indexer gets no gradient.
    deterministic: bitwise reproducible msa backward on CUDA (the CPU always is).
    keep_topk: keep each sparse layer's last selection as ``self_attn.msa_last_topk``
      (int32 ``[H_idx, tokens, 16]``, document-local block ids, local block last).
    """
    global _original_indexer_forward
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.models.minimax_m3_vl import modeling_minimax_m3_vl as mm

    _options.update(indexer_loss_weight=float(indexer_loss_weight), deterministic=bool(deterministic),
                    keep_topk=bool(keep_topk))
    AttentionInterface.register(ATTN_IMPLEMENTATION, msa_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _msa_mask)
    if mm.MiniMaxM3VLIndexer.forward is not _indexer_forward:
        _original_indexer_forward = mm.MiniMaxM3VLIndexer.forward
        mm.MiniMaxM3VLIndexer.forward = _indexer_forward
    return ATTN_IMPLEMENTATION


__all__ = ["register", "msa_attention_forward", "MsaAttentionMask", "MsaIndexerState", "ATTN_IMPLEMENTATION"]
