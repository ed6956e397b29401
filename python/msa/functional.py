"""Functional operations that allocate their outputs.

Inputs are NumPy arrays (CPU) or PyTorch tensors (CPU or CUDA); outputs are of the same
kind, on the same device. Shapes follow the library: q [total_q, Hq, 128], k/v
[total_k, Hkv, 128], index_q [total_q, Hi, 128], index_k [total_k, 1, 128] (bf16), top-k
int32 [Hi, total_q, 16], LSE float32 [total_q, Hq] (natural log). When ``topology`` is
None it is read from the shapes (Hkv = Hi = k.shape[1], Hq = q.shape[1]). When ``plan`` is
None it is built from ``topk`` (build it once with ``build_plan`` to reuse it).

Every function takes ``deterministic`` (bitwise reproducible accumulation; the CPU always
is), ``num_threads`` (CPU threads, 0 = OpenMP's default) and ``stream`` (a cudaStream_t as
int; None = PyTorch's current stream for CUDA tensors, else the default stream).
"""

import numpy as np

from . import _native
from . import bf16 as _bf16

_FLOAT_OUT = ("float32", "bfloat16")


# ---- arrays of either kind -------------------------------------------------------------

def _torch_module(x):
    mod = type(x).__module__
    if mod.startswith("torch"):
        import torch

        if isinstance(x, torch.Tensor):
            return torch
    return None


def _native_arg(x):
    """What the native module receives for `x`: a DLPack-capable object, no copy."""
    if x is None:
        return None
    torch = _torch_module(x)
    if torch is not None:
        # A capsule: no stream synchronisation, works for tensors that require grad.
        return torch.utils.dlpack.to_dlpack(x.detach())
    if isinstance(x, np.ndarray) and _bf16.is_bfloat16(x.dtype):
        return x.view(np.uint16)
    return x


def _empty(like, shape, dtype):
    """An uninitialised array of `dtype` ("float32", "bfloat16", "int32") beside `like`."""
    torch = _torch_module(like)
    if torch is not None:
        tdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int32": torch.int32}[dtype]
        return torch.empty(shape, dtype=tdtype, device=like.device)
    if dtype == "bfloat16":
        if _bf16.is_bfloat16(like.dtype):
            return np.empty(shape, dtype=_bf16.bfloat16)
        return np.empty(shape, dtype=np.uint16)
    return np.empty(shape, dtype=dtype)


def _stream(x, stream):
    if stream is not None:
        return int(stream)
    torch = _torch_module(x)
    if torch is not None and x.device.type == "cuda":
        return torch.cuda.current_stream(x.device).cuda_stream
    return 0


def _check_out_dtype(dtype, name):
    if dtype not in _FLOAT_OUT:
        raise _native.InvalidArgumentError(f"{name} must be one of {_FLOAT_OUT}, got {dtype!r}")


def _topology(topology, num_q_heads, num_kv_heads):
    if topology is not None:
        return topology
    return _native.Topology(num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, num_index_heads=num_kv_heads)


def _dim(x, axis, name, rank):
    if len(x.shape) != rank:
        raise _native.InvalidArgumentError(f"{name} must have {rank} dimensions, got shape {list(x.shape)}")
    return int(x.shape[axis])


def _run(deterministic, num_threads, stream, like):
    return dict(deterministic=bool(deterministic), num_threads=int(num_threads), stream=_stream(like, stream))


# ---- layouts -----------------------------------------------------------------------------

def _int_list(x, name):
    if x is None:
        return []
    if hasattr(x, "tolist"):
        x = x.tolist()
    try:
        return [int(v) for v in x]
    except TypeError as e:
        raise _native.InvalidArgumentError(f"{name} must be a 1-D sequence of integers") from e


def make_layout(cu_seqlens_q=None, cu_seqlens_k=None, fragment_indices=None, *, document_map=None):
    """A PackedLayout from cumulative lengths (``cu_seqlens_k`` defaults to ``cu_seqlens_q``)
    or from a [batch, seq] integer document map (0 = padding). Lists, NumPy arrays and CPU
    tensors are accepted; a CUDA tensor document map is reduced on its device (on PyTorch's
    current stream) and read back with one wait, so not during CUDA-graph capture."""
    if document_map is not None:
        if cu_seqlens_q is not None:
            raise _native.InvalidArgumentError("give either cu_seqlens or document_map, not both")
        torch = _torch_module(document_map)
        if torch is not None:
            document_map = document_map.detach()
            if document_map.device.type == "cuda":
                document_map = document_map.to(torch.int32)
                return _native.PackedLayout.from_document_map(_native_arg(document_map),
                                                              stream=_stream(document_map, None))
            document_map = document_map.to(torch.int32).numpy()
        return _native.PackedLayout.from_document_map(np.ascontiguousarray(document_map, dtype=np.int32))
    if cu_seqlens_q is None:
        raise _native.InvalidArgumentError("make_layout needs cu_seqlens_q or document_map")
    cu_q = _int_list(cu_seqlens_q, "cu_seqlens_q")
    cu_k = cu_q if cu_seqlens_k is None else _int_list(cu_seqlens_k, "cu_seqlens_k")
    return _native.PackedLayout.from_cu_seqlens(cu_q, cu_k, _int_list(fragment_indices, "fragment_indices"))


