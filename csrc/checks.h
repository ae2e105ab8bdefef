// Input checks of the ops, shared by the CPU kernels (csrc/cpu) and the Ascend host code
// (csrc/npu/ascend_host.h): the rules, order and messages of dflash/ops/checks.py, so one bad-input
// test suite covers every implementation. Value checks read host memory; the NPU host copies the
// small index tensors to the CPU first.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <optional>
#include <string>
#include <utility>
#include <vector>

// Input errors raise ValueError("<op>: <message>").
#define DFLASH_CHECK(cond, op, ...) TORCH_CHECK_VALUE((cond), op, ": ", __VA_ARGS__)

namespace dflash {

// "[2, 3, 4]", as Python prints a shape.
inline std::string shape_str(const at::Tensor& t) {
  std::string s = "[";
  for (int64_t i = 0; i < t.dim(); ++i) s += (i ? ", " : "") + std::to_string(t.size(i));
  return s + "]";
}

// "torch.float32", as Python prints a dtype.
inline std::string dtype_str(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return "torch.float32";
    case at::kBFloat16:
      return "torch.bfloat16";
    case at::kHalf:
      return "torch.float16";
    case at::kLong:
      return "torch.int64";
    case at::kInt:
      return "torch.int32";
    case at::kByte:
      return "torch.uint8";
    case at::kChar:
      return "torch.int8";
    case at::kBool:
      return "torch.bool";
    case at::kDouble:
      return "torch.float64";
    default:
      return std::string("torch.") + c10::toString(t);
  }
}

// A float in messages: 9 significant digits (round-trips a float32), as checks.number formats it.
inline std::string number(double x) {
  if (std::isnan(x)) return "nan";  // printf would write "-nan" for some
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.9g", x);
  return buf;
}

// checks.check_tensor: `t` has one of `dtypes`, rank `dim`, the sizes `shape` lists for its leading
// dims (-1 = any) and, when given, `device`.
inline void check_tensor(const char* op, const std::string& name, const at::Tensor& t,
                         c10::ArrayRef<at::ScalarType> dtypes, int64_t dim,
                         c10::ArrayRef<int64_t> shape = {},
                         const std::optional<at::Device>& device = std::nullopt) {
  if (std::find(dtypes.begin(), dtypes.end(), t.scalar_type()) == dtypes.end()) {
    std::string expected;
    for (auto d : dtypes) expected += (expected.empty() ? "" : " or ") + dtype_str(d);
    TORCH_CHECK_VALUE(false, op, ": ", name, " has dtype ", dtype_str(t.scalar_type()),
                      ", expected ", expected);
  }
  TORCH_CHECK_VALUE(t.dim() == dim, op, ": ", name, " must be ", dim, "-D, got shape ",
                    shape_str(t));
  for (size_t i = 0; i < shape.size() && static_cast<int64_t>(i) < t.dim(); ++i) {
    TORCH_CHECK_VALUE(shape[i] < 0 || t.size(i) == shape[i], op, ": ", name, " has shape ",
                      shape_str(t), ", expected size ", shape[i], " in dim ", i);
  }
  TORCH_CHECK_VALUE(!device || t.device() == *device, op, ": ", name, " is on ", t.device().str(),
                    ", expected ", device ? device->str() : "");
}

