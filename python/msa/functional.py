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

from . import _calls, _native
from .constants import GROUP_SIZE

_FLOAT_OUT = ("float32", "bfloat16")


def _check_out_dtype(dtype, name):
    if dtype not in _FLOAT_OUT:
        raise _native.InvalidArgumentError(f"{name} must be one of {_FLOAT_OUT}, got {dtype!r}")


def _topology(topology, num_q_heads, num_kv_heads):
    if topology is not None:
        return topology
    return _calls.topology(num_q_heads, num_kv_heads)


def _dim(x, axis, name, rank):
    if len(x.shape) != rank:
        raise _native.InvalidArgumentError(f"{name} must have {rank} dimensions, got shape {list(x.shape)}")
    return int(x.shape[axis])


# ---- layouts -----------------------------------------------------------------------------

def make_layout(cu_seqlens_q=None, cu_seqlens_k=None, fragment_indices=None, *, document_map=None):
    """A PackedLayout from cumulative lengths (``cu_seqlens_k`` defaults to ``cu_seqlens_q``)
    or from a [batch, seq] integer document map (0 = padding). Lists, NumPy arrays and CPU
    tensors of integers are accepted (floats are refused, not truncated); a CUDA tensor
    document map is reduced on its device (on PyTorch's current stream) and read back with
    one wait, so not during CUDA-graph capture."""
    if document_map is not None:
        if cu_seqlens_q is not None:
            raise _native.InvalidArgumentError("give either cu_seqlens or document_map, not both")
        return _calls.layout_from_document_map(document_map)
    if cu_seqlens_q is None:
        raise _native.InvalidArgumentError("make_layout needs cu_seqlens_q or document_map")
    return _calls.layout_from_cu_seqlens(cu_seqlens_q, cu_seqlens_k, fragment_indices)


# ---- operations --------------------------------------------------------------------------

def select_blocks(index_q, index_k, layout, topology=None, *, return_lse=False, lse_temperature=1.0,
                  deterministic=False, num_threads=0, stream=None):
    """Indexer: the blocks each (query, index head) attends, int32 [Hi, total_q, 16], valid ids
    first with the local block last, -1 padding. With ``return_lse`` also the natural-log LSE
    of the index scores over the selected causal keys, float32 [Hi, total_q]. ``index_q`` /
    ``index_k``: bf16 or FP8 E4M3 (scale 1), each on its own."""
    hi = _dim(index_q, 1, "index_q", 3)
    topo = _topology(topology, GROUP_SIZE * hi, hi)
    run = _calls.run_options(index_q, deterministic=deterministic, num_threads=num_threads, stream=stream)
    total_q = int(index_q.shape[0])
    topk = _calls.empty(index_q, (topo.num_index_heads, total_q, topo.topk), "int32")
    lse = _calls.empty(index_q, (topo.num_index_heads, total_q), "float32") if return_lse else None
    _calls.select_blocks(topo, layout, index_q, index_k, topk, lse, lse_temperature, run)
    return (topk, lse) if return_lse else topk


def build_plan(topk, layout, topology=None, *, q_per_cta=8, workspace=None, workspace_per_call=False,
               deterministic=False, num_threads=0, stream=None):
    """Validates ``topk`` against the layout and builds the reusable k2q plan (a Plan).

    ``workspace`` (CUDA plans only): a uint8 CUDA array of at least ``plan_workspace_bytes``
    bytes that the plan uses as its scratch instead of allocating its own, e.g. one buffer
    allocated once for the largest micro-batch and given to every plan. The plan keeps it
    alive; the operations of all plans sharing it must run in order on one stream.
    ``workspace_per_call`` (CUDA plans only; ignored on the CPU): the plan holds no scratch and
    every ``forward`` / ``backward`` / ``kl_backward`` on it passes ``workspace=`` of at least
    ``call_workspace_bytes`` for that call, so that a plan kept from a forward to its backward
    costs only its CSR and schedule, and each call's scratch only its own regions."""
    hkv = _dim(topk, 0, "topk", 3)
    topo = _topology(topology, GROUP_SIZE * hkv, hkv)
    run = _calls.run_options(topk, deterministic=deterministic, num_threads=num_threads, stream=stream)
    return _calls.build_plan(topo, layout, topk, run, q_per_cta=q_per_cta, workspace=workspace,
                             workspace_per_call=workspace_per_call)


