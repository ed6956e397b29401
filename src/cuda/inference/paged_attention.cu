// Decode attention over the paged K/V caches on the GPU (split-K): the host side for every
// format. It picks one of two kernels per (format, rows of a tile):
//   paged_decode_rows.cu   a warp per query row, mma.sync only on the pages the row selected,
//                          codes converted in registers: every NVFP4 tile, FP8 tiles of <= 4 rows,
//                          bf16 tiles of <= 2 rows (a warpgroup's 64-row products would be mostly idle);
//   paged_decode_wgmma.cu  warpgroup MMAs over a page once for all rows of the tile: bf16 and FP8
//                          tiles above those sizes (a row-warp per row would convert the same FP8
//                          page once per row: 8 rows measured 1.3-1.5 TB/s against 1.6-1.9).
// Both start with decode_pages.cuh's step 1 (the split's distinct pages). Paged prefill runs
// on the training forward instead (paged_prefill.cu); paged_attention hands prefill plans to it.
// Splits > 1: the wgmma kernel merges them itself (the last CTA of a row), the row-warp kernel
// writes normalised partials that merge_states combines by LSE; the plan picks the split count
// (src/core/decode_splits.h).
#include <algorithm>
#include <cstddef>
#include <mutex>

#include "attention_state.h"
#include "backend.h"
#include "core/check.h"
#include "core/decode_splits.h"
#include "cuda/device.cuh"
#include "cuda/inference/decode_pages.cuh"
#include "cuda/inference/quant.cuh"
#include "cuda/kv_source.cuh"
#include "cuda/plan_streams.h"
#include "cuda/tensor_map.h"

namespace msa::cuda {

namespace {

using namespace decode;
using model::kHeadDim;

// The measured crossovers above (docs/performance.md, run 25).
bool uses_rows_kernel(KvFormat format, int tile_rows) {
  switch (format) {
    case KvFormat::nvfp4: return true;
    case KvFormat::fp8_e4m3: return tile_rows <= 4;
    default: return tile_rows <= 2;
  }
}

// The wgmma kernel's instance for a tile of `rows` rows: R = the next power of two.
int rows_instance(int rows) { return rows <= 1 ? 1 : rows <= 2 ? 2 : rows <= 4 ? 4 : 8; }

}  // namespace

void paged_attention(const InferencePlan& plan, const PagedAttentionParams& p, const RunOptions& opt) {
  DeviceGuard guard(p.q.device.index);
  const PlanRun run(plan.streams, opt.stream);  // after the plan's uploads; its release after this run
  if (plan.phase == InferencePhase::prefill) return paged_prefill_attention(plan, p, opt);
  const cudaStream_t stream = as_stream(opt);
  const int64_t T = plan.total_q;
  if (T == 0) return;
  const Topology& topo = plan.topo;
  const PagedKvCache& c = p.kv;
  const int splits = plan.num_kv_splits;

  // Row alignment (16 bytes, block scales 8) was checked in src/core/inference.cpp.
  AttnArgs a{};
  a.q = p.q.as<const __nv_bfloat16>();
  a.q_s0 = p.q.stride[0];
  a.q_s1 = p.q.stride[1];
  a.kv = paged_kv_source(plan, c);
  // One TMA map per side (strides are 16-byte multiples: checked with the rows' alignment).
  const int row_bytes = c.format == KvFormat::bf16 ? kHeadDim * 2 : c.format == KvFormat::fp8_e4m3 ? kHeadDim : kNvfp4RowBytes;
  const int tile_rows = detail::decode_tile_rows(plan.q_len_per_req);
  const bool rows_kernel = uses_rows_kernel(c.format, tile_rows);  // its codes land swizzled
  const CUtensorMap k_map = paged_cache_map(a.kv.k, c.k.shape[0], c.k.shape[1], row_bytes, a.kv.k_page, a.kv.k_head,
                                            a.kv.k_row, "k_cache", rows_kernel);
  const CUtensorMap v_map = paged_cache_map(a.kv.v, c.v.shape[0], c.v.shape[1], row_bytes, a.kv.v_page, a.kv.v_head,
                                            a.kv.v_row, "v_cache", rows_kernel);
  a.topk = p.topk.as<const int32_t>();
  a.positions = static_cast<const int32_t*>(plan.positions.data());
  a.request = static_cast<const int32_t*>(plan.query_request.data());
  a.total_q = T;
  a.hq = topo.num_q_heads;
  a.rows_per_tile = tile_rows;
  a.splits = splits;
  a.softmax_scale = topo.attention_scale();
  a.out = p.out.data;
  a.out_f32 = p.out.dtype == DType::f32;
  a.lse = p.lse.as<float>();
  if (splits > 1) {
    a.part_out = static_cast<float*>(plan.partial_out.data());
    a.part_lse = static_cast<float*>(plan.partial_lse.data());
  }
  const dim3 grid(unsigned(ceil_div(T, a.rows_per_tile)), unsigned(topo.num_kv_heads), unsigned(splits));
  if (!rows_kernel) {  // the wgmma kernel merges the splits itself
    a.arrivals = static_cast<int32_t*>(plan.split_arrivals.data());
    detail::require(splits == 1 || a.arrivals, "paged_attention: the decode plan has no split arrival counts (build it on the CUDA device)");
    return launch_wgmma(c.format, a, k_map, v_map, grid, stream);
  }
  // Split s of a unit takes pages s * U / S .. of the U its tile's rows selected.
  const int64_t max_cta_pages = ceil_div(detail::decode_unit_pages(plan.max_seqlen_k, tile_rows), int64_t(splits));
  launch_rows(c.format, max_cta_pages, a, k_map, v_map, grid, stream);
  if (splits > 1) {
    const MergeStatesParams merge = split_merge_params(plan, p);
    cuda::merge_states(merge, opt);
  }
}

int64_t decode_attention_concurrency(int device, int q_len_per_req) {
  DeviceGuard guard(device);
  // Per-SM occupancy depends on the kernel and the architecture only (this build targets one),
  // so it is computed once per kernel instance; the SM count is per device.
  static std::mutex mutex;
  static int per_sm[4] = {0, 0, 0, 0};  // R = 1, 2, 4, 8
  const int R = rows_instance(detail::decode_tile_rows(q_len_per_req));
  int n = 0;
  {
    std::lock_guard<std::mutex> lock(mutex);
    int& cached = per_sm[R == 1 ? 0 : R == 2 ? 1 : R == 4 ? 2 : 3];
    if (cached == 0)
      cached = std::max(1, std::min(decode::wgmma_ctas_per_sm(R), decode::rows_ctas_per_sm()));
    n = cached;
  }
  return int64_t(sm_count()) * n;
}

}  // namespace msa::cuda
