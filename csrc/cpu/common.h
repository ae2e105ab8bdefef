// Helpers shared by the CPU kernels in this folder. Each kernel .cpp is compiled once per CPU
// capability (see setup.py); keep file-local helpers in an anonymous namespace.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "checks.h"

// The float dtypes the ops admit (checks::kFloats): float32, bfloat16, float16.
#define DFLASH_DISPATCH_FLOATS(TYPE, NAME, ...)                \
  AT_DISPATCH_SWITCH(TYPE, NAME,                               \
                     AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__) \
                         AT_DISPATCH_CASE_REDUCED_FLOATING_TYPES(__VA_ARGS__))

namespace dflash::cpu {

// oneDNN's runtime ISA limit (ONEDNN_MAX_CPU_ISA, e.g. AVX512_CORE), upper-cased, "" when unset.
// It hides instruction sets from oneDNN's GEMMs; the kernels that pick a path by the CPU's flags
// honour it too, so a host without those instructions can be studied on one that has them.
inline std::string isa_limit() {
  const char* limit = std::getenv("ONEDNN_MAX_CPU_ISA");
  std::string isa(limit == nullptr ? "" : limit);
  std::transform(isa.begin(), isa.end(), isa.begin(),
                 [](unsigned char c) { return static_cast<char>(std::toupper(c)); });
  return isa;
}

// Whether oneDNN's ISA limit leaves a CPU's matrix engine (AMX) usable: no limit, or an AMX one.
inline bool isa_limit_allows_amx() {
  const std::string isa = isa_limit();
  return isa.empty() || isa == "ALL" || isa == "DEFAULT" || isa.find("AMX") != std::string::npos;
}

// Whether the AVX-512 build may use VDPBF16PS: the CPU has it and oneDNN's ISA limit admits it
// (the limits host.BF16_DOT_ISA_LIMITS lists: the AMX ones and the two bf16 ones), so
// `ONEDNN_MAX_CPU_ISA=AVX512_CORE` runs a host without bf16 units on one that has them.
inline bool has_bf16_dot_products() {
#if defined(CPU_CAPABILITY_AVX512)
  static const bool has = [] {
    const std::string isa = isa_limit();
    return (isa_limit_allows_amx() || isa == "AVX512_CORE_BF16" || isa == "AVX512_CORE_FP16") &&
           __builtin_cpu_supports("avx512bf16") != 0;
  }();
  return has;
#else
  return false;
#endif
}

// Elements of work a thread must get before a pass goes parallel: waking pool threads costs tens
// of microseconds (far more on a busy machine), so small calls run on the calling thread.
constexpr int64_t kMinWorkPerThread = 1 << 18;

// Asks for the cache line `ahead` bytes past `p` in L2 (an address that may lie past the end of
// p's array: a prefetch faults on nothing, and it is formed as an integer). The GEMM kernels ask
// for the place in the next tile of their weight that they read in the current one: the current
// tile's later blocks of rows read it from cache and would leave the memory bus idle, so the next
// tile's stream overlaps their arithmetic (4-16 rows measured 9-27% faster on Zen 4).
inline void prefetch_to_l2(const void* p, int64_t ahead) {
  __builtin_prefetch(reinterpret_cast<const void*>(reinterpret_cast<uintptr_t>(p) + ahead), 0, 2);
}

// dst[0:n] = float(src[0:n])
template <typename T>
inline void load_row(const T* src, float* dst, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(dst, src, n * sizeof(float));
  } else {
    using bVec = at::vec::Vectorized<T>;
    using fVec = at::vec::Vectorized<float>;
    int64_t i = 0;
    for (; i + bVec::size() <= n; i += bVec::size()) {
      auto [lo, hi] = at::vec::convert_to_float<T>(bVec::loadu(src + i));
      lo.store(dst + i);
      hi.store(dst + i + fVec::size());
    }
    for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
  }
}

// Scratch floats a row pass needs for `n` values of T (as_float's): none for float, read in place.
template <typename T>
constexpr int64_t scratch_for(int64_t n) {
  return std::is_same_v<T, float> ? 0 : n;
}