# ---- operations --------------------------------------------------------------------------

def select_blocks(index_q, index_k, layout, topology=None, *, return_lse=False, lse_temperature=1.0,
                  deterministic=False, num_threads=0, stream=None):
    """Indexer: the blocks each (query, index head) attends, int32 [Hi, total_q, 16], valid ids
    first with the local block last, -1 padding. With ``return_lse`` also the natural-log LSE
    of the index scores over the selected causal keys, float32 [Hi, total_q]."""
    hi = _dim(index_q, 1, "index_q", 3)
    topo = _topology(topology, 16 * hi, hi)
    total_q = int(index_q.shape[0])
    topk = _empty(index_q, (topo.num_index_heads, total_q, topo.topk), "int32")
    lse = _empty(index_q, (topo.num_index_heads, total_q), "float32") if return_lse else None
    _native.select_blocks(topo, layout, _native_arg(index_q), _native_arg(index_k), _native_arg(topk),
                          _native_arg(lse), float(lse_temperature), **_run(deterministic, num_threads, stream, index_q))
    return (topk, lse) if return_lse else topk


def build_plan(topk, layout, topology=None, *, q_per_cta=8, workspace=None, deterministic=False, num_threads=0,
               stream=None):
    """Validates ``topk`` against the layout and builds the reusable k2q plan (a Plan).

    ``workspace`` (CUDA plans only): a uint8 CUDA array of at least ``plan_workspace_bytes``
    bytes that the plan uses as its scratch instead of allocating its own, e.g. one buffer
    allocated once for the largest micro-batch and given to every plan. The plan keeps it
    alive; the operations of all plans sharing it must run in order on one stream."""
    hkv = _dim(topk, 0, "topk", 3)
    topo = _topology(topology, 16 * hkv, hkv)
    return _native.build_plan(topo, layout, _native_arg(topk), int(q_per_cta), _native_arg(workspace),
                              **_run(deterministic, num_threads, stream, topk))


def plan_workspace_bytes(layout, topology=None, *, num_q_heads=64, num_kv_heads=4, device="cuda"):
    """Bytes of scratch a plan for ``layout`` uses on ``device`` (0 on the CPU): the size of the
    ``workspace`` that ``build_plan`` accepts. Without ``topology`` the heads are MiniMax-M3's."""
    topo = _topology(topology, num_q_heads, num_kv_heads)
    return _native.plan_workspace_bytes(topo, layout, str(device))


def prepare(index_q, index_k, layout, topology=None, *, lse_temperature=1.0, q_per_cta=8, deterministic=False,
            num_threads=0, stream=None):
    """select_blocks (with the selected LSE) followed by build_plan: (topk, selected_lse, plan)."""
    run = dict(deterministic=deterministic, num_threads=num_threads, stream=stream)
    topk, lse = select_blocks(index_q, index_k, layout, topology, return_lse=True, lse_temperature=lse_temperature, **run)
    plan = build_plan(topk, layout, topology, q_per_cta=q_per_cta, **run)
    return topk, lse, plan


def _plan_for(plan, topk, layout, topo, run):
    return plan if plan is not None else _native.build_plan(topo, layout, _native_arg(topk), 8, **run)


def forward(q, k, v, topk, layout, plan=None, topology=None, *, out_dtype="float32", deterministic=False,
            num_threads=0, stream=None):
    """Sparse attention forward: (out [total_q, Hq, 128] of ``out_dtype``, lse float32 [total_q, Hq])."""
    _check_out_dtype(out_dtype, "out_dtype")
    topo = _topology(topology, _dim(q, 1, "q", 3), _dim(k, 1, "k", 3))
    run = _run(deterministic, num_threads, stream, q)
    plan = _plan_for(plan, topk, layout, topo, run)
    out = _empty(q, tuple(q.shape), out_dtype)
    lse = _empty(q, tuple(q.shape[:2]), "float32")
    _native.sparse_attention_forward(topo, layout, plan, _native_arg(q), _native_arg(k), _native_arg(v),
                                     _native_arg(topk), _native_arg(out), _native_arg(lse), **run)
    return out, lse


