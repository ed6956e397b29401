#include "bench_common.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "msa/error.h"

namespace msa::tool {

namespace {

constexpr int kPage = 128, kDim = 128;
constexpr int64_t kSlabBytes = int64_t(64) << 20;

}  // namespace

const char* format_label(KvFormat f) {
  switch (f) {
    case KvFormat::bf16: return "bf16";
    case KvFormat::fp8_e4m3: return "fp8";
    case KvFormat::nvfp4: return "nvfp4";
  }
  return "?";
}

std::vector<std::string> split_list(const std::string& text) {
  std::vector<std::string> items;
  size_t start = 0;
  while (true) {
    const size_t comma = text.find(',', start);
    items.push_back(text.substr(start, comma == std::string::npos ? std::string::npos : comma - start));
    if (comma == std::string::npos) return items;
    start = comma + 1;
  }
}

std::vector<KvFormat> parse_formats(const std::string& text) {
  std::vector<KvFormat> formats;
  for (const std::string& item : split_list(text)) {
    KvFormat f = KvFormat::bf16;
    if (item == "bf16") f = KvFormat::bf16;
    else if (item == "fp8") f = KvFormat::fp8_e4m3;
    else if (item == "nvfp4") f = KvFormat::nvfp4;
    else invalid("--formats must be a comma-separated list of bf16, fp8, nvfp4, got '" + item + "'");
    if (std::find(formats.begin(), formats.end(), f) == formats.end()) formats.push_back(f);
  }
  return formats;
}

void RandomBytes::fill(StTensor& t) {
  if (t.dtype == DType::bf16) {
    auto* p = reinterpret_cast<uint16_t*>(t.bytes.data());
    for (int64_t i = 0; i < t.numel(); ++i) {
      const uint64_t r = next();
      // sign, exponent 2^-7 .. 2^0, random mantissa
      p[i] = uint16_t(((r >> 63) << 15) | ((120 + (r >> 40) % 7) << 7) | (r & 0x7f));
    }
  } else if (t.dtype == DType::u8) {
    for (auto& b : t.bytes) b = uint8_t(next() >> 56);
  } else {
    for (auto& b : t.bytes) b = uint8_t(next() >> 56) & 0xf7;  // no 0x7f / 0xff
  }
}

void RandomBytes::fill_block_scales(StTensor& t) {
  for (auto& b : t.bytes) {
    const uint64_t x = next();
    b = uint8_t(((4 + (x >> 60) % 2) << 3) | (x & 7));
  }
}

PagedKvCache PagePool::cache(KvFormat f) const {
  PagedKvCache c;
  c.format = f;
  if (f == KvFormat::bf16) {
    c.k = k_bf16.view();
    c.v = v_bf16.view();
  } else if (f == KvFormat::fp8_e4m3) {
    c.k = k_fp8.view();
    c.v = v_fp8.view();
    c.k_scale = scale.view();
    c.v_scale = scale.view();
  } else {
    c.k = k_fp4.view();
    c.v = v_fp4.view();
    c.k_block_scale = k_sf.view();
    c.v_block_scale = v_sf.view();
  }
  return c;
}

PagePool fill_pool(DeviceArena& arena, int64_t pages, int Hkv, const std::vector<KvFormat>& formats) {
  auto uses = [&](KvFormat f) { return std::find(formats.begin(), formats.end(), f) != formats.end(); };
  // page_shape: the dimensions after the page one.
  auto upload = [&](const std::string& name, DType dtype, const std::vector<int64_t>& page_shape, uint64_t seed,
                    bool scales = false) {
    std::vector<int64_t> shape = {pages};
    shape.insert(shape.end(), page_shape.begin(), page_shape.end());
    Buffer pool = arena.allocate(dtype, shape);
    const int64_t page_bytes = pool.bytes() / pages;
    const int64_t slab_pages = std::max<int64_t>(1, kSlabBytes / page_bytes);
    RandomBytes random(seed);
    for (int64_t first = 0; first < pages; first += slab_pages) {
      shape[0] = std::min(slab_pages, pages - first);
      StTensor slab = make_tensor(name, dtype, shape);
      if (scales) random.fill_block_scales(slab);
      else random.fill(slab);
      copy(slab.view(), pool.slice(first * page_bytes, dtype, shape).view());
    }
    return pool;
  };
  PagePool p;
  p.pages = pages;
  p.index_k = upload("ik", DType::bf16, {kPage, kDim}, 3);
  if (uses(KvFormat::bf16)) {
    p.k_bf16 = upload("k", DType::bf16, {Hkv, kPage, kDim}, 1);
    p.v_bf16 = upload("v", DType::bf16, {Hkv, kPage, kDim}, 2);
  }
  if (uses(KvFormat::fp8_e4m3)) {
    p.k_fp8 = upload("k8", DType::f8e4m3, {Hkv, kPage, kDim}, 4);
    p.v_fp8 = upload("v8", DType::f8e4m3, {Hkv, kPage, kDim}, 5);
    StTensor sc = make_tensor("scale", DType::f32, {1});
    *reinterpret_cast<float*>(sc.bytes.data()) = 0.05f;
    p.scale = arena.upload(sc.view());
  }
  if (uses(KvFormat::nvfp4)) {
    p.k_fp4 = upload("k4", DType::u8, {Hkv, kPage, kDim / 2}, 6);
    p.v_fp4 = upload("v4", DType::u8, {Hkv, kPage, kDim / 2}, 7);
    p.k_sf = upload("k4sf", DType::f8e4m3, {Hkv, kPage, kDim / 16}, 8, true);
    p.v_sf = upload("v4sf", DType::f8e4m3, {Hkv, kPage, kDim / 16}, 9, true);
  }
  return p;
}

void invalid(const std::string& message) { throw Error(ErrorKind::invalid_argument, message); }

std::string fixed(double value, int decimals) {
  char text[64];
  std::snprintf(text, sizeof text, "%.*f", decimals, value);
  return text;
}

const char* timing_label(bool gpu) { return gpu ? "CUDA events on one stream" : "wall clock"; }

std::string tflops_cell(double tflops) {
  if (!(tflops > 0)) return "-";
  return fixed(tflops, tflops >= 1 ? 1 : std::clamp(2 - int(std::floor(std::log10(tflops))), 1, 15));
}

}  // namespace msa::tool