def plan_workspace_bytes(layout, topology=None, *, num_q_heads=64, num_kv_heads=4, device="cuda"):
    """Bytes of scratch a plan for ``layout`` uses on ``device`` (0 on the CPU): the size of the
    ``workspace`` that ``build_plan`` accepts. Without ``topology`` the heads are MiniMax-M3's."""
    return _calls.plan_workspace_bytes(_topology(topology, num_q_heads, num_kv_heads), layout, device)


def call_workspace_bytes(layout, call, topology=None, *, deterministic=False, num_q_heads=64, num_kv_heads=4,
                         device="cuda"):
    """Bytes of scratch one ``call`` (``"forward"``, ``"backward"`` or ``"kl_backward"``, with
    ``deterministic`` as the call runs) uses on ``device`` (0 on the CPU): the least a
    ``workspace=`` passed to that call must hold, and less than ``plan_workspace_bytes`` (which
    serves every call). The forward's partial outputs are the largest part (~264 KB a query
    token with 64 heads, held for one window of queries at a time: 4096 at 16k tokens, at most
    1/16 of a long document); the default backward needs ~50 KB a token, the default KL ~2.5 KB."""
    return _calls.call_workspace_bytes(_topology(topology, num_q_heads, num_kv_heads), layout, call, deterministic,
                                       device)


def prepare(index_q, index_k, layout, topology=None, *, lse_temperature=1.0, q_per_cta=8, deterministic=False,
            num_threads=0, stream=None):
    """select_blocks (with the selected LSE) followed by build_plan: (topk, selected_lse, plan)."""
    run = dict(deterministic=deterministic, num_threads=num_threads, stream=stream)
    topk, lse = select_blocks(index_q, index_k, layout, topology, return_lse=True, lse_temperature=lse_temperature, **run)
    plan = build_plan(topk, layout, topology, q_per_cta=q_per_cta, **run)
    return topk, lse, plan


def _attention_setup(q, k, topk, layout, plan, topology, deterministic, num_threads, stream):
    """Topology, run options and plan (built from topk when not given) of an attention call."""
    topo = _topology(topology, _dim(q, 1, "q", 3), _dim(k, 1, "k", 3))
    run = _calls.run_options(q, deterministic=deterministic, num_threads=num_threads, stream=stream)
    if plan is None:
        plan = _calls.build_plan(topo, layout, topk, run)
    return topo, run, plan


def forward(q, k, v, topk, layout, plan=None, topology=None, *, out_dtype="float32", workspace=None,
            deterministic=False, num_threads=0, stream=None):
    """Sparse attention forward: (out [total_q, Hq, 128] of ``out_dtype``, lse float32 [total_q, Hq]).
    ``workspace`` (CUDA): this call's scratch instead of the plan's, of at least
    ``call_workspace_bytes(layout, "forward")`` bytes (see ``build_plan``)."""
    _check_out_dtype(out_dtype, "out_dtype")
    topo, run, plan = _attention_setup(q, k, topk, layout, plan, topology, deterministic, num_threads, stream)
    out = _calls.empty(q, tuple(q.shape), out_dtype)
    lse = _calls.empty(q, tuple(q.shape[:2]), "float32")
    _calls.sparse_attention_forward(topo, layout, plan, q, k, v, topk, out, lse, run, workspace)
    return out, lse


