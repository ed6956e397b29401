"""PyTorch integration of msa: custom ops (torch.library, traceable by torch.compile),
autograd for the sparse attention, the indexer's KL training signal, and the MiniMax-M3
sparse attention layer with a dense float32 reference of the same layer.

Importing this module registers the ops under the ``msa`` namespace (torch.ops.msa.*).
"""

from . import _ops  # noqa: F401  (registers torch.ops.msa.*)
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

__all__ = [
    "select_blocks", "sparse_attention", "indexer_kl_loss", "merge_states", "attach_loss", "PackingIndex",
    "MiniMaxM3SparseAttention", "ReferenceSparseAttention", "GemmaRMSNorm", "apply_partial_rope", "rope_cos_sin",
]
