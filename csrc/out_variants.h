// The ops that return tensors, as their functional schema and their .out overload (docs/design.md
// 3), both from one `Into` function per implementation (CPU kernels, NPU and emulated launchers):
// Into(inputs..., outputs as optionals) writes into the outputs given, or into new tensors.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

namespace dflash::variants {

template <auto Into>
at::Tensor paged_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                           const at::Tensor& key_cache, const at::Tensor& value_cache,
                           const at::Tensor& block_table, const at::Tensor& context_lens,
                           const at::Tensor& cu_query_lens, double scale, bool causal, bool check,
                           const std::optional<at::Tensor>& tree_mask) {
  return Into(query, key, value, key_cache, value_cache, block_table, context_lens, cu_query_lens,
              scale, causal, check, tree_mask, std::nullopt);
}

template <auto Into>
void paged_attention_out(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                         const at::Tensor& key_cache, const at::Tensor& value_cache,
                         const at::Tensor& block_table, const at::Tensor& context_lens,
                         const at::Tensor& cu_query_lens, double scale, bool causal, bool check,
                         const std::optional<at::Tensor>& tree_mask, at::Tensor& out) {
  Into(query, key, value, key_cache, value_cache, block_table, context_lens, cu_query_lens, scale,
       causal, check, tree_mask, out);
}

template <auto Into>
std::tuple<at::Tensor, at::Tensor> rejection_sample(const at::Tensor& draft_token_ids,
                                                    const std::optional<at::Tensor>& draft_probs,
                                                    const at::Tensor& target_probs,
                                                    const at::Tensor& is_greedy,
                                                    const at::Tensor& uniform,
                                                    const at::Tensor& exponential, bool check) {
  return Into(draft_token_ids, draft_probs, target_probs, is_greedy, uniform, exponential, check,
              std::nullopt, std::nullopt);
}

template <auto Into>
void rejection_sample_out(const at::Tensor& draft_token_ids,
                          const std::optional<at::Tensor>& draft_probs,
                          const at::Tensor& target_probs, const at::Tensor& is_greedy,
                          const at::Tensor& uniform, const at::Tensor& exponential, bool check,
                          at::Tensor& output_token_ids, at::Tensor& num_accepted) {
  Into(draft_token_ids, draft_probs, target_probs, is_greedy, uniform, exponential, check,
       output_token_ids, num_accepted);
}

}  // namespace dflash::variants
