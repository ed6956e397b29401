"""The one place that calls the native module (``msa._native``).

It owns what every call needs: arrays handed over through DLPack without copies (PyTorch
tensors as capsules, ml_dtypes bf16 NumPy arrays as their uint16 bits), integer arguments and
integer metadata checked before they are converted (a float ``cu_seqlens`` or page table is
refused, never truncated), the run options (``deterministic``, ``num_threads`` in range, the
stream), and the native calls themselves. ``msa.functional``, ``msa.inference``, the PyTorch
ops of ``msa.torch``, its allocator hook and context parallelism go through these functions;
elsewhere ``_native`` is used only for its error classes and types.
"""

import operator
import os
import sys
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from . import _native
from . import bf16 as _bf16

InvalidArgumentError = _native.InvalidArgumentError

# More CPU threads than this are a mistake, not a request: libgomp would try to start them all
# (10**9 exhausts memory and ends the interpreter).
MAX_THREADS = max(1024, 4 * (os.cpu_count() or 1))
_INT32 = np.iinfo(np.int32)


# ---- arrays of either kind -----------------------------------------------------------------

def torch_module(x):
    """The torch module when `x` is a torch.Tensor, else None (torch is imported only then)."""
    if type(x).__module__.startswith("torch"):
        import torch

        if isinstance(x, torch.Tensor):
            return torch
    return None


def array(x):
    """What the native module receives for `x` (None stays None): a DLPack-capable object, no copy."""
    if x is None:
        return None
    torch = torch_module(x)
    if torch is not None:
        # A capsule: no stream synchronisation, works for tensors that require grad.
        return torch.utils.dlpack.to_dlpack(x.detach())
    if isinstance(x, np.ndarray) and _bf16.is_bfloat16(x.dtype):
        return x.view(np.uint16)
    return x


def empty(like, shape, dtype):
    """An uninitialised array of `dtype` ("float32", "bfloat16", "int32") beside `like`: a
    tensor on its device for a tensor, else a NumPy array (bf16 as ml_dtypes when `like` is)."""
    torch = torch_module(like)
    if torch is not None:
        tdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int32": torch.int32}[dtype]
        return torch.empty(shape, dtype=tdtype, device=like.device)
    if dtype == "bfloat16":
        return np.empty(shape, dtype=_bf16.bfloat16 if _bf16.is_bfloat16(like.dtype) else np.uint16)
    return np.empty(shape, dtype=dtype)


class on_device:
    """Makes a CUDA tensor's device current for the call (the library launches on the inputs'
    device); does nothing for anything else."""

    def __init__(self, x):
        torch = torch_module(x)
        self._ctx = torch.cuda.device(x.device) if torch is not None and x.is_cuda else None

    def __enter__(self):
        if self._ctx is not None:
            self._ctx.__enter__()

    def __exit__(self, *exc):
        if self._ctx is not None:
            self._ctx.__exit__(*exc)


# ---- the build and its device allocator ------------------------------------------------------

def built_with_cuda():
    return _native.built_with_cuda()


def set_device_allocator(allocate, deallocate):
    """Python callables as msa's CUDA allocator ((None, None) restores the built-in one)."""
    _native.set_device_allocator(allocate, deallocate)


def device_allocator():
    return _native.device_allocator()


# ---- scalars and options -------------------------------------------------------------------

def integer(value, name):
    """`value` as an int; floats (even 2.0) and other non-integers are refused, naming `name`."""
    try:
        return operator.index(value)
    except TypeError:
        raise InvalidArgumentError(f"{name} must be an integer, got {value!r} ({type(value).__name__})") from None


def num_threads_arg(value, name="num_threads"):
    n = integer(value, name)
    if not 0 <= n <= MAX_THREADS:
        raise InvalidArgumentError(f"{name} must be in [0, {MAX_THREADS}] (0 = OpenMP's default), got {n}")
    return n


def device_name(device):
    """"cpu", "cuda" or "cuda:N" for a string, a torch.device or None (= "cpu")."""
    return "cpu" if device is None else str(device)


@dataclass(frozen=True)
class RunOptions:
    """The keyword arguments every native operation takes after its arrays."""

    deterministic: bool = False
    num_threads: int = 0
    stream: int = 0  # a cudaStream_t as an integer (0 = the legacy default stream)

    def kwargs(self):
        return dict(deterministic=self.deterministic, num_threads=self.num_threads, stream=self.stream)