// src[0:n] as float32: src itself for float, else converted into `scratch`.
template <typename T>
const float* as_float(const T* src, float* scratch, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    return src;
  } else {
    load_row(src, scratch, n);
    return scratch;
  }
}

// A small tensor's values as float32 (a norm weight: a few KB), converted without an ATen call,
// which would cost more than the op that needs them.
inline std::vector<float> float_values(const at::Tensor& t) {
  const at::Tensor c = t.contiguous();
  std::vector<float> out(c.numel());
  DFLASH_DISPATCH_FLOATS(c.scalar_type(), "float_values",
                         [&] { load_row(c.const_data_ptr<scalar_t>(), out.data(), c.numel()); });
  return out;
}

// 1 / sqrt(mean(x[0:n]^2) + eps), RMSNorm's float32 scale of one row.
inline float inv_rms(const float* x, int64_t n, float eps) {
  using fVec = at::vec::Vectorized<float>;
  const float sum_sq = at::vec::map_reduce_all<float>([](fVec v) { return v * v; },
                                                      [](fVec a, fVec b) { return a + b; }, x, n);
  return 1.0f / std::sqrt(sum_sq / static_cast<float>(n) + eps);
}

// out[0:n] = x[0:n] * scale * weight[0:n] (out may be x)
inline void scale_row(const float* x, float scale, const float* weight, float* out, int64_t n) {
  using fVec = at::vec::Vectorized<float>;
  const fVec s(scale);
  at::vec::map2([&](fVec v, fVec w) { return v * s * w; }, out, x, weight, n);
}

// NeoX (rotate-half) RoPE of one head x[0:d] in place: pairs (i, i + d/2) turn by the angle whose
// cosine and sine are cos[i], sin[i].
inline void rope_head(float* x, const float* cos, const float* sin, int64_t d) {
  using fVec = at::vec::Vectorized<float>;
  const int64_t half = d / 2;
  for (int64_t i = 0; i < half; i += fVec::size()) {
    const int count = static_cast<int>(std::min<int64_t>(fVec::size(), half - i));
    const fVec x1 = fVec::loadu(x + i, count), x2 = fVec::loadu(x + half + i, count);
    const fVec c = fVec::loadu(cos + i, count), s = fVec::loadu(sin + i, count);
    (x1 * c - x2 * s).store(x + i, count);
    (x2 * c + x1 * s).store(x + half + i, count);
  }
}

// x[0:d] (float32, in place) = rope(rms_norm(x) * weight), one head.
inline void norm_rope_head(float* x, const float* weight, const float* cos, const float* sin,
                           int64_t d, float eps) {
  scale_row(x, inv_rms(x, d, eps), weight, x, d);
  rope_head(x, cos, sin, d);
}

// The GEMM kernels' last step for a tile of columns: out[m, col0 : col0 + cols] (rows of n) =
// result[m, 0 : cols] (rows of ld) + bias[col0 : col0 + cols] (if any), in out's dtype.
template <typename T>
inline void store_columns(float* result, int64_t rows, int64_t ld, int64_t cols,
                          const std::vector<float>& bias, int64_t col0, T* out, int64_t n) {
  using fVec = at::vec::Vectorized<float>;
  for (int64_t m = 0; m < rows; ++m) {
    float* r = result + m * ld;
    if (!bias.empty())
      at::vec::map2([](fVec a, fVec c) { return a + c; }, r, r, bias.data() + col0, cols);
    at::vec::convert(r, out + m * n + col0, cols);
  }
}

// f(row, scratch) for rows [0, n) of `width` elements each, in parallel when the work is large;
// `scratch` holds `scratch_floats` uninitialized floats per thread.
template <typename F>
void for_each_row(int64_t n, int64_t width, int64_t scratch_floats, const F& f) {
  const int64_t grain = std::max<int64_t>(1, kMinWorkPerThread / std::max<int64_t>(width, 1));
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    const std::unique_ptr<float[]> scratch(new float[std::max<int64_t>(scratch_floats, 1)]);
    for (int64_t r = begin; r < end; ++r) f(r, scratch.get());
  });
}

}  // namespace dflash::cpu