def backward(dout, q, k, v, topk, out, lse, layout, plan=None, topology=None, *, grad_dtype="float32",
             workspace=None, deterministic=False, num_threads=0, stream=None):
    """Sparse attention backward: (dq, dk, dv) of ``grad_dtype``. ``workspace``: as for ``forward``, of at
    least ``call_workspace_bytes(layout, "backward", deterministic=deterministic)`` bytes."""
    _check_out_dtype(grad_dtype, "grad_dtype")
    topo, run, plan = _attention_setup(q, k, topk, layout, plan, topology, deterministic, num_threads, stream)
    dq = _calls.empty(q, tuple(q.shape), grad_dtype)
    dk = _calls.empty(q, tuple(k.shape), grad_dtype)
    dv = _calls.empty(q, tuple(v.shape), grad_dtype)
    _calls.sparse_attention_backward(topo, layout, plan, q, k, v, topk, out, lse, dout, dq, dk, dv, run, workspace)
    return dq, dk, dv


def kl_backward(q, k, lse, index_q, index_k, index_lse, topk, layout, plan=None, topology=None, *, grad_scale=0.0,
                grad_dtype="float32", workspace=None, deterministic=False, num_threads=0, stream=None):
    """Gradient of the indexer's KL(teacher || student) w.r.t. index_q and index_k.

    Teacher: mean over a group's 16 query heads of the main attention probabilities (from q, k,
    lse); student: softmax of the index scores (index_lse = select_blocks' LSE at temperature 1),
    both over the selected causal keys. ``grad_scale`` 0 means 1 / (Hi * total_q): the gradient
    of the KL averaged over index heads and tokens. ``workspace``: as for ``forward``, of at least
    ``call_workspace_bytes(layout, "kl_backward", deterministic=deterministic)`` bytes."""
    _check_out_dtype(grad_dtype, "grad_dtype")
    topo, run, plan = _attention_setup(q, k, topk, layout, plan, topology, deterministic, num_threads, stream)
    diq = _calls.empty(q, tuple(index_q.shape), grad_dtype)
    dik = _calls.empty(q, tuple(index_k.shape), grad_dtype)
    _calls.kl_backward(topo, layout, plan, q, k, lse, index_q, index_k, index_lse, topk, diq, dik, grad_scale, run,
                       workspace)
    return diq, dik


def merge_states(out_partials, lse_partials, *, out_dtype="float32", deterministic=False, num_threads=0, stream=None):
    """Merges partial attention states out [S, rows, H, D], lse [S, rows, H] into (out, lse)."""
    _check_out_dtype(out_dtype, "out_dtype")
    _dim(out_partials, 0, "out_partials", 4)
    run = _calls.run_options(out_partials, deterministic=deterministic, num_threads=num_threads, stream=stream)
    out = _calls.empty(out_partials, tuple(out_partials.shape[1:]), out_dtype)
    lse = _calls.empty(out_partials, tuple(out_partials.shape[1:3]), "float32")
    _calls.merge_states(out_partials, lse_partials, out, lse, run)
    return out, lse


def _like(x, shape):
    """An uninitialised array of `shape` with x's dtype and device."""
    torch = _calls.torch_module(x)
    return torch.empty(shape, dtype=x.dtype, device=x.device) if torch else np.empty(shape, x.dtype)


def pack(padded, layout, *, stream=None):
    """[batch, seq, ...] -> [tokens, ...] for a layout made from a document map. CPU arrays are
    copied on the host; CUDA tensors by a kernel on ``stream`` (None = PyTorch's current stream)
    that does not wait for the device (graph-capturable)."""
    packed = _like(padded, (layout.total_q,) + tuple(padded.shape[2:]))
    _calls.pack(layout, padded, packed, _calls.stream_of(padded, stream))
    return packed


def unpack(packed, layout, *, stream=None):
    """[tokens, ...] -> [batch, seq, ...]; padding positions are zero (as ``pack``, any device)."""
    padded = _like(packed, tuple(layout.padded_shape) + tuple(packed.shape[1:]))
    _calls.unpack(layout, packed, padded, _calls.stream_of(packed, stream))
    return padded