namespace checks {

constexpr int64_t kAny = -1;
inline const std::initializer_list<at::ScalarType> kFloats{at::kFloat, at::kBFloat16, at::kHalf};

// ------------------------------------------------------------------------------ philox_bits
inline void philox_bits_meta(const at::Tensor& seeds, const at::Tensor& offsets, int64_t stream,
                             int64_t rows, int64_t n) {
  constexpr const char* op = "philox_bits";
  check_tensor(op, "seeds", seeds, {at::kLong}, 2, {kAny, 2});
  check_tensor(op, "offsets", offsets, {at::kLong}, 1, {seeds.size(0)}, seeds.device());
  DFLASH_CHECK(stream >= 0 && stream < (int64_t{1} << 32), op, "stream must be in [0, 2**32), got ",
               stream);
  DFLASH_CHECK(rows >= 0 && n >= 0, op, "rows and n must be non-negative, got ", rows, " and ", n);
  // counter words 3 and 0 (four elements a word)
  DFLASH_CHECK(rows <= (int64_t{1} << 32) && n <= (int64_t{1} << 34), op,
               "rows must be at most 2**32 and n at most 2**34, got ", rows, " and ", n);
}

inline void philox_bits_values(const int64_t* values, int64_t count, const char* name) {
  for (int64_t i = 0; i < count; ++i)
    DFLASH_CHECK(values[i] >= 0 && values[i] < (int64_t{1} << 32), "philox_bits", name,
                 " must hold 32-bit words in [0, 2**32), got ", values[i]);
}

// ------------------------------------------------------------------------- rejection_sample

inline void rejection_sample_meta(const at::Tensor& draft_token_ids,
                                  const std::optional<at::Tensor>& draft_probs,
                                  const at::Tensor& target_probs, const at::Tensor& is_greedy,
                                  const at::Tensor& uniform, const at::Tensor& exponential) {
  constexpr const char* op = "rejection_sample";
  check_tensor(op, "draft_token_ids", draft_token_ids, {at::kLong}, 2);
  const auto dev = draft_token_ids.device();
  const int64_t bs = draft_token_ids.size(0), k = draft_token_ids.size(1);
  check_tensor(op, "target_probs", target_probs, {at::kFloat}, 3, {bs, k + 1, kAny}, dev);
  const int64_t v = target_probs.size(2);
  DFLASH_CHECK(v > 0, op, "target_probs has an empty vocabulary");
  if (draft_probs) check_tensor(op, "draft_probs", *draft_probs, {at::kFloat}, 3, {bs, k, v}, dev);
  check_tensor(op, "is_greedy", is_greedy, {at::kBool}, 1, {bs}, dev);
  check_tensor(op, "uniform", uniform, {at::kFloat}, 2, {bs, k}, dev);
  check_tensor(op, "exponential", exponential, {at::kFloat}, 2, {bs, v}, dev);
}

// rejection_sample.out's outputs: int64 [bs, k + 1] and [bs] on the inputs' device, contiguous.
inline void rejection_sample_out(const at::Tensor& draft_token_ids,
                                 const at::Tensor& output_token_ids,
                                 const at::Tensor& num_accepted) {
  constexpr const char* op = "rejection_sample";
  const int64_t bs = draft_token_ids.size(0), k = draft_token_ids.size(1);
  const auto dev = draft_token_ids.device();
  check_tensor(op, "output_token_ids", output_token_ids, {at::kLong}, 2, {bs, k + 1}, dev);
  check_tensor(op, "num_accepted", num_accepted, {at::kLong}, 1, {bs}, dev);
  DFLASH_CHECK(output_token_ids.is_contiguous() && num_accepted.is_contiguous(), op,
               "output_token_ids and num_accepted must be contiguous");
}

// The first value check: every draft token indexes the vocabulary ([bs, k] host ids).
inline void rejection_sample_ids(const int64_t* ids, int64_t bs, int64_t k, int64_t v) {
  for (int64_t i = 0; i < bs * k; ++i)
    DFLASH_CHECK(ids[i] >= 0 && ids[i] < v, "rejection_sample", "draft_token_ids[", i / k, ", ",
                 i % k, "] = ", ids[i], " is outside the vocabulary of ", v);
}

// Checked after the probabilities ([bs, k] host uniforms).
inline void rejection_sample_uniform(const float* u, int64_t bs, int64_t k) {
  for (int64_t i = 0; i < bs * k; ++i)
    DFLASH_CHECK(u[i] >= 0 && u[i] < 1, "rejection_sample", "uniform[", i / k, ", ", i % k,
                 "] = ", number(u[i]), " is outside [0, 1)");
}

// ------------------------------------------------------------------------------- context_kv

inline void context_kv_meta(const at::Tensor& hidden, const std::optional<at::Tensor>& fc_weight,
                            const at::Tensor& hidden_norm_weight, const at::Tensor& kv_weight,
                            const std::optional<at::Tensor>& kv_bias,
                            const at::Tensor& k_norm_weight, const at::Tensor& positions,
                            const at::Tensor& cos_sin_cache, const at::Tensor& slot_mapping,
                            at::TensorList key_caches, at::TensorList value_caches, double eps) {
  constexpr const char* op = "context_kv";
  check_tensor(op, "hidden", hidden, kFloats, 2);
  const auto dtype = hidden.scalar_type();
  const auto dev = hidden.device();
  const int64_t n = hidden.size(0), d_in = hidden.size(1);
  int64_t h = d_in;
  if (fc_weight) {
    check_tensor(op, "fc_weight", *fc_weight, {dtype}, 2, {kAny, d_in}, dev);
    h = fc_weight->size(0);
  }
  check_tensor(op, "hidden_norm_weight", hidden_norm_weight, {dtype}, 1, {h}, dev);
  check_tensor(op, "k_norm_weight", k_norm_weight, {dtype}, 2, {}, dev);
  const int64_t layers = k_norm_weight.size(0), d = k_norm_weight.size(1);
  DFLASH_CHECK(d % 2 == 0, op, "head_dim ", d, " must be even for rotate-half RoPE");
  DFLASH_CHECK(static_cast<int64_t>(key_caches.size()) == layers &&
                   static_cast<int64_t>(value_caches.size()) == layers,
               op, "expected ", layers,
               " key and value caches (one per layer of k_norm_weight), got ", key_caches.size(),
               " key and ", value_caches.size(), " value caches");
  DFLASH_CHECK(layers > 0, op, "k_norm_weight must describe at least one layer");
  check_tensor(op, "key_caches[0]", key_caches[0], {dtype}, 4, {}, dev);
  const std::vector<int64_t> cache_shape = key_caches[0].sizes().vec();
  const int64_t hkv = cache_shape[2];
  DFLASH_CHECK(cache_shape[3] == d, op, "key_caches[0] has head_dim ", cache_shape[3],
               ", k_norm_weight has ", d);
  for (const auto& [name, caches] :
       {std::pair{"key_caches", key_caches}, std::pair{"value_caches", value_caches}}) {
    for (size_t i = 0; i < caches.size(); ++i)
      check_tensor(op, std::string(name) + "[" + std::to_string(i) + "]", caches[i], {dtype}, 4,
                   cache_shape, dev);
  }
  const int64_t rows = layers * 2 * hkv * d;
  check_tensor(op, "kv_weight", kv_weight, {dtype}, 2, {}, dev);
  DFLASH_CHECK(kv_weight.size(0) == rows && kv_weight.size(1) == h, op, "kv_weight has shape ",
               shape_str(kv_weight), ", expected [", rows, ", ", h, "] (L=", layers,
               " x 2 x Hkv=", hkv, " x D=", d, " rows, hidden ", h, ")");
  if (kv_bias) check_tensor(op, "kv_bias", *kv_bias, {dtype}, 1, {rows}, dev);
  check_tensor(op, "positions", positions, {at::kLong}, 1, {n}, dev);
  check_tensor(op, "slot_mapping", slot_mapping, {at::kLong}, 1, {n}, dev);
  check_tensor(op, "cos_sin_cache", cos_sin_cache, {at::kFloat}, 2, {kAny, d}, dev);
  DFLASH_CHECK(eps >= 0, op, "eps must be non-negative, got ", number(eps));
}

// Host slots of n tokens: -1 (skip) or a slot of a cache of num_blocks x block_size.
inline void slot_mapping_values(const char* op, const int64_t* slots, int64_t n, int64_t num_blocks,
                                int64_t block_size) {
  const int64_t num_slots = num_blocks * block_size;
  for (int64_t t = 0; t < n; ++t)
    DFLASH_CHECK(slots[t] >= -1 && slots[t] < num_slots, op, "slot_mapping[", t, "] = ", slots[t],
                 " is out of range for a cache of ", num_blocks, " blocks x ", block_size,
                 " slots (valid: -1 to ", num_slots - 1, ")");
}

// Host positions and slots of the n tokens, against the cos/sin table and the caches.
inline void context_kv_values(const int64_t* positions, const int64_t* slots, int64_t n,
                              int64_t max_pos, int64_t num_blocks, int64_t block_size) {
  constexpr const char* op = "context_kv";
  for (int64_t t = 0; t < n; ++t)
    DFLASH_CHECK(positions[t] >= 0 && positions[t] < max_pos, op, "positions[", t,
                 "] = ", positions[t], " is out of range for a cos_sin_cache of ", max_pos,
                 " positions");
  slot_mapping_values(op, slots, n, num_blocks, block_size);
}

// -------------------------------------------------------------------------- paged_attention

inline void paged_attention_meta(const at::Tensor& query, const at::Tensor& key,
                                 const at::Tensor& value, const at::Tensor& key_cache,
                                 const at::Tensor& value_cache, const at::Tensor& block_table,
                                 const at::Tensor& context_lens, const at::Tensor& cu_query_lens,
                                 double scale, bool causal,
                                 const std::optional<at::Tensor>& tree_mask) {
  constexpr const char* op = "paged_attention";
  check_tensor(op, "query", query, kFloats, 3);
  const auto dtype = query.scalar_type();
  const auto dev = query.device();
  const int64_t tq = query.size(0), hq = query.size(1), d = query.size(2);
  check_tensor(op, "key", key, {dtype}, 3, {tq, kAny, d}, dev);
  const int64_t hkv = key.size(1);
  check_tensor(op, "value", value, {dtype}, 3, {tq, hkv, d}, dev);
  DFLASH_CHECK(hkv > 0 && hq % hkv == 0, op, "query heads ", hq, " must be a multiple of kv heads ",
               hkv);
  check_tensor(op, "key_cache", key_cache, {dtype}, 4, {kAny, kAny, hkv, d}, dev);
  check_tensor(op, "value_cache", value_cache, {dtype}, 4, key_cache.sizes(), dev);
  check_tensor(op, "block_table", block_table, {at::kInt}, 2, {}, dev);
  const int64_t b = block_table.size(0);
  check_tensor(op, "context_lens", context_lens, {at::kInt}, 1, {b}, dev);
  check_tensor(op, "cu_query_lens", cu_query_lens, {at::kInt}, 1, {b + 1}, dev);
  DFLASH_CHECK(std::isfinite(scale), op, "scale must be finite, got ", number(scale));
  if (tree_mask) {
    DFLASH_CHECK(causal, op, "tree_mask needs causal=True (a tree is a subset of the causal mask)");
    check_tensor(op, "tree_mask", *tree_mask, {at::kByte}, 2, {tq, kAny}, dev);
  }
}

// paged_attention.out's `out`: the output's shape, dtype and device, contiguous (rows written
// densely).
inline void paged_attention_out(const at::Tensor& query, const at::Tensor& out) {
  constexpr const char* op = "paged_attention";
  check_tensor(op, "out", out, {query.scalar_type()}, 3, query.sizes(), query.device());
  DFLASH_CHECK(out.is_contiguous(), op, "out must be contiguous");
}

// A host copy (contiguous) of tree_mask [tq, width]: row i of a sequence sees itself and only
// earlier rows of its sequence.
inline void tree_mask_values(const uint8_t* mask, int64_t width, const int32_t* cu, int64_t batch) {
  constexpr const char* op = "paged_attention";
  int64_t longest = 0;
  for (int64_t b = 0; b < batch; ++b) longest = std::max<int64_t>(longest, cu[b + 1] - cu[b]);
  DFLASH_CHECK(8 * width >= longest, op, "tree_mask has ", width,
               " bytes per row, too few for a sequence of ", longest, " new tokens");
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t i = 0; i < cu[b + 1] - cu[b]; ++i) {
      const uint8_t* row = mask + (cu[b] + i) * width;
      DFLASH_CHECK(row[i / 8] >> (i % 8) & 1, op, "tree_mask row ", cu[b] + i, " (sequence ", b,
                   ", new token ", i, ") does not see itself");
      for (int64_t j = i + 1; j < 8 * width; ++j)
        DFLASH_CHECK(!(row[j / 8] >> (j % 8) & 1), op, "tree_mask row ", cu[b] + i, " (sequence ",
                     b, ", new token ", i, ") sees new token ", j, ", which is not before it");
    }
  }
}