def stream_of(like, stream=None):
    """`stream` as an int; None means PyTorch's current stream for a CUDA tensor, else 0."""
    if stream is not None:
        return integer(stream, "stream")
    torch = torch_module(like)
    if torch is not None and like.device.type == "cuda":
        return torch.cuda.current_stream(like.device).cuda_stream
    return 0


def run_options(like=None, *, deterministic=False, num_threads=0, stream=None):
    """Checked run options for a call on `like`'s device (see ``stream_of``)."""
    return RunOptions(bool(deterministic), num_threads_arg(num_threads), stream_of(like, stream))


# ---- integer metadata ----------------------------------------------------------------------

def _dtype_kind(x):
    """NumPy dtype kind ('i', 'u', 'f', 'b', ...) of an array or tensor; None for other objects."""
    torch = torch_module(x)
    if torch is not None:
        if x.dtype == torch.bool:
            return "b"
        if x.dtype.is_floating_point:
            return "f"
        return "c" if x.dtype.is_complex else "i"
    dtype = getattr(x, "dtype", None)
    return np.dtype(dtype).kind if dtype is not None else None


def check_integer_dtype(x, name):
    """Refuses an array or tensor of `name` whose dtype is not an integer type."""
    kind = _dtype_kind(x)
    if kind is not None and kind not in "iu":
        raise InvalidArgumentError(f"{name} must hold integers (an integer dtype such as int32), got dtype "
                                   f"{x.dtype}; msa does not round or truncate metadata")


def _check_int32_range(values, name):
    if values.size and (values.min() < _INT32.min or values.max() > _INT32.max):
        bad = values[(values < _INT32.min) | (values > _INT32.max)].flat[0]
        raise InvalidArgumentError(f"{name} must fit in int32, got the value {int(bad)}")


def host_int32(x, name):
    """Integer metadata (list, NumPy array or CPU tensor) as a contiguous int32 NumPy array."""
    torch = torch_module(x)
    if torch is not None:
        if x.device.type != "cpu":
            raise InvalidArgumentError(f"{name} must be a CPU tensor, a NumPy array or a list (metadata is read on "
                                       f"the host), got device {x.device}")
        check_integer_dtype(x, name)
        x = x.detach().numpy()
    elif isinstance(x, np.ndarray):
        check_integer_dtype(x, name)
    else:  # a (nested) list: every entry must be an integer (no 2.0, no "3")
        x = np.asarray(x)
        if x.dtype == object:  # Python ints beyond int64, or mixed objects
            for v in x.flat:
                v = integer(v, f"every entry of {name}")
                if not _INT32.min <= v <= _INT32.max:
                    raise InvalidArgumentError(f"{name} must fit in int32, got the value {v}")
            x = x.astype(np.int64)
        elif x.size == 0:
            x = x.astype(np.int64)
        else:
            check_integer_dtype(x, name)
    _check_int32_range(x, name)
    return np.ascontiguousarray(x, dtype=np.int32)


def int_list(x, name):
    """1-D integer metadata as a list of Python ints (None gives [])."""
    if x is None:
        return []
    a = host_int32(x, name)
    if a.ndim != 1:
        raise InvalidArgumentError(f"{name} must be 1-D, got shape {list(a.shape)}")
    return a.tolist()


# ---- layouts -------------------------------------------------------------------------------

_LAYOUT_CACHE = OrderedDict()
_LAYOUT_CACHE_SIZE = 64


def layout_from_cu_seqlens(cu_seqlens_q, cu_seqlens_k=None, fragment_indices=None, *, cached=False):
    """A PackedLayout from cumulative lengths (``cu_seqlens_k`` defaults to ``cu_seqlens_q``).
    ``cached`` reuses a layout made from the same values (layouts are immutable): the torch
    ops build one per call from host tensors."""
    cu_q = int_list(cu_seqlens_q, "cu_seqlens_q")
    cu_k = cu_q if cu_seqlens_k is None else int_list(cu_seqlens_k, "cu_seqlens_k")
    frag = int_list(fragment_indices, "fragment_indices")
    if not cached:
        return _native.PackedLayout.from_cu_seqlens(cu_q, cu_k, frag)
    key = (tuple(cu_q), tuple(cu_k), tuple(frag))
    layout = _LAYOUT_CACHE.get(key)
    if layout is None:
        layout = _native.PackedLayout.from_cu_seqlens(cu_q, cu_k, frag)
        _LAYOUT_CACHE[key] = layout
        if len(_LAYOUT_CACHE) > _LAYOUT_CACHE_SIZE:
            _LAYOUT_CACHE.popitem(last=False)
    else:
        _LAYOUT_CACHE.move_to_end(key)
    return layout


