"""Inference operations (include/msa/inference.h) with output allocation: paged KV caches
(page = 128 tokens = one sparse block; bf16, FP8 E4M3 or NVFP4), Gemma RMSNorm + partial
RoPE, cache insertion, NVFP4 -> FP8, and plan / run of paged (chunked) prefill and decode.

Flow of one engine step: ``plan = plan_paged_prefill(...)`` or ``plan_decode(...)`` (host
metadata, once per step), then per layer ``rms_norm_rope`` on q / index_q, ``insert_kv``
(with ``plan.arrays()["slot_mapping"]``) and ``paged_forward``. Arrays are NumPy (CPU) or
PyTorch tensors; caches are written in place. Metadata (cu_seqlens_q, seq_lens,
page_table) are int32 host arrays.
"""

import numpy as np

from . import _native
from .functional import _empty, _native_arg, _run, _torch_module

KvFormat = _native.KvFormat
InferencePlan = _native.InferencePlan
document_positions = _native.document_positions


def _host_int32(x):
    torch = _torch_module(x)
    if torch is not None:
        x = x.detach().cpu().numpy()
    return np.ascontiguousarray(x, dtype=np.int32)


def _device_name(device):
    return str(device) if device is not None else "cpu"


def plan_paged_prefill(cu_seqlens_q, seq_lens, page_table, topology=None, *, device="cpu", num_kv_splits=0,
                       num_threads=0):
    """Plan of a prefill step: query rows of request b are [cu_seqlens_q[b], cu_seqlens_q[b+1]);
    seq_lens[b] counts the cached prefix plus this chunk; page_table [batch, max_pages] maps
    logical to physical pages. topology defaults to MiniMax-M3 (64 / 4 heads)."""
    topo = topology if topology is not None else _native.Topology()
    return _native.plan_paged_prefill(topo, _host_int32(cu_seqlens_q), _host_int32(seq_lens),
                                      _host_int32(page_table), _device_name(device), num_kv_splits, num_threads)


def plan_decode(seq_lens, page_table, q_len_per_req=1, topology=None, *, device="cpu", num_kv_splits=0,
                num_threads=0):
    """Plan of a decode step with q_len_per_req (1..16) query rows per request; seq_lens[b] = 0
    marks a padding request."""
    topo = topology if topology is not None else _native.Topology()
    return _native.plan_decode(topo, _host_int32(seq_lens), _host_int32(page_table), int(q_len_per_req),
                               _device_name(device), num_kv_splits, num_threads)


def rms_norm_rope(x, weight, positions, out=None, *, rotary_dim=64, eps=1e-6, rope_theta=5e6, stream=None):
    """Gemma RMSNorm + partial NeoX RoPE of x [tokens, H, 128] bf16; returns out (a new bf16
    array unless given; out=x works in place)."""
    if out is None:
        out = _empty(x, tuple(x.shape), "bfloat16")
    _native.rms_norm_rope(_native_arg(x), _native_arg(weight), _native_arg(positions), _native_arg(out), rotary_dim,
                          eps, rope_theta, **_run(False, 0, stream, x))
    return out


def _cache_args(k_cache, v_cache, format, k_block_scale, v_block_scale, k_scale, v_scale):
    return (_native_arg(k_cache), _native_arg(v_cache), format, _native_arg(k_block_scale),
            _native_arg(v_block_scale), _native_arg(k_scale), _native_arg(v_scale))


def insert_kv(k, v, slot_mapping, k_cache, v_cache, *, format=KvFormat.bf16, k_block_scale=None, v_block_scale=None,
              k_scale=None, v_scale=None, index_k=None, index_k_cache=None, k_norm=None, index_k_norm=None,
              positions=None, rotary_dim=64, eps=1e-6, rope_theta=5e6, stream=None):
    """Writes new tokens into the caches in place (slot = physical_page * 128 + offset, -1 skips)."""
    _native.insert_kv(_native_arg(k), _native_arg(v), _native_arg(slot_mapping),
                      *_cache_args(k_cache, v_cache, format, k_block_scale, v_block_scale, k_scale, v_scale),
                      _native_arg(index_k), _native_arg(index_k_cache), _native_arg(k_norm), _native_arg(index_k_norm),
                      _native_arg(positions), rotary_dim, eps, rope_theta, **_run(False, 0, stream, k))


def nvfp4_to_fp8(packed, block_scale, out, page_ids=None, *, stream=None):
    """NVFP4 cache pages -> FP8 E4M3 holding the same values (out written in place)."""
    _native.nvfp4_to_fp8(_native_arg(packed), _native_arg(block_scale), _native_arg(out), _native_arg(page_ids),
                         **_run(False, 0, stream, packed))
    return out


def paged_indexer(plan, index_q, index_k_cache, *, stream=None):
    """Top-k logical page ids int32 [Hi, total_q, 16] (local page last, -1 padding)."""
    topk = _empty(index_q, (plan.topology.num_index_heads, plan.total_q, plan.topology.topk), "int32")
    _native.paged_indexer(plan, _native_arg(index_q), _native_arg(index_k_cache), _native_arg(topk),
                          **_run(False, 0, stream, index_q))
    return topk


def paged_attention(plan, q, k_cache, v_cache, topk, *, format=KvFormat.bf16, k_block_scale=None, v_block_scale=None,
                    k_scale=None, v_scale=None, out_dtype="float32", stream=None):
    """(out [total_q, Hq, 128], lse f32 [total_q, Hq]) of the sparse attention over the caches."""
    out = _empty(q, tuple(q.shape), out_dtype)
    lse = _empty(q, tuple(q.shape[:2]), "float32")
    _native.paged_attention(plan, _native_arg(q),
                            *_cache_args(k_cache, v_cache, format, k_block_scale, v_block_scale, k_scale, v_scale),
                            _native_arg(topk), _native_arg(out), _native_arg(lse), **_run(False, 0, stream, q))
    return out, lse


def paged_forward(plan, q, index_q, k_cache, v_cache, index_k_cache, *, format=KvFormat.bf16, k_block_scale=None,
                  v_block_scale=None, k_scale=None, v_scale=None, out_dtype="float32", stream=None):
    """Indexer then attention: (topk, out, lse)."""
    topk = _empty(index_q, (plan.topology.num_index_heads, plan.total_q, plan.topology.topk), "int32")
    out = _empty(q, tuple(q.shape), out_dtype)
    lse = _empty(q, tuple(q.shape[:2]), "float32")
    _native.paged_forward(plan, _native_arg(index_q), _native_arg(index_k_cache), _native_arg(topk), _native_arg(q),
                          *_cache_args(k_cache, v_cache, format, k_block_scale, v_block_scale, k_scale, v_scale),
                          _native_arg(out), _native_arg(lse), **_run(False, 0, stream, q))
    return topk, out, lse
