// dflash::decoder_layer (docs/design.md 3.4): a target decoder layer of decoding or verification
// as one call. It composes the other dflash ops through the dispatcher, in the order and with the
// arguments the Python layer (dflash/models/target.py) passes them, so its results are the Python
// layer's bit for bit. What it saves is the Python between the ops: nine ops a layer, each call
// from Python costing several microseconds, add up to a tenth or more of a small model's pass.
//
// CompositeImplicitAutograd: every device runs it through its own kernels of the component ops,
// and tracing (torch.compile, fake tensors) sees those ops, whose fake kernels exist.
#include <ATen/ATen.h>
#include <ATen/TensorSubclassLikeUtils.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <optional>
#include <tuple>
#include <utility>

#include "checks.h"

namespace dflash::decoder_layer {
namespace {

using at::Tensor;
using Opt = std::optional<Tensor>;
constexpr int64_t kPanel = 16;  // columns per panel (dflash/ops/packing.py, PANEL)

template <typename Signature>
c10::TypedOperatorHandle<Signature> handle(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

// A linear weight in any form the model holds, told apart as dflash/models/layers.py's `linear`
// does: quantized (codes with scales, and mins for 4 bits), oneDNN's blocked layout, column or pair
// panels ([N / 16, K, 16], [N / 16, K / 2, 16, 2]), or a plain [N, K] tensor.
Tensor linear(const Tensor& x, const Tensor& weight, const Opt& scales, const Opt& mins,
              const Opt& bias) {
  if (scales.has_value()) {
    static const auto quant =
        handle<Tensor(const Tensor&, const Tensor&, const Tensor&, const Opt&, const Opt&)>(
            "dflash::quant_linear");
    return quant.call(x, weight, *scales, mins, bias);
  }
  if (weight.is_mkldnn()) {
    // boxed: the schema's `Scalar?[]` has no stable unboxed C++ type across torch versions
    static const auto onednn =
        c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
    torch::jit::Stack stack{x,
                            weight,
                            bias,
                            c10::string_view("none"),
                            c10::List<std::optional<at::Scalar>>(),
                            std::optional<c10::string_view>()};
    onednn.callBoxed(&stack);
    return stack.back().toTensor();
  }
  const bool panels = (weight.dim() == 3 && weight.size(-1) == kPanel) ||
                      (weight.dim() == 4 && weight.size(-2) == kPanel && weight.size(-1) == 2);
  if (panels) {
    static const auto panel =
        handle<Tensor(const Tensor&, const Tensor&, const Opt&)>("dflash::panel_linear");
    return panel.call(x, weight, bias);
  }
  return at::linear(x, weight, bias);
}

// (outputs N, inputs K) of a linear weight in any of `linear`'s forms: quad or nibble panels
// ([N / 16, K / 4 or K / 8, 16, 4]), column or pair panels, or [N, K] (oneDNN's too).
std::pair<int64_t, int64_t> linear_shape(const char* name, const Tensor& weight, const Opt& scales,
                                         const Opt& mins) {
  DFLASH_CHECK(weight.dim() >= 2, "decoder_layer", name, " must be a linear weight, got shape ",
               shape_str(weight));
  const int64_t rows = weight.size(0), cols = weight.size(1);
  if (scales.has_value()) return {rows * kPanel, cols * (mins.has_value() ? 8 : 4)};
  if (weight.dim() == 3 && weight.size(-1) == kPanel) return {rows * kPanel, cols};
  if (weight.dim() == 4 && weight.size(-2) == kPanel && weight.size(-1) == 2)
    return {rows * kPanel, cols * 2};
  return {rows, cols};
}

// What the ops after qkv_rope_cache, which writes the caches, would reject: checked before it, so
// that a rejected call leaves the caches as they were (dflash/ops/checks.py). The attention's
// index values are read only when `check` asks for it (check=False: a step plan the caller
// checked, as the engine's are, so the decode path pays nothing here), never from a traced
// (fake or functional) tensor.
void check_before_writing(const Tensor& x, const Tensor& key_cache, const Tensor& o,
                          const Opt& o_scales, const Opt& o_mins, const Tensor& gate_up,
                          const Opt& gate_up_scales, const Opt& gate_up_mins, const Tensor& down,
                          const Opt& down_scales, const Opt& down_mins, const Tensor& block_table,
                          const Tensor& context_lens, const Tensor& cu_query_lens,
                          const Opt& tree_mask, int64_t num_heads, double scale, bool check) {
  constexpr const char* attention = "paged_attention";
  const auto dev = key_cache.device();
  const int64_t t = x.size(0), h = x.size(-1), d = key_cache.size(3);
  check_tensor(attention, "block_table", block_table, {at::kInt}, 2, {}, dev);
  const int64_t b = block_table.size(0);
  check_tensor(attention, "context_lens", context_lens, {at::kInt}, 1, {b}, dev);
  check_tensor(attention, "cu_query_lens", cu_query_lens, {at::kInt}, 1, {b + 1}, dev);
  DFLASH_CHECK(std::isfinite(scale), attention, "scale must be finite, got ", number(scale));
  if (tree_mask)
    check_tensor(attention, "tree_mask", *tree_mask, {at::kByte}, 2, {t, checks::kAny}, dev);
  const bool traced = at::isTensorSubclassLike(block_table) || block_table.is_meta();
  if (check && !traced) {
    const Tensor table = block_table.cpu().contiguous(), lens = context_lens.cpu().contiguous(),
                 cu = cu_query_lens.cpu().contiguous();
    checks::paged_attention_values(t, key_cache.size(0), key_cache.size(1),
                                   table.data_ptr<int32_t>(), b, table.size(1),
                                   lens.data_ptr<int32_t>(), cu.data_ptr<int32_t>());
    if (tree_mask) {
      const Tensor mask = tree_mask->cpu().contiguous();
      checks::tree_mask_values(mask.data_ptr<uint8_t>(), mask.size(1), cu.data_ptr<int32_t>(), b);
    }
  }
  constexpr const char* op = "decoder_layer";
  const auto [o_out, o_in] = linear_shape("o", o, o_scales, o_mins);
  DFLASH_CHECK(o_in == num_heads * d && o_out == h, op, "o maps ", o_in, " inputs to ", o_out,
               " outputs; the attention gives ", num_heads, " heads x ", d,
               " and the hidden size is ", h);
  const auto [gate_up_out, gate_up_in] =
      linear_shape("gate_up", gate_up, gate_up_scales, gate_up_mins);
  DFLASH_CHECK(gate_up_in == h && gate_up_out % 2 == 0, op, "gate_up maps ", gate_up_in,
               " inputs to ", gate_up_out, " outputs; it needs the hidden size ", h,
               " and an even count (gate | up)");
  const auto [down_out, down_in] = linear_shape("down", down, down_scales, down_mins);
  DFLASH_CHECK(down_in == gate_up_out / 2 && down_out == h, op, "down maps ", down_in,
               " inputs to ", down_out, " outputs; it needs gate_up's ", gate_up_out / 2,
               " and the hidden size ", h);
}

std::tuple<Tensor, Tensor> decoder_layer(
    const Tensor& x, const Opt& residual, const Tensor& input_norm, const Tensor& post_norm,
    const Tensor& qkv, const Opt& qkv_scales, const Opt& qkv_mins, const Opt& qkv_bias,
    const Opt& q_norm, const Opt& k_norm, const Tensor& o, const Opt& o_scales, const Opt& o_mins,
    const Opt& o_bias, const Tensor& gate_up, const Opt& gate_up_scales, const Opt& gate_up_mins,
    const Tensor& down, const Opt& down_scales, const Opt& down_mins, const Tensor& cos_sin,
    const Tensor& key_cache, const Tensor& value_cache, const Tensor& slot_mapping,
    const Tensor& block_table, const Tensor& context_lens, const Tensor& cu_query_lens,
    const Opt& tree_mask, int64_t num_heads, double scale, double eps, bool check) {
  static const auto rms_norm =
      handle<Tensor(const Tensor&, const Tensor&, double)>("dflash::rms_norm");
  static const auto add_rms_norm =
      handle<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, double)>(
          "dflash::add_rms_norm");
  static const auto silu_and_mul = handle<Tensor(const Tensor&)>("dflash::silu_and_mul");
  static const auto qkv_rope_cache = handle<std::tuple<Tensor, Tensor, Tensor>(
      const Tensor&, const Opt&, const Opt&, const Tensor&, const Tensor&, const Tensor&,
      const Tensor&, int64_t, double, bool)>("dflash::qkv_rope_cache");
  static const auto paged_attention =
      handle<Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                    const Tensor&, const Tensor&, const Tensor&, double, bool, bool, const Opt&)>(
          "dflash::paged_attention");

