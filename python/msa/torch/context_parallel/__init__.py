"""Context parallelism for MSA training through torch.distributed.

The tokens of a packed batch (documents described by ``cu_seqlens``) are cut into chunks of
``chunk_size`` tokens and the chunks are dealt to the ranks so that every rank gets the same
number of chunks and about the same *useful work* (not the same number of tokens: a query at
document position p attends at most 16 blocks of 128 keys, ~min(p + 1, 2048) keys, while the
indexer scores all p + 1 earlier keys). A rank holds the queries, keys and values of its own
tokens. Per layer call it

  1. all-gathers K, V and index-K of every rank (one ``all_gather_into_tensor``),
  2. copies out the documents its queries need, each document's key prefix stored once, and
     describes its queries as *fragments* (docs/semantics.md §2.3): fragment b reads keys
     [cu_seqlens_k[fragment_indices[b]], cu_seqlens_k[b + 1]) and is the causal suffix of
     that range, so query positions are the global document positions,
  3. runs the indexer, the sparse attention and (training) the indexer's KL gradient on its
     queries only,

and in backward it writes its float32 dK, dV and d index-K into a buffer laid out like the
gathered one and reduce-scatters it (``reduce_scatter_tensor``, sum) so each rank receives the
complete gradients of the keys it owns. Reduce-scatter rather than all-reduce + slice: it moves
half the bytes ((W - 1) / W of the buffer per rank instead of 2 (W - 1) / W) and never holds
the reduced full buffer; backends without it (gloo in some builds) fall back to all-reduce.

The results equal the single-device results up to summation order: the same keys are seen by
every query, and the partial key gradients are summed in float32 and rounded to the key dtype
once, at the owner.

Typical use (every rank runs the same code)::

    split = split_for_context_parallel(cu_seqlens, world_size, chunk_size=1024)
    shard = split.shard(rank)                       # host-side plan, no communication
    q, k, v, iq, ik = <this rank's projections of its tokens shard.tokens>
    out = context_parallel_sparse_attention(q, k, v, iq, ik, shard)
    loss(out).backward()                            # collectives run inside backward

Collectives run inside autograd, so every rank must call forward and backward the same number
of times in the same order (as with any context-parallel layer).

The package, by concern: ``balance`` (token costs, chunks dealt to ranks), ``shards`` (the
split and each rank's plan), ``collectives`` (all-gather / reduce-scatter), ``autograd`` (the
attention over msa's registered torch ops, its options) and ``module`` (the layer over a shard).
"""

from .autograd import ContextParallelOptions, context_parallel_sparse_attention
from .balance import token_costs
from .collectives import gather_tokens
from .module import ContextParallelSparseAttention
from .shards import ContextParallelShard, ContextParallelSplit, split_for_context_parallel

__all__ = [
    "ContextParallelSplit", "ContextParallelShard", "ContextParallelOptions", "split_for_context_parallel",
    "token_costs", "context_parallel_sparse_attention", "ContextParallelSparseAttention", "gather_tokens",
]
