// dflash::context_kv on CPU (docs/design.md 3.1): write the draft's context K/V of N tokens into every
// layer's paged cache.
//
// Precision follows dflash/ops/reference.py step by step:
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
#include "cpu/paged_cache.h"

#include <cstring>

namespace dflash::cpu::context_kv {
namespace {

// ---------------------------------------------------------------------------------------------
// Validation: csrc/checks.h (dflash/ops/checks.py), plus the layout this kernel needs, all before
// anything is written.
// ---------------------------------------------------------------------------------------------

// ---------------------------------------------------------------------------------------------
// Compute
// ---------------------------------------------------------------------------------------------

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
  const std::vector<float> w = float_values(weight);
  const T* xp = x.const_data_ptr<T>();
  const float* wp = w.data();
  T* cp = c.mutable_data_ptr<T>();
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> row(h);
    for (int64_t first = begin; first < end; first += block) {
      const int64_t last = std::min(end, first + block);
      const at::Tensor inv_rms =
          at::rsqrt(x.slice(0, first, last).to(at::kFloat).pow(2).mean(-1, /*keepdim=*/true) + eps);
      const float* rp = inv_rms.const_data_ptr<float>();
      for (int64_t t = first; t < last; ++t) {
        load_row(xp + t * h, row.data(), h);
        scale_row(row.data(), rp[t - first], wp, row.data(), h);
        at::vec::convert(row.data(), cp + t * h, h);
      }
    }
  });
  return c;
}

template <typename T>
void epilogue(const at::Tensor& kv, const std::vector<float>& k_norm_weight, int64_t layers,
              int64_t d, const at::Tensor& positions, const at::Tensor& cos_sin_cache,
              const at::Tensor& slot_mapping, at::TensorList key_caches,
              at::TensorList value_caches, double eps) {
  const int64_t n = kv.size(0);
  const int64_t hkv = key_caches[0].size(2);
  const int64_t head_row = hkv * d;  // one layer's K (or V) of one token
  const T* kvp = kv.const_data_ptr<T>();
  const float* wk = k_norm_weight.data();
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
    std::vector<T> k_rounded(d);
    for (int64_t t = begin; t < end; ++t) {
      if (!store[t]) continue;
      const float* cos = cos_sin + pos[t] * d;
      const float* sin = cos + d / 2;
      for (int64_t l = 0; l < layers; ++l) {
        const T* k_src = kvp + (t * layers + l) * 2 * head_row;
        const T* v_src = k_src + head_row;
        T* k_dst = kc[l].slot(slots[t]);
        T* v_dst = vc[l].slot(slots[t]);
        load_row(k_src, k.data(), head_row);
        for (int64_t h = 0; h < hkv; ++h) {
          norm_rope_head(k.data() + h * d, wk + l * d, cos, sin, d, feps);
          if (kc[l].dim_stride == 1) {
            at::vec::convert(k.data() + h * d, k_dst + h * kc[l].head_stride, d);
          } else {
            at::vec::convert(k.data() + h * d, k_rounded.data(), d);
            kc[l].store_head(k_rounded.data(), k_dst + h * kc[l].head_stride, d);
          }
          vc[l].store_head(v_src + h * d, v_dst + h * vc[l].head_stride, d);
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
                at::TensorList value_caches, double eps, bool /*check*/) {
  // The index checks below read host memory here: they always run (`check` spares a
  // device-to-host copy only on devices).
  checks::context_kv_meta(hidden, fc_weight, hidden_norm_weight, kv_weight, kv_bias, k_norm_weight,
                          positions, cos_sin_cache, slot_mapping, key_caches, value_caches, eps);
  const at::Tensor pos = positions.contiguous(), slots = slot_mapping.contiguous();
  checks::context_kv_values(pos.const_data_ptr<int64_t>(), slots.const_data_ptr<int64_t>(),
                            pos.numel(), cos_sin_cache.size(0), key_caches[0].size(0),
                            key_caches[0].size(1));
  // Any strides, head_dim included (CacheView::store_head): the caches are written in place in
  // whatever layout their owner reads.
  // The GEMMs and reductions below are internal: keep autograd out even for weights that
  // require grad.
  at::AutoDispatchBelowADInplaceOrView guard;
  // A strided `hidden` (no fc) is made row-major first; the reference reduces it in place, so
  // there c may differ from the reference by float32 summation order.
  const at::Tensor x = (fc_weight ? at::linear(hidden, *fc_weight) : hidden).contiguous();
  const std::vector<float> wk = float_values(k_norm_weight);
  const at::Tensor cs = cos_sin_cache.contiguous();
  DFLASH_DISPATCH_FLOATS(hidden.scalar_type(), "context_kv", [&] {
    const at::Tensor c = hidden_norm<scalar_t>(x, hidden_norm_weight, eps);
    const at::Tensor kv = at::linear(c, kv_weight, kv_bias).contiguous();
    epilogue<scalar_t>(kv, wk, k_norm_weight.size(0), k_norm_weight.size(1), pos, cs, slots,
                       key_caches, value_caches, eps);
  });
}

}  // namespace
}  // namespace dflash::cpu::context_kv

TORCH_LIBRARY_IMPL(dflash, CPU, m) {
  m.impl("context_kv", &dflash::cpu::context_kv::context_kv);
}