  Tensor h, stream;
  if (residual.has_value()) {
    std::tie(h, stream) = add_rms_norm.call(x, *residual, input_norm, eps);
  } else {
    h = rms_norm.call(x, input_norm, eps);
    stream = x;
  }
  const Tensor qkv_out = linear(h, qkv, qkv_scales, qkv_mins, qkv_bias);
  checks::qkv_rope_cache_meta(qkv_out, q_norm, k_norm, cos_sin, key_cache, value_cache,
                              slot_mapping, num_heads, eps);
  check_before_writing(x, key_cache, o, o_scales, o_mins, gate_up, gate_up_scales, gate_up_mins,
                       down, down_scales, down_mins, block_table, context_lens, cu_query_lens,
                       tree_mask, num_heads, scale, check);
  auto [q, k, v] = qkv_rope_cache.call(qkv_out, q_norm, k_norm, cos_sin, key_cache, value_cache,
                                       slot_mapping, num_heads, eps, check);
  const Tensor attended =
      paged_attention.call(q, k, v, key_cache, value_cache, block_table, context_lens,
                           cu_query_lens, scale, true, check, tree_mask);
  std::tie(h, stream) = add_rms_norm.call(
      linear(attended.view({x.size(0), -1}), o, o_scales, o_mins, o_bias), stream, post_norm, eps);
  const Tensor gated = silu_and_mul.call(linear(h, gate_up, gate_up_scales, gate_up_mins, {}));
  return {linear(gated, down, down_scales, down_mins, {}), stream};
}

}  // namespace
}  // namespace dflash::decoder_layer

TORCH_LIBRARY_IMPL(dflash, CompositeImplicitAutograd, m) {
  m.impl("decoder_layer", &dflash::decoder_layer::decoder_layer);
}