// Host copies (contiguous) of the index tensors: `table` is [batch, max_blocks], `context_lens`
// [batch], `cu` [batch + 1]; every block a sequence reads must exist.
inline void paged_attention_values(int64_t tq, int64_t num_blocks, int64_t block_size,
                                   const int32_t* table, int64_t batch, int64_t max_blocks,
                                   const int32_t* context_lens, const int32_t* cu) {
  constexpr const char* op = "paged_attention";
  DFLASH_CHECK(cu[0] == 0, op, "cu_query_lens must start at 0, got ", cu[0]);
  DFLASH_CHECK(cu[batch] == tq, op, "cu_query_lens must end at the ", tq, " query rows, got ",
               cu[batch]);
  for (int64_t b = 0; b < batch; ++b)
    DFLASH_CHECK(cu[b] <= cu[b + 1], op, "cu_query_lens is not monotone at sequence ", b, ": ",
                 cu[b], " > ", cu[b + 1]);
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t ctx = context_lens[b];
    DFLASH_CHECK(0 <= ctx && ctx <= max_blocks * block_size, op, "context_lens[", b, "] = ", ctx,
                 " is out of range: the block table covers ", max_blocks, " blocks x ", block_size,
                 " tokens");
    const int64_t used = block_size > 0 ? (ctx + block_size - 1) / block_size : 0;
    for (int64_t j = 0; j < used; ++j) {
      const int32_t blk = table[b * max_blocks + j];
      DFLASH_CHECK(0 <= blk && blk < num_blocks, op, "block_table[", b, ", ", j, "] = ", blk,
                   " is out of range for ", num_blocks, " cache blocks");
    }
  }
}

