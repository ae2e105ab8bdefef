// The decoder layer's small ops on CPU: rms_norm, add_rms_norm, silu_and_mul, rope and
// qkv_rope_cache (the attention's input: heads split out of the fused QKV projection, q/k norm,
// RoPE and the K/V cache write).
//
// Why they exist: in a decode step these tensors hold a few KB, so what costs is the number of
// ATen calls, not the arithmetic: each call after a weight-streaming GEMM starts with cold caches.
// torch's RMSNorm alone is ~8 calls (upcast, pow, mean, add, rsqrt, two muls, downcast), NeoX RoPE
// ~10, the attention's input ~12; here each is one call and one pass over the rows.
//
// Precision follows dflash/ops/reference.py: float32 math, one rounding to the dtype per output (the
// residual sum of add_rms_norm is rounded before it is normalized, as `x + residual` in the dtype
// would be). Every row is computed the same way whatever the number of rows in the call, so a
// 16-token verification row equals the 1-token decode of that token bit for bit.
#include "cpu/common.h"
#include "cpu/paged_cache.h"

namespace dflash::cpu::layer_ops {
namespace {

using fVec = at::vec::Vectorized<float>;

// Where a float32 result for dst goes before its one rounding: dst itself for float.
template <typename T>
float* result_buffer(T* dst, float* scratch) {
  if constexpr (std::is_same_v<T, float>) {
    return dst;
  } else {
    return scratch;
  }
}

template <typename T>
void store(const float* result, T* dst, int64_t n) {
  if constexpr (!std::is_same_v<T, float>) at::vec::convert(result, dst, n);
}

// dst[0:h] = T(rms_norm(x) * w); `scratch` may be x.
template <typename T>
void norm_row(const float* x, const float* w, float eps, int64_t h, float* scratch, T* dst) {
  float* out = result_buffer(dst, scratch);
  scale_row(x, inv_rms(x, h, eps), w, out, h);
  store(out, dst, h);
}

std::pair<int64_t, int64_t> rows_of(const at::Tensor& x) {
  const int64_t h = x.size(-1);
  return {x.numel() / h, h};
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  checks::rms_norm_meta("rms_norm", x, weight, eps);
  const at::Tensor xc = x.contiguous();
  const std::vector<float> w = float_values(weight);
  at::Tensor out = at::empty_like(xc);
  const auto [n, h] = rows_of(xc);
  const float* wp = w.data();
  DFLASH_DISPATCH_FLOATS(x.scalar_type(), "rms_norm", [&] {
    const scalar_t* xp = xc.const_data_ptr<scalar_t>();
    scalar_t* op = out.mutable_data_ptr<scalar_t>();
    for_each_row(n, h, scratch_for<scalar_t>(h), [&](int64_t r, float* scratch) {
      norm_row(as_float(xp + r * h, scratch, h), wp, static_cast<float>(eps), h, scratch,
               op + r * h);
    });
  });
  return out;
}

// (rms_norm(residual + x), residual + x): the sum is rounded to the dtype first.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  checks::add_rms_norm_meta(x, residual, weight, eps);
  const at::Tensor xc = x.contiguous(), rc = residual.contiguous();
  const std::vector<float> w = float_values(weight);
  at::Tensor out = at::empty_like(xc), sum = at::empty_like(xc);
  const auto [n, h] = rows_of(xc);
  const float* wp = w.data();
  DFLASH_DISPATCH_FLOATS(x.scalar_type(), "add_rms_norm", [&] {
    const scalar_t* xp = xc.const_data_ptr<scalar_t>();
    const scalar_t* rp = rc.const_data_ptr<scalar_t>();
    scalar_t *op = out.mutable_data_ptr<scalar_t>(), *sp = sum.mutable_data_ptr<scalar_t>();
    for_each_row(n, h, scratch_for<scalar_t>(2 * h), [&](int64_t r, float* scratch) {
      const float* a = as_float(xp + r * h, scratch, h);
      const float* b = as_float(rp + r * h, scratch + h, h);
      float* s = result_buffer(sp + r * h, scratch);
      at::vec::map2([](fVec u, fVec v) { return u + v; }, s, a, b, h);
      store(s, sp + r * h, h);
      norm_row(as_float(sp + r * h, scratch, h), wp, static_cast<float>(eps), h, scratch,
               op + r * h);
    });
  });
  return {out, sum};
}

// [..., 2I] (gate | up) -> [..., I] = silu(gate) * up
at::Tensor silu_and_mul(const at::Tensor& x) {
  checks::silu_and_mul_meta(x);
  const at::Tensor xc = x.contiguous();
  const auto [n, width] = rows_of(xc);
  const int64_t half = width / 2;
  std::vector<int64_t> shape = xc.sizes().vec();
  shape.back() = half;
  at::Tensor out = at::empty(shape, xc.options());
  DFLASH_DISPATCH_FLOATS(x.scalar_type(), "silu_and_mul", [&] {
    const scalar_t* xp = xc.const_data_ptr<scalar_t>();
    scalar_t* op = out.mutable_data_ptr<scalar_t>();
    for_each_row(n, width, scratch_for<scalar_t>(width), [&](int64_t r, float* scratch) {
      const float* gate = as_float(xp + r * width, scratch, half);
      const float* up = as_float(xp + r * width + half, scratch + half, half);
      float* o = result_buffer(op + r * half, scratch);
      at::vec::map2([](fVec g, fVec u) { return g / (fVec(1.0f) + g.neg().exp()) * u; }, o, gate,
                    up, half);
      store(o, op + r * half, half);
    });
  });
  return out;
}

// x [T, H, D] -> NeoX RoPE of every head of token t by cos_sin[t] = [cos(D/2) | sin(D/2)]
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos_sin) {
  checks::rope_meta(x, cos_sin);
  const at::Tensor xc = x.contiguous(), cs = cos_sin.contiguous();
  at::Tensor out = at::empty_like(xc);
  const int64_t t = xc.size(0), heads = xc.size(1), d = xc.size(2);
  const float* csp = cs.const_data_ptr<float>();
  DFLASH_DISPATCH_FLOATS(x.scalar_type(), "rope", [&] {
    const scalar_t* xp = xc.const_data_ptr<scalar_t>();
    scalar_t* op = out.mutable_data_ptr<scalar_t>();
    for_each_row(t, heads * d, scratch_for<scalar_t>(d), [&](int64_t r, float* scratch) {
      const float* cos = csp + r * d;
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t offset = (r * heads + h) * d;
        float* head = result_buffer(op + offset, scratch);
        load_row(xp + offset, head, d);
        rope_head(head, cos, cos + d / 2, d);
        store(head, op + offset, d);
      }
    });
  });
  return out;
}

