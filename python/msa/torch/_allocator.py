"""msa's CUDA memory from PyTorch's caching allocator.

The library allocates device memory for every plan it builds (the plan's buffers, its
workspace, temporary scratch). Routed through ``torch.cuda.caching_allocator_alloc`` on the
stream the op runs on, that memory is cached by PyTorch (no cudaMalloc / cudaFree per call),
shows up in ``torch.cuda.memory_allocated``, and while a CUDA graph is being captured comes
from the graph's private pool, which is what makes the ops capturable.
"""

import os

import torch

from .. import _calls, _native


def _allocate(nbytes: int, device: int, stream: int) -> int:
    return torch.cuda.caching_allocator_alloc(nbytes, device, stream)


def _deallocate(ptr: int, nbytes: int, device: int, stream: int) -> None:
    torch.cuda.caching_allocator_delete(ptr)


def use_torch_allocator(enabled: bool = True) -> None:
    """Routes msa's CUDA allocations through PyTorch's caching allocator (``enabled``), or back
    to msa's built-in cudaMalloc / cudaFree (``enabled=False``). ``import msa.torch`` enables it
    when PyTorch and msa both have CUDA, unless ``MSA_TORCH_ALLOCATOR=0`` is set. Memory already
    given out goes back to the allocator that gave it."""
    if enabled:
        if torch.version.cuda is None:
            raise _native.UnsupportedError("use_torch_allocator: this PyTorch build has no CUDA")
        _calls.set_device_allocator(_allocate, _deallocate)
    else:
        _calls.set_device_allocator(None, None)


def torch_allocator_in_use() -> bool:
    """Whether msa's CUDA allocations go through PyTorch's caching allocator."""
    current = _calls.device_allocator()
    return isinstance(current, tuple) and current[0] is _allocate


def _install_default() -> None:
    if os.environ.get("MSA_TORCH_ALLOCATOR", "1") == "0":
        return
    if torch.version.cuda is not None and _calls.built_with_cuda() and _calls.device_allocator() is None:
        use_torch_allocator(True)