// ------------------------------------------------------------------------------ layer ops

// `x` [..., H] is a float tensor of rank >= 1 with a non-empty last dim.
inline void rows_input(const char* op, const at::Tensor& x) {
  check_tensor(op, "x", x, kFloats, std::max<int64_t>(x.dim(), 1));
  DFLASH_CHECK(x.size(-1) > 0, op, "x has shape ", shape_str(x), ", its last dim is empty");
}

// x [..., V] floats; 1 <= k <= V.
inline void top_k_meta(const at::Tensor& x, int64_t k) {
  constexpr const char* op = "top_k";
  rows_input(op, x);
  DFLASH_CHECK(k >= 1 && k <= x.size(-1), op, "k must be in [1, ", x.size(-1),
               "] (x's last dim), got ", k);
}

inline void rms_norm_meta(const char* op, const at::Tensor& x, const at::Tensor& weight,
                          double eps) {
  rows_input(op, x);
  check_tensor(op, "weight", weight, kFloats, 1, {x.size(-1)}, x.device());
  DFLASH_CHECK(eps >= 0, op, "eps must be non-negative, got ", number(eps));
}

inline void add_rms_norm_meta(const at::Tensor& x, const at::Tensor& residual,
                              const at::Tensor& weight, double eps) {
  constexpr const char* op = "add_rms_norm";
  rms_norm_meta(op, x, weight, eps);
  check_tensor(op, "residual", residual, {x.scalar_type()}, x.dim(), x.sizes(), x.device());
}

