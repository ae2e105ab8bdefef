// dflash::context_kv on CPU (SPEC 3.1): write the draft's context K/V of N tokens into every
// layer's paged cache.
//
// Precision follows dflash/reference.py step by step:
//   * both projections are the reference's own ATen calls (at::linear in the input dtype: MKL for
//     float32, oneDNN with AMX for bf16 where the CPU has it), so their outputs are bit-identical;
//   * the hidden RMSNorm is one parallel pass that takes each row's mean of squares from the
//     reference's own ATen reduction (the summation order fixes the float32 scale) and applies
//     scale and weight in the reference's order, so c is bit-identical too;
//   * everything after the K/V GEMM is ONE at::parallel_for over tokens that reads each token's
//     GEMM row once and, for every layer, normalizes K per head in float32, applies NeoX RoPE in
//     float32, rounds once and stores K and V straight into the caches. Only this float32 epilogue
//     may differ from the reference, in summation order (K within 1 ulp of the dtype; V exact).
#include "cpu/common.h"

#include <ATen/Dispatch.h>
#include <ATen/cpu/vec/functional.h>

#include <cmath>
#include <cstring>
#include <unordered_set>

#define CKV_CHECK(cond, ...) DFLASH_CHECK(cond, "context_kv", __VA_ARGS__)
// The dtypes checks::context_kv_meta admits: float32, bfloat16, float16.
#define CKV_DISPATCH(TYPE, ...)                                                   \
  AT_DISPATCH_SWITCH(TYPE, "context_kv", AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__) \
                     AT_DISPATCH_CASE_REDUCED_FLOATING_TYPES(__VA_ARGS__))

