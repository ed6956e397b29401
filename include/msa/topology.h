// Head counts and sparse-selection settings. Defaults are MiniMax-M3's sparse layer.
#pragma once

#include <cmath>
#include <cstdint>

namespace msa {

struct Topology {
  int num_q_heads = 64;      // Hq; query head h uses KV head and index head h / 16
  int num_kv_heads = 4;      // Hkv: 4, or 2 / 1 for tensor-parallel shards
  int num_index_heads = 4;   // Hi == Hkv (one index head selects for one KV group)
  int head_dim = 128;        // D of q, k, v
  int index_head_dim = 128;  // Di of index q / index k
  int block_size = 128;      // tokens per sparse block (= page size at inference)
  int topk = 16;             // selected blocks per (token, group), local block included
  int init_blocks = 0;       // leading blocks always selected
  int local_blocks = 1;      // trailing visible blocks always selected (the query's own block last)
  float softmax_scale = 0;   // 0 means 1/sqrt(head_dim)
  float index_scale = 0;     // 0 means 1/sqrt(index_head_dim); only changes LSE/KL, not ranking

  int group_size() const { return num_q_heads / num_kv_heads; }
  float attention_scale() const { return softmax_scale > 0 ? softmax_scale : 1.0f / std::sqrt(float(head_dim)); }
  float indexer_scale() const { return index_scale > 0 ? index_scale : 1.0f / std::sqrt(float(index_head_dim)); }

  // MiniMax-M3 sharded over `tp` tensor-parallel ranks (tp in {1, 2, 4}).
  static Topology minimax_m3(int tp = 1) {
    Topology t;
    t.num_q_heads = 64 / tp;
    t.num_kv_heads = 4 / tp;
    t.num_index_heads = 4 / tp;
    return t;
  }

  // Throws msa::Error naming the first unsupported field.
  void validate() const;
};

}  // namespace msa