inline void silu_and_mul_meta(const at::Tensor& x) {
  constexpr const char* op = "silu_and_mul";
  rows_input(op, x);
  DFLASH_CHECK(x.size(-1) % 2 == 0, op, "x has shape ", shape_str(x),
               ", its last dim (gate | up) must be even");
}

// weight_panels [N / 16, K, 16] (dflash.ops.to_panels) in x's dtype; bias [N].
inline void panel_linear_meta(const at::Tensor& x, const at::Tensor& weight_panels,
                              const std::optional<at::Tensor>& bias) {
  constexpr const char* op = "panel_linear";
  rows_input(op, x);
  const int64_t k = x.size(-1);
  if (weight_panels.dim() == 4) {  // pair panels: bfloat16, K even
    check_tensor(op, "weight_panels", weight_panels, {x.scalar_type()}, 4, {kAny, k / 2, 16, 2},
                 x.device());
    DFLASH_CHECK(x.scalar_type() == at::kBFloat16, op, "pair panels (4-D weight_panels) hold ",
                 "bfloat16 weights only, got ", dtype_str(x.scalar_type()));
    DFLASH_CHECK(k % 2 == 0, op, "pair panels need an even K, x has ", k, " columns");
  } else {
    check_tensor(op, "weight_panels", weight_panels, {x.scalar_type()}, 3, {kAny, k, 16},
                 x.device());
  }
  if (bias) check_tensor(op, "bias", *bias, kFloats, 1, {weight_panels.size(0) * 16}, x.device());
}