def layout_from_document_map(document_map, stream=None):
    """A PackedLayout from a [batch, seq] integer document map (0 = padding). A CUDA tensor is
    reduced on its device (on `stream`, default PyTorch's current one) and read back with one wait."""
    torch = torch_module(document_map)
    if torch is not None and document_map.device.type == "cuda":
        check_integer_dtype(document_map, "document_map")
        m = document_map.detach().to(torch.int32)
        return _native.PackedLayout.from_document_map(array(m), stream=stream_of(m, stream))
    return _native.PackedLayout.from_document_map(host_int32(document_map, "document_map"))


def topology(num_q_heads, num_kv_heads, *, num_index_heads=None, init_blocks=0, local_blocks=1, softmax_scale=0.0,
             index_scale=0.0):
    """A Topology with Hi = Hkv unless given (the library checks the combination)."""
    hkv = integer(num_kv_heads, "num_kv_heads")
    return _native.Topology(num_q_heads=integer(num_q_heads, "num_q_heads"), num_kv_heads=hkv,
                            num_index_heads=hkv if num_index_heads is None else integer(num_index_heads,
                                                                                        "num_index_heads"),
                            init_blocks=integer(init_blocks, "init_blocks"),
                            local_blocks=integer(local_blocks, "local_blocks"), softmax_scale=float(softmax_scale),
                            index_scale=float(index_scale))


# ---- training-path operations (include/msa/ops.h) ------------------------------------------

def select_blocks(topo, layout, index_q, index_k, topk, selected_lse, lse_temperature, run: RunOptions):
    with on_device(index_q):
        _native.select_blocks(topo, layout, array(index_q), array(index_k), array(topk), array(selected_lse),
                              float(lse_temperature), **run.kwargs())


def build_plan(topo, layout, topk, run: RunOptions, *, q_per_cta=8, workspace=None, workspace_per_call=False):
    with on_device(topk):
        return _native.build_plan(topo, layout, array(topk), integer(q_per_cta, "q_per_cta"), array(workspace),
                                  bool(workspace_per_call), **run.kwargs())


def plan_workspace_bytes(topo, layout, device):
    return _native.plan_workspace_bytes(topo, layout, device_name(device))


def call_workspace_bytes(topo, layout, call, deterministic, device):
    return _native.call_workspace_bytes(topo, layout, str(call), bool(deterministic), device_name(device))


def sparse_attention_forward(topo, layout, plan, q, k, v, topk, out, lse, run: RunOptions, workspace=None):
    with on_device(q):
        _native.sparse_attention_forward(topo, layout, plan, array(q), array(k), array(v), array(topk), array(out),
                                         array(lse), array(workspace), **run.kwargs())


def sparse_attention_backward(topo, layout, plan, q, k, v, topk, out, lse, dout, dq, dk, dv, run: RunOptions,
                              workspace=None):
    with on_device(q):
        _native.sparse_attention_backward(topo, layout, plan, array(q), array(k), array(v), array(topk), array(out),
                                          array(lse), array(dout), array(dq), array(dk), array(dv), array(workspace),
                                          **run.kwargs())


def kl_backward(topo, layout, plan, q, k, lse, index_q, index_k, index_lse, topk, dindex_q, dindex_k, grad_scale,
                run: RunOptions, workspace=None):
    with on_device(q):
        _native.kl_backward(topo, layout, plan, array(q), array(k), array(lse), array(index_q), array(index_k),
                            array(index_lse), array(topk), array(dindex_q), array(dindex_k), float(grad_scale),
                            array(workspace), **run.kwargs())


def merge_states(out_partials, lse_partials, out, lse, run: RunOptions):
    with on_device(out_partials):
        _native.merge_states(array(out_partials), array(lse_partials), array(out), array(lse), **run.kwargs())


def pack(layout, padded, packed, stream):
    with on_device(padded):
        _native.pack(layout, array(padded), array(packed), stream=stream)


def unpack(layout, packed, padded, stream):
    with on_device(packed):
        _native.unpack(layout, array(packed), array(padded), stream=stream)


# ---- inference operations (include/msa/inference.h) ----------------------------------------