def backward(dout, q, k, v, topk, out, lse, layout, plan=None, topology=None, *, grad_dtype="float32",
             deterministic=False, num_threads=0, stream=None):
    """Sparse attention backward: (dq, dk, dv) of ``grad_dtype``."""
    _check_out_dtype(grad_dtype, "grad_dtype")
    topo = _topology(topology, _dim(q, 1, "q", 3), _dim(k, 1, "k", 3))
    run = _run(deterministic, num_threads, stream, q)
    plan = _plan_for(plan, topk, layout, topo, run)
    dq = _empty(q, tuple(q.shape), grad_dtype)
    dk = _empty(q, tuple(k.shape), grad_dtype)
    dv = _empty(q, tuple(v.shape), grad_dtype)
    _native.sparse_attention_backward(topo, layout, plan, _native_arg(q), _native_arg(k), _native_arg(v),
                                      _native_arg(topk), _native_arg(out), _native_arg(lse), _native_arg(dout),
                                      _native_arg(dq), _native_arg(dk), _native_arg(dv), **run)
    return dq, dk, dv


def kl_backward(q, k, lse, index_q, index_k, index_lse, topk, layout, plan=None, topology=None, *, grad_scale=0.0,
                grad_dtype="float32", deterministic=False, num_threads=0, stream=None):
    """Gradient of the indexer's KL(teacher || student) w.r.t. index_q and index_k.

    Teacher: mean over a group's 16 query heads of the main attention probabilities (from q, k,
    lse); student: softmax of the index scores (index_lse = select_blocks' LSE at temperature 1),
    both over the selected causal keys. ``grad_scale`` 0 means 1 / (Hi * total_q): the gradient
    of the KL averaged over index heads and tokens."""
    _check_out_dtype(grad_dtype, "grad_dtype")
    topo = _topology(topology, _dim(q, 1, "q", 3), _dim(k, 1, "k", 3))
    run = _run(deterministic, num_threads, stream, q)
    plan = _plan_for(plan, topk, layout, topo, run)
    diq = _empty(q, tuple(index_q.shape), grad_dtype)
    dik = _empty(q, tuple(index_k.shape), grad_dtype)
    _native.kl_backward(topo, layout, plan, _native_arg(q), _native_arg(k), _native_arg(lse), _native_arg(index_q),
                        _native_arg(index_k), _native_arg(index_lse), _native_arg(topk), _native_arg(diq),
                        _native_arg(dik), float(grad_scale), **run)
    return diq, dik


def merge_states(out_partials, lse_partials, *, out_dtype="float32", deterministic=False, num_threads=0, stream=None):
    """Merges partial attention states out [S, rows, H, D], lse [S, rows, H] into (out, lse)."""
    _check_out_dtype(out_dtype, "out_dtype")
    _dim(out_partials, 0, "out_partials", 4)
    out = _empty(out_partials, tuple(out_partials.shape[1:]), out_dtype)
    lse = _empty(out_partials, tuple(out_partials.shape[1:3]), "float32")
    _native.merge_states(_native_arg(out_partials), _native_arg(lse_partials), _native_arg(out), _native_arg(lse),
                         **_run(deterministic, num_threads, stream, out_partials))
    return out, lse



def pack(padded, layout, *, stream=None):
    """[batch, seq, ...] -> [tokens, ...] for a layout made from a document map. CPU arrays are
    copied on the host; CUDA tensors by a kernel on ``stream`` (None = PyTorch's current stream)
    that does not wait for the device (graph-capturable)."""
    torch = _torch_module(padded)
    shape = (layout.total_q,) + tuple(padded.shape[2:])
    packed = torch.empty(shape, dtype=padded.dtype, device=padded.device) if torch else np.empty(shape, padded.dtype)
    _native.pack(layout, _native_arg(padded), _native_arg(packed), stream=_stream(padded, stream))
    return packed


def unpack(packed, layout, *, stream=None):
    """[tokens, ...] -> [batch, seq, ...]; padding positions are zero (as ``pack``, any device)."""
    torch = _torch_module(packed)
    shape = tuple(layout.padded_shape) + tuple(packed.shape[1:])
    padded = torch.empty(shape, dtype=packed.dtype, device=packed.device) if torch else np.empty(shape, packed.dtype)
    _native.unpack(layout, _native_arg(packed), _native_arg(padded), stream=_stream(packed, stream))
    return padded