// 8 bits: weight [N / 16, K / 4, 16, 4] uint8 quad panels (dflash.ops.quantize_int8), no mins;
// 4 bits: weight [N / 16, K / 8, 16, 4] uint8 nibble panels (dflash.ops.quantize_int4) and mins;
// scales [N / 16, K / 32, 16] float16 (and 4 bits, mins alike); K a multiple of 32; bias [N].
inline void quant_linear_meta(const at::Tensor& x, const at::Tensor& weight,
                              const at::Tensor& scales, const std::optional<at::Tensor>& mins,
                              const std::optional<at::Tensor>& bias) {
  constexpr const char* op = "quant_linear";
  rows_input(op, x);
  const int64_t k = x.size(-1);
  DFLASH_CHECK(k % 32 == 0, op, "x has ", k, " columns; quantized weights need a multiple of 32 ",
               "(one scale per group of 32)");
  const int64_t per_vector = mins ? 8 : 4;  // inputs per 64-byte vector of a panel
  check_tensor(op, "weight", weight, {at::kByte}, 4, {kAny, k / per_vector, 16, 4}, x.device());
  check_tensor(op, "scales", scales, {at::kHalf}, 3, {weight.size(0), k / 32, 16}, x.device());
  if (mins) check_tensor(op, "mins", *mins, {at::kHalf}, 3, scales.sizes(), x.device());
  if (bias) check_tensor(op, "bias", *bias, kFloats, 1, {weight.size(0) * 16}, x.device());
}

inline void qkv_rope_cache_meta(const at::Tensor& qkv,
                                const std::optional<at::Tensor>& q_norm_weight,
                                const std::optional<at::Tensor>& k_norm_weight,
                                const at::Tensor& cos_sin, const at::Tensor& key_cache,
                                const at::Tensor& value_cache, const at::Tensor& slot_mapping,
                                int64_t num_heads, double eps) {
  constexpr const char* op = "qkv_rope_cache";
  check_tensor(op, "key_cache", key_cache, kFloats, 4);
  const auto dtype = key_cache.scalar_type();
  const auto dev = key_cache.device();
  const int64_t hkv = key_cache.size(2), d = key_cache.size(3);
  DFLASH_CHECK(d > 0 && d % 2 == 0, op, "head_dim ", d,
               " must be positive and even for rotate-half RoPE");
  check_tensor(op, "value_cache", value_cache, {dtype}, 4, key_cache.sizes(), dev);
  // bounded: a larger count would overflow the width below
  DFLASH_CHECK(hkv > 0 && num_heads > 0 && num_heads <= INT32_MAX && num_heads % hkv == 0, op,
               "num_heads ", num_heads, " must be a positive multiple of the caches' ", hkv,
               " kv heads, at most 2**31 - 1");
  check_tensor(op, "qkv", qkv, {dtype}, 2, {kAny, (num_heads + 2 * hkv) * d}, dev);
  const int64_t t = qkv.size(0);
  if (q_norm_weight) check_tensor(op, "q_norm_weight", *q_norm_weight, kFloats, 1, {d}, dev);
  if (k_norm_weight) check_tensor(op, "k_norm_weight", *k_norm_weight, kFloats, 1, {d}, dev);
  check_tensor(op, "cos_sin", cos_sin, {at::kFloat}, 2, {t, d}, dev);
  check_tensor(op, "slot_mapping", slot_mapping, {at::kLong}, 1, {t}, dev);
  DFLASH_CHECK(eps >= 0, op, "eps must be non-negative, got ", number(eps));
}

inline void rope_meta(const at::Tensor& x, const at::Tensor& cos_sin) {
  constexpr const char* op = "rope";
  check_tensor(op, "x", x, kFloats, 3);
  const int64_t d = x.size(2);
  DFLASH_CHECK(d > 0 && d % 2 == 0, op, "head_dim ", d,
               " must be positive and even for rotate-half RoPE");
  check_tensor(op, "cos_sin", cos_sin, {at::kFloat}, 2, {x.size(0), d}, x.device());
}

}  // namespace checks
}  // namespace dflash