namespace dflash::context_kv {
namespace {

using at::vec::Vectorized;
using fVec = Vectorized<float>;

// Elements of work a thread must get before a pass goes parallel: waking pool threads costs tens
// of microseconds (far more on a busy machine), so small N runs on the calling thread.
constexpr int64_t kMinWorkPerThread = 1 << 18;

// ---------------------------------------------------------------------------------------------
// Validation: csrc/checks.h (dflash/checks.py), plus the layout this kernel needs, all before
// anything is written.
// ---------------------------------------------------------------------------------------------

// Kernel-only limit: the epilogue stores whole heads, so each cache needs a contiguous head_dim;
// every other stride is free (separate tensors, views of one stacked tensor, K/V interleaved).
void check_layout(at::TensorList key_caches, at::TensorList value_caches) {
  for (const auto& [name, caches] : {std::pair{"key_caches", key_caches},
                                     std::pair{"value_caches", value_caches}}) {
    for (size_t i = 0; i < caches.size(); ++i) {
      CKV_CHECK(caches[i].size(3) <= 1 || caches[i].stride(3) == 1, name, "[", i,
                "] has strides ", caches[i].strides(),
                "; the CPU kernel needs a contiguous head_dim (stride 1 in dim 3)");
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Compute
// ---------------------------------------------------------------------------------------------

// dst[0:n] = float(src[0:n])
template <typename T>
void load_row(const T* src, float* dst, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(dst, src, n * sizeof(float));
  } else {
    using bVec = Vectorized<T>;
    int64_t i = 0;
    for (; i + bVec::size() <= n; i += bVec::size()) {
      auto [lo, hi] = at::vec::convert_to_float<T>(bVec::loadu(src + i));
      lo.store(dst + i);
      hi.store(dst + i + fVec::size());
    }
    for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
  }
}

// c = dtype(rms_norm(x) * weight) for a row-major x [N, H], as ONE parallel pass over rows.
// Each block of rows takes mean(x^2) from the reference's own ATen ops: ATen reduces every row of
// a row-major tensor the same way whatever the number of rows, so the float32 scale rounds as in
// the reference. Scale and weight are then applied in the reference's order, making c, and with
// it the K/V GEMM's output, bit-identical. Blocks of fewer than GRAIN_SIZE elements keep the
// float32 temporaries in L2 and the nested ATen ops serial (ATen goes parallel from GRAIN_SIZE).
template <typename T>
at::Tensor hidden_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const int64_t n = x.size(0), h = x.size(1);
  const int64_t block =
      std::max<int64_t>(1, (at::internal::GRAIN_SIZE - 1) / std::max<int64_t>(h, 1));
  const int64_t grain = std::max<int64_t>(block, kMinWorkPerThread / std::max<int64_t>(h, 1));
  at::Tensor c = at::empty_like(x);
  const at::Tensor w = weight.to(at::kFloat).contiguous();
  const T* xp = x.const_data_ptr<T>();
  const float* wp = w.const_data_ptr<float>();
  T* cp = c.mutable_data_ptr<T>();
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> row(h);
    for (int64_t first = begin; first < end; first += block) {
      const int64_t last = std::min(end, first + block);
      const at::Tensor inv_rms = at::rsqrt(
          x.slice(0, first, last).to(at::kFloat).pow(2).mean(-1, /*keepdim=*/true) + eps);
      const float* rp = inv_rms.const_data_ptr<float>();
      for (int64_t t = first; t < last; ++t) {
        load_row(xp + t * h, row.data(), h);
        const fVec r(rp[t - first]);
        at::vec::map2([&](fVec v, fVec wv) { return v * r * wv; }, row.data(), row.data(), wp, h);
        at::vec::convert(row.data(), cp + t * h, h);
      }
    }
  });
  return c;
}

// k[0:d] (float32, in place) = rope(rms_norm(k) * weight): rotate-half pairs (i, i + d/2).
void norm_rope_head(float* k, const float* weight, const float* cos, const float* sin,
                    int64_t d, float eps) {
  const float sum_sq = at::vec::map_reduce_all<float>(
      [](fVec v) { return v * v; }, [](fVec a, fVec b) { return a + b; }, k, d);
  const fVec inv_rms(1.0f / std::sqrt(sum_sq / static_cast<float>(d) + eps));
  const int64_t half = d / 2;
  for (int64_t i = 0; i < half; i += fVec::size()) {
    const int count = static_cast<int>(std::min<int64_t>(fVec::size(), half - i));
    const fVec x1 = fVec::loadu(k + i, count) * inv_rms * fVec::loadu(weight + i, count);
    const fVec x2 =
        fVec::loadu(k + half + i, count) * inv_rms * fVec::loadu(weight + half + i, count);
    const fVec c = fVec::loadu(cos + i, count), s = fVec::loadu(sin + i, count);
    (x1 * c - x2 * s).store(k + i, count);
    (x2 * c + x1 * s).store(k + half + i, count);
  }
}

template <typename T>
struct CacheView {
  T* data;
  int64_t block_stride, slot_stride, head_stride;

