// Gemma RMSNorm + partial NeoX RoPE of q / index-q style tensors [tokens, H, 128].
#include "cpu/inference/common.h"

namespace msa::cpu {

void rms_norm_rope(const RmsNormRopeParams& p, const RunOptions& opt) {
  using namespace inference;
  const int64_t T = p.x.shape[0], H = p.x.shape[1];
  float weight1p[kHeadDim], inv_freq[kHeadDim / 2];
  gemma_weight(p.weight, weight1p);
  rope_inv_freq(p.config.rotary_dim, p.config.rope_theta, inv_freq);
  const int32_t* positions = p.config.rotary_dim > 0 ? p.positions.as<const int32_t>() : nullptr;
#pragma omp parallel for num_threads(thread_count(opt)) schedule(static)
  for (int64_t row = 0; row < T * H; ++row) {
    const int64_t t = row / H, h = row % H;
    float in[kHeadDim], out[kHeadDim];
    load_row(p.x, t * p.x.stride[0] + h * p.x.stride[1], kHeadDim, in);
    norm_rope_row(in, weight1p, inv_freq, p.config.rotary_dim, p.config.eps, positions ? positions[t] : 0, out);
    store_row(p.out, t * p.out.stride[0] + h * p.out.stride[1], kHeadDim, out);
  }
}

}  // namespace msa::cpu
