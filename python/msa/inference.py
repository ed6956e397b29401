"""Inference operations (include/msa/inference.h) with output allocation: paged KV caches
(page = 128 tokens = one sparse block; bf16, FP8 E4M3 or NVFP4), Gemma RMSNorm + partial
RoPE, cache insertion, NVFP4 -> FP8, and plan / run of paged (chunked) prefill and decode.

Flow of one engine step: ``plan = plan_paged_prefill(...)`` or ``plan_decode(...)`` (host
metadata, once per step), then per layer ``rms_norm_rope`` on q / index_q, ``insert_kv``
(with ``plan.arrays()["slot_mapping"]``) and ``paged_forward``. Arrays are NumPy (CPU) or
PyTorch tensors; caches are written in place. Metadata (cu_seqlens_q, seq_lens,
page_table) are integer host arrays (int32 range; floats are refused).
"""

from . import _calls
from ._calls import PagedCache as _Cache

KvFormat = _calls.KvFormat
InferencePlan = _calls.InferencePlan
document_positions = _calls.document_positions


def _topology(topology):
    return topology if topology is not None else _calls.topology(64, 4)


def plan_paged_prefill(cu_seqlens_q, seq_lens, page_table, topology=None, *, device="cpu", num_kv_splits=0,
                       num_threads=0, stream=None):
    """Plan of a prefill step: query rows of request b are [cu_seqlens_q[b], cu_seqlens_q[b+1]);
    seq_lens[b] counts the cached prefix plus this chunk; page_table [batch, max_pages] maps
    logical to physical pages. topology defaults to MiniMax-M3 (64 / 4 heads). On a GPU the
    plan's uploads are queued on `stream` (default: PyTorch's current stream) without waiting
    for the device; runs on other streams wait for them on the device, and the plan's memory
    goes back on `stream` once the plan is dropped, after its runs on other streams."""
    return _calls.plan_paged_prefill(_topology(topology), cu_seqlens_q, seq_lens, page_table, device=device,
                                     num_kv_splits=num_kv_splits, num_threads=num_threads, stream=stream)


def plan_decode(seq_lens, page_table, q_len_per_req=1, topology=None, *, device="cpu", num_kv_splits=0,
                num_threads=0, stream=None):
    """Plan of a decode step with q_len_per_req (1..16) query rows per request; seq_lens[b] = 0
    marks a padding request. `stream` as for plan_paged_prefill."""
    return _calls.plan_decode(_topology(topology), seq_lens, page_table, q_len_per_req, device=device,
                              num_kv_splits=num_kv_splits, num_threads=num_threads, stream=stream)


def update_decode_plan(plan, seq_lens, page_table, *, stream=None):
    """Rewrites a decode plan for the next step: new seq_lens and page_table (same batch, the
    plan's q_len_per_req and page_table width, no context longer than the plan's max_seqlen_k),
    so that CUDA graphs captured with the plan's runs replay on the new step. The copies are
    queued on `stream` (default: PyTorch's current stream for a CUDA plan, else 0)."""
    _calls.update_decode_plan(plan, seq_lens, page_table, plan.q_len_per_req, stream=stream)


def rms_norm_rope(x, weight, positions, out=None, *, rotary_dim=64, eps=1e-6, rope_theta=5e6, stream=None):
    """Gemma RMSNorm + partial NeoX RoPE of x [tokens, H, 128] bf16; returns out (a new bf16
    array unless given; out=x works in place)."""
    if out is None:
        out = _calls.empty(x, tuple(x.shape), "bfloat16")
    _calls.rms_norm_rope(x, weight, positions, out, rotary_dim, eps, rope_theta, _calls.run_options(x, stream=stream))
    return out


def insert_kv(k, v, slot_mapping, k_cache, v_cache, *, format=KvFormat.bf16, k_block_scale=None, v_block_scale=None,
              k_scale=None, v_scale=None, index_k=None, index_k_cache=None, k_norm=None, index_k_norm=None,
              positions=None, rotary_dim=64, eps=1e-6, rope_theta=5e6, stream=None):
    """Writes new tokens into the caches in place (slot = physical_page * 128 + offset, -1 skips)."""
    cache = _Cache(k_cache, v_cache, format, k_block_scale, v_block_scale, k_scale, v_scale)
    _calls.insert_kv(k, v, slot_mapping, cache, index_k, index_k_cache, k_norm, index_k_norm, positions, rotary_dim,
                     eps, rope_theta, _calls.run_options(k, stream=stream))


def nvfp4_to_fp8(packed, block_scale, out, page_ids=None, *, stream=None):
    """NVFP4 cache pages -> FP8 E4M3 holding the same values (out written in place)."""
    _calls.nvfp4_to_fp8(packed, block_scale, out, page_ids, _calls.run_options(packed, stream=stream))
    return out


def _topk_for(plan, index_q):
    return _calls.empty(index_q, (plan.topology.num_index_heads, plan.total_q, plan.topology.topk), "int32")


def paged_indexer(plan, index_q, index_k_cache, *, stream=None):
    """Top-k logical page ids int32 [Hi, total_q, 16] (local page last, -1 padding)."""
    topk = _topk_for(plan, index_q)
    _calls.paged_indexer(plan, index_q, index_k_cache, topk, _calls.run_options(index_q, stream=stream))
    return topk


def paged_attention(plan, q, k_cache, v_cache, topk, *, format=KvFormat.bf16, k_block_scale=None, v_block_scale=None,
                    k_scale=None, v_scale=None, out_dtype="float32", stream=None):
    """(out [total_q, Hq, 128], lse f32 [total_q, Hq]) of the sparse attention over the caches."""
    out = _calls.empty(q, tuple(q.shape), out_dtype)
    lse = _calls.empty(q, tuple(q.shape[:2]), "float32")
    cache = _Cache(k_cache, v_cache, format, k_block_scale, v_block_scale, k_scale, v_scale)
    _calls.paged_attention(plan, q, cache, topk, out, lse, _calls.run_options(q, stream=stream))
    return out, lse


def paged_forward(plan, q, index_q, k_cache, v_cache, index_k_cache, *, format=KvFormat.bf16, k_block_scale=None,
                  v_block_scale=None, k_scale=None, v_scale=None, out_dtype="float32", stream=None):
    """Indexer then attention: (topk, out, lse)."""
    topk = _topk_for(plan, index_q)
    out = _calls.empty(q, tuple(q.shape), out_dtype)
    lse = _calls.empty(q, tuple(q.shape[:2]), "float32")
    cache = _Cache(k_cache, v_cache, format, k_block_scale, v_block_scale, k_scale, v_scale)
    _calls.paged_forward(plan, index_q, index_k_cache, topk, q, cache, out, lse, _calls.run_options(q, stream=stream))
    return topk, out, lse
