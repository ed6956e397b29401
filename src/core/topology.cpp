#include "msa/topology.h"

#include "core/check.h"

namespace msa {

using detail::concat;
using detail::require;

void Topology::validate() const {
  require(num_kv_heads == 1 || num_kv_heads == 2 || num_kv_heads == 4,
          concat("topology.num_kv_heads must be 1, 2 or 4, got ", num_kv_heads));
  require(num_q_heads == 16 * num_kv_heads,
          concat("topology.num_q_heads must be 16 * num_kv_heads = ", 16 * num_kv_heads,
                 " (only qhead_per_kv=16 is supported), got ", num_q_heads));
  require(num_index_heads == num_kv_heads,
          concat("topology.num_index_heads must equal num_kv_heads = ", num_kv_heads, ", got ", num_index_heads));
  require(head_dim == 128, concat("topology.head_dim must be 128, got ", head_dim));
  require(index_head_dim == 128, concat("topology.index_head_dim must be 128, got ", index_head_dim));
  require(block_size == 128, concat("topology.block_size must be 128 (only block_size=128 is supported), got ", block_size));
  require(topk == 16, concat("topology.topk must be 16, got ", topk));
  require(init_blocks >= 0 && local_blocks >= 0,
          concat("topology.init_blocks/local_blocks must be >= 0, got ", init_blocks, " / ", local_blocks));
  require(local_blocks >= 1,
          concat("topology.local_blocks must be >= 1 (the query's own block is always attended), got ", local_blocks));
  require(init_blocks + local_blocks <= topk,
          concat("topology.init_blocks + local_blocks must be <= topk = ", topk, ", got ", init_blocks + local_blocks));
  require(std::isfinite(softmax_scale) && softmax_scale >= 0,
          concat("topology.softmax_scale must be finite and > 0 (or 0 for 1/sqrt(head_dim)), got ", softmax_scale));
  require(std::isfinite(index_scale) && index_scale >= 0,
          concat("topology.index_scale must be finite and > 0 (or 0 for 1/sqrt(index_head_dim)), got ", index_scale));
}

}  // namespace msa