// qkv [T, (Hq + 2 Hkv) D] -> q [T, Hq, D], k, v [T, Hkv, D]: q and k heads RMSNormed (when a
// weight is given) and rotated, all rounded once; k and v also stored at slot_mapping (-1: skip).
std::tuple<at::Tensor, at::Tensor, at::Tensor> qkv_rope_cache(
    const at::Tensor& qkv, const std::optional<at::Tensor>& q_norm_weight,
    const std::optional<at::Tensor>& k_norm_weight, const at::Tensor& cos_sin,
    const at::Tensor& key_cache, const at::Tensor& value_cache, const at::Tensor& slot_mapping,
    int64_t num_heads, double eps, bool /*check*/) {
  // The slots are read here anyway: they are always checked (as in context_kv).
  checks::qkv_rope_cache_meta(qkv, q_norm_weight, k_norm_weight, cos_sin, key_cache, value_cache,
                              slot_mapping, num_heads, eps);
  const at::Tensor slots = slot_mapping.contiguous();
  const int64_t* sp = slots.const_data_ptr<int64_t>();
  const int64_t t = qkv.size(0), hq = num_heads, hkv = key_cache.size(2), d = key_cache.size(3);
  checks::slot_mapping_values("qkv_rope_cache", sp, t, key_cache.size(0), key_cache.size(1));
  check_cache_layout("qkv_rope_cache", "key_cache", key_cache);
  check_cache_layout("qkv_rope_cache", "value_cache", value_cache);

  const at::Tensor src = qkv.contiguous(), cs = cos_sin.contiguous();
  const auto norm_weight = [](const std::optional<at::Tensor>& w) {
    return w ? float_values(*w) : std::vector<float>();
  };
  const std::vector<float> wq = norm_weight(q_norm_weight), wk = norm_weight(k_norm_weight);
  at::Tensor q = at::empty({t, hq, d}, qkv.options()), k = at::empty({t, hkv, d}, qkv.options()),
             v = at::empty({t, hkv, d}, qkv.options());
  const std::vector<uint8_t> store = tokens_to_store(sp, t);
  const int64_t width = (hq + 2 * hkv) * d;
  const float feps = static_cast<float>(eps);
  const float* csp = cs.const_data_ptr<float>();
  DFLASH_DISPATCH_FLOATS(qkv.scalar_type(), "qkv_rope_cache", [&] {
    const CacheView<scalar_t> kc(key_cache), vc(value_cache);
    const scalar_t* xp = src.const_data_ptr<scalar_t>();
    scalar_t *qp = q.mutable_data_ptr<scalar_t>(), *kp = k.mutable_data_ptr<scalar_t>(),
             *vp = v.mutable_data_ptr<scalar_t>();
    for_each_row(t, width, d, [&](int64_t r, float* head) {
      const float* cos = csp + r * d;
      const scalar_t* row = xp + r * width;
      for (int64_t h = 0; h < hq + hkv; ++h) {
        const bool is_q = h < hq;
        const std::vector<float>& w = is_q ? wq : wk;
        load_row(row + h * d, head, d);
        if (!w.empty()) {
          norm_rope_head(head, w.data(), cos, cos + d / 2, d, feps);
        } else {
          rope_head(head, cos, cos + d / 2, d);
        }
        at::vec::convert(head, is_q ? qp + (r * hq + h) * d : kp + (r * hkv + h - hq) * d, d);
      }
      std::memcpy(vp + r * hkv * d, row + (hq + hkv) * d, hkv * d * sizeof(scalar_t));
      if (!store[r]) return;
      scalar_t *k_dst = kc.slot(sp[r]), *v_dst = vc.slot(sp[r]);
      for (int64_t h = 0; h < hkv; ++h) {
        std::memcpy(k_dst + h * kc.head_stride, kp + (r * hkv + h) * d, d * sizeof(scalar_t));
        std::memcpy(v_dst + h * vc.head_stride, vp + (r * hkv + h) * d, d * sizeof(scalar_t));
      }
    });
  });
  return {q, k, v};
}

}  // namespace
}  // namespace dflash::cpu::layer_ops

TORCH_LIBRARY_IMPL(dflash, CPU, m) {
  m.impl("rms_norm", &dflash::cpu::layer_ops::rms_norm);
  m.impl("add_rms_norm", &dflash::cpu::layer_ops::add_rms_norm);
  m.impl("silu_and_mul", &dflash::cpu::layer_ops::silu_and_mul);
  m.impl("rope", &dflash::cpu::layer_ops::rope);
  m.impl("qkv_rope_cache", &dflash::cpu::layer_ops::qkv_rope_cache);
}
