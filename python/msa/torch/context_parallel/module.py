"""The MiniMax-M3 sparse attention layer over a context-parallel shard."""

import torch
from torch import Tensor, nn

from .autograd import context_parallel_sparse_attention
from .shards import ContextParallelShard


class ContextParallelSparseAttention(nn.Module):
    """Runs a ``MiniMaxM3SparseAttention`` (its parameters, shared, not copied) over a
    context-parallel shard: forward(hidden [n, hidden], shard) -> [n, hidden] for this rank's
    tokens. Parameter gradients are this rank's contribution; sum them over the group (as data
    parallelism or FSDP does) to obtain the single-device gradients."""

    def __init__(self, layer, group=None, save_gathered: bool = False):
        super().__init__()
        self.layer = layer
        self.group = group
        self.save_gathered = save_gathered

    def forward(self, hidden_states: Tensor, shard: ContextParallelShard) -> Tensor:
        layer = self.layer
        positions = shard.positions.to(hidden_states.device)
        q, k, v, iq, ik = layer.project(hidden_states, positions)
        bf16 = torch.bfloat16
        q, k, v, iq, ik = q.to(bf16), k.to(bf16), v.to(bf16), iq.to(bf16), ik.to(bf16)
        train_indexer = (layer.training and torch.is_grad_enabled() and layer.indexer_loss_weight > 0
                         and (iq.requires_grad or ik.requires_grad))
        out, topk = context_parallel_sparse_attention(
            q, k, v, iq, ik, shard, group=self.group, train_indexer=train_indexer,
            indexer_loss_weight=layer.indexer_loss_weight, init_blocks=layer.init_blocks,
            local_blocks=layer.local_blocks, deterministic=layer.deterministic, save_gathered=self.save_gathered,
            return_topk=True)
        layer.last_topk = topk
        return layer.o_proj(out.reshape(shard.num_tokens, -1).to(layer.o_proj.weight.dtype))
