"""PyTorch integration of msa: custom ops (torch.library, traceable by torch.compile),
autograd for the sparse attention, the indexer's KL training signal, and the MiniMax-M3
sparse attention layer with a dense float32 reference of the same layer.

Importing this module registers the ops under the ``msa`` namespace (torch.ops.msa.*) and, when
PyTorch and msa both have CUDA, routes msa's CUDA allocations through PyTorch's caching
allocator (``use_torch_allocator``), which makes the ops CUDA-graph capturable.
"""

from . import _ops  # noqa: F401  (registers torch.ops.msa.*)
from ._allocator import _install_default, torch_allocator_in_use, use_torch_allocator
from .functional import (
    PackingIndex,
    attach_loss,
    indexer_kl_loss,
    merge_states,
    select_blocks,
    sparse_attention,
)
from .layer import GemmaRMSNorm, MiniMaxM3SparseAttention, apply_partial_rope, rope_cos_sin
from .reference import ReferenceSparseAttention

_install_default()

__all__ = [
    "use_torch_allocator", "torch_allocator_in_use",
    "select_blocks", "sparse_attention", "indexer_kl_loss", "merge_states", "attach_loss", "PackingIndex",
    "MiniMaxM3SparseAttention", "ReferenceSparseAttention", "GemmaRMSNorm", "apply_partial_rope", "rope_cos_sin",
]