KvFormat = _native.KvFormat
InferencePlan = _native.InferencePlan


@dataclass
class PagedCache:
    """A paged K/V cache as the native calls take it (arrays may be None where unused)."""

    k_cache: object
    v_cache: object
    format: object = KvFormat.bf16
    k_block_scale: object = None
    v_block_scale: object = None
    k_scale: object = None
    v_scale: object = None

    def args(self):
        return (array(self.k_cache), array(self.v_cache), self.format, array(self.k_block_scale),
                array(self.v_block_scale), array(self.k_scale), array(self.v_scale))


def plan_stream(device, stream):
    """The stream of a plan on `device` as an int: `stream` when given, else PyTorch's current
    stream for a CUDA device when PyTorch is in use, else 0."""
    if stream is not None:
        return integer(stream, "stream")
    torch = sys.modules.get("torch")
    return torch.cuda.current_stream(torch.device(device)).cuda_stream if torch and device.startswith("cuda") else 0


def plan_options(device, num_kv_splits, num_threads, stream):
    """The checked trailing arguments of the native planners: device, splits, threads, stream."""
    device = device_name(device)
    return (device, integer(num_kv_splits, "num_kv_splits"), num_threads_arg(num_threads), plan_stream(device, stream))


def plan_paged_prefill(topo, cu_seqlens_q, seq_lens, page_table, *, device="cpu", num_kv_splits=0, num_threads=0,
                       stream=None):
    return _native.plan_paged_prefill(topo, host_int32(cu_seqlens_q, "cu_seqlens_q"), host_int32(seq_lens, "seq_lens"),
                                      host_int32(page_table, "page_table"),
                                      *plan_options(device, num_kv_splits, num_threads, stream))


def plan_decode(topo, seq_lens, page_table, q_len_per_req, *, device="cpu", num_kv_splits=0, num_threads=0,
                stream=None):
    return _native.plan_decode(topo, host_int32(seq_lens, "seq_lens"), host_int32(page_table, "page_table"),
                               integer(q_len_per_req, "q_len_per_req"),
                               *plan_options(device, num_kv_splits, num_threads, stream))


def update_decode_plan(plan, seq_lens, page_table, q_len_per_req, *, stream=None):
    _native.update_decode_plan(plan, host_int32(seq_lens, "seq_lens"), host_int32(page_table, "page_table"),
                               integer(q_len_per_req, "q_len_per_req"), plan_stream(plan.device, stream))


def document_positions(*args, **kwargs):
    return _native.document_positions(*args, **kwargs)


def rms_norm_rope(x, weight, positions, out, rotary_dim, eps, rope_theta, run: RunOptions):
    with on_device(x):
        _native.rms_norm_rope(array(x), array(weight), array(positions), array(out),
                              integer(rotary_dim, "rotary_dim"), float(eps), float(rope_theta), **run.kwargs())


def insert_kv(k, v, slot_mapping, cache: PagedCache, index_k, index_k_cache, k_norm, index_k_norm, positions,
              rotary_dim, eps, rope_theta, run: RunOptions):
    with on_device(k):
        _native.insert_kv(array(k), array(v), array(slot_mapping), *cache.args(), array(index_k), array(index_k_cache),
                          array(k_norm), array(index_k_norm), array(positions), integer(rotary_dim, "rotary_dim"),
                          float(eps), float(rope_theta), **run.kwargs())


def nvfp4_to_fp8(packed, block_scale, out, page_ids, run: RunOptions):
    with on_device(packed):
        _native.nvfp4_to_fp8(array(packed), array(block_scale), array(out), array(page_ids), **run.kwargs())


def paged_indexer(plan, index_q, index_k_cache, topk, run: RunOptions):
    with on_device(index_q):
        _native.paged_indexer(plan, array(index_q), array(index_k_cache), array(topk), **run.kwargs())


def paged_attention(plan, q, cache: PagedCache, topk, out, lse, run: RunOptions):
    with on_device(q):
        _native.paged_attention(plan, array(q), *cache.args(), array(topk), array(out), array(lse), **run.kwargs())


def paged_forward(plan, index_q, index_k_cache, topk, q, cache: PagedCache, out, lse, run: RunOptions):
    with on_device(q):
        _native.paged_forward(plan, array(index_q), array(index_k_cache), array(topk), array(q), *cache.args(),
                              array(out), array(lse), **run.kwargs())

