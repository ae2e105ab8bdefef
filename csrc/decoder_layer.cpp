// dflash::decoder_layer (docs/design.md 3.4): a target decoder layer of decoding or verification
// as one call. It composes the other dflash ops through the dispatcher, in the order and with the
// arguments the Python layer (dflash/models/target.py) passes them, so its results are the Python
// layer's bit for bit. What it saves is the Python between the ops: nine ops a layer, each call
// from Python costing several microseconds, add up to a tenth or more of a small model's pass.
//
// CompositeImplicitAutograd: every device runs it through its own kernels of the component ops,
// and tracing (torch.compile, fake tensors) sees those ops, whose fake kernels exist.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

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
  auto [q, k, v] =
      qkv_rope_cache.call(linear(h, qkv, qkv_scales, qkv_mins, qkv_bias), q_norm, k_norm, cos_sin,
                          key_cache, value_cache, slot_mapping, num_heads, eps, check);
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
