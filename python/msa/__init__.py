"""MiniMax Sparse Attention (MSA): block-sparse attention of MiniMax-M3's sparse layers.

The native module runs the library's operations on DLPack arrays (NumPy, PyTorch, ...)
without copies, on the CPU and, when the library was built with its CUDA backend, on CUDA.
This package adds output allocation (functional ops below, NumPy or PyTorch arrays) and,
in ``msa.torch``, PyTorch custom ops, autograd and the MiniMax-M3 sparse attention layer.

CUDA memory the library needs (plans, their workspace, scratch) comes from cudaMalloc unless
``set_device_allocator`` routes it elsewhere; importing ``msa.torch`` routes it to PyTorch's
caching allocator (see ``msa.torch.use_torch_allocator``).

bf16 data: NumPy has no bfloat16. Pass ``ml_dtypes.bfloat16`` arrays (when ml_dtypes is
installed) or uint16 arrays holding bf16 bits (``msa.bf16.from_float`` makes them).
"""

from ._native import (
    InvalidArgumentError,
    MsaError,
    MsaRuntimeError,
    PackedLayout,
    Plan,
    Topology,
    UnsupportedError,
    __version__,
    built_with_cuda,
    cuda_device_count,
    device_allocator,
    set_device_allocator,
)
from . import bf16, inference
from .functional import (
    backward,
    build_plan,
    call_workspace_bytes,
    forward,
    kl_backward,
    make_layout,
    merge_states,
    pack,
    plan_workspace_bytes,
    prepare,
    select_blocks,
    unpack,
)

__all__ = [
    "MsaError", "InvalidArgumentError", "UnsupportedError", "MsaRuntimeError",
    "Topology", "PackedLayout", "Plan", "built_with_cuda", "cuda_device_count", "bf16",
    "set_device_allocator", "device_allocator",
    "make_layout", "select_blocks", "build_plan", "plan_workspace_bytes", "call_workspace_bytes", "prepare",
    "forward", "backward", "kl_backward", "merge_states", "pack", "unpack", "inference", "__version__",
]