  explicit CacheView(const at::Tensor& cache)
      : data(cache.mutable_data_ptr<T>()), block_stride(cache.stride(0)),
        slot_stride(cache.stride(1)), head_stride(cache.stride(2)) {}
  T* slot(int64_t block, int64_t offset) const {
    return data + block * block_stride + offset * slot_stride;
  }
};

// Tokens that store: slot != -1, and no later token maps to the same slot (the reference writes
// tokens in order, so the last one wins; skipping the others keeps the parallel pass race-free).
std::vector<uint8_t> tokens_to_store(const int64_t* slots, int64_t n) {
  std::vector<uint8_t> store(n, 0);
  std::unordered_set<int64_t> taken;
  taken.reserve(n);
  for (int64_t t = n - 1; t >= 0; --t) store[t] = slots[t] != -1 && taken.insert(slots[t]).second;
  return store;
}

template <typename T>
void epilogue(const at::Tensor& kv, const at::Tensor& k_norm_weight, const at::Tensor& positions,
              const at::Tensor& cos_sin_cache, const at::Tensor& slot_mapping,
              at::TensorList key_caches, at::TensorList value_caches, double eps) {
  const int64_t n = kv.size(0), layers = k_norm_weight.size(0), d = k_norm_weight.size(1);
  const int64_t block_size = key_caches[0].size(1), hkv = key_caches[0].size(2);
  const int64_t head_row = hkv * d;  // one layer's K (or V) of one token
  const T* kvp = kv.const_data_ptr<T>();
  const float* wk = k_norm_weight.const_data_ptr<float>();
  const float* cos_sin = cos_sin_cache.const_data_ptr<float>();
  const int64_t* pos = positions.const_data_ptr<int64_t>();
  const int64_t* slots = slot_mapping.const_data_ptr<int64_t>();
  std::vector<CacheView<T>> kc, vc;
  for (int64_t l = 0; l < layers; ++l) {
    kc.emplace_back(key_caches[l]);
    vc.emplace_back(value_caches[l]);
  }
  const std::vector<uint8_t> store = tokens_to_store(slots, n);
  const float feps = static_cast<float>(eps);

  const int64_t grain =
      std::max<int64_t>(1, kMinWorkPerThread / std::max<int64_t>(layers * head_row, 1));
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> k(head_row);
    for (int64_t t = begin; t < end; ++t) {
      if (!store[t]) continue;
      const int64_t block = slots[t] / block_size, offset = slots[t] % block_size;
      const float* cos = cos_sin + pos[t] * d;
      const float* sin = cos + d / 2;
      for (int64_t l = 0; l < layers; ++l) {
        const T* k_src = kvp + (t * layers + l) * 2 * head_row;
        const T* v_src = k_src + head_row;
        T* k_dst = kc[l].slot(block, offset);
        T* v_dst = vc[l].slot(block, offset);
        load_row(k_src, k.data(), head_row);
        for (int64_t h = 0; h < hkv; ++h) {
          norm_rope_head(k.data() + h * d, wk + l * d, cos, sin, d, feps);
          at::vec::convert(k.data() + h * d, k_dst + h * kc[l].head_stride, d);
          std::memcpy(v_dst + h * vc[l].head_stride, v_src + h * d, d * sizeof(T));
        }
      }
    }
  });
}

void context_kv(const at::Tensor& hidden, const std::optional<at::Tensor>& fc_weight,
                const at::Tensor& hidden_norm_weight, const at::Tensor& kv_weight,
                const std::optional<at::Tensor>& kv_bias, const at::Tensor& k_norm_weight,
                const at::Tensor& positions, const at::Tensor& cos_sin_cache,
                const at::Tensor& slot_mapping, at::TensorList key_caches,
                at::TensorList value_caches, double eps) {
  checks::context_kv_meta(hidden, fc_weight, hidden_norm_weight, kv_weight, kv_bias,
                          k_norm_weight, positions, cos_sin_cache, slot_mapping, key_caches,
                          value_caches, eps);
  const at::Tensor pos = positions.contiguous(), slots = slot_mapping.contiguous();
  checks::context_kv_values(pos.const_data_ptr<int64_t>(), slots.const_data_ptr<int64_t>(),
                            pos.numel(), cos_sin_cache.size(0), key_caches[0].size(0),
                            key_caches[0].size(1));
  check_layout(key_caches, value_caches);

  // The GEMMs and reductions below are internal: keep autograd out even for weights that
  // require grad.
  at::AutoDispatchBelowADInplaceOrView guard;
  // A strided `hidden` (no fc) is made row-major first; the reference reduces it in place, so
  // there c may differ from the reference by float32 summation order.
  const at::Tensor x = (fc_weight ? at::linear(hidden, *fc_weight) : hidden).contiguous();
  const at::Tensor wk = k_norm_weight.to(at::kFloat).contiguous();
  const at::Tensor cs = cos_sin_cache.contiguous();
  CKV_DISPATCH(hidden.scalar_type(), [&] {
    const at::Tensor c = hidden_norm<scalar_t>(x, hidden_norm_weight, eps);
    const at::Tensor kv = at::linear(c, kv_weight, kv_bias).contiguous();
    epilogue<scalar_t>(kv, wk, pos, cs, slots, key_caches, value_caches, eps);
  });
}

}  // namespace
}  // namespace dflash::context_kv

TORCH_LIBRARY_IMPL(dflash, CPU, m) { m.impl("context_kv", &dflash::context_kv::context_kv); }
