// Emulated host launchers (tests only): the Ascend C kernels of ascend_kernels/, compiled for x86
// against the emulation, served as torch.ops.dflash_emu.* with the schemas of torch.ops.dflash.*.
// They share checks, GEMMs and tiling with the NPU launchers (csrc/npu/ascend_host.h); only the
// launch differs: dflash::emu::launch runs the blocks one after another in a shuffled order.
#include <torch/library.h>

#include "kernel_operator.h"
#include "npu/ascend_host.h"
#include "out_variants.h"

extern "C" {
void dflash_rejection_sample(uint8_t*, uint8_t*, uint8_t*, uint8_t*, uint8_t*, uint8_t*, uint8_t*,
                             uint8_t*, RejectionSampleTiling);
void dflash_context_kv_fp32(uint8_t*, uint8_t*, uint8_t*, uint8_t*, uint8_t*, uint8_t*,
                            ContextKvTiling);
void dflash_context_kv_fp16(uint8_t*, uint8_t*, uint8_t*, uint8_t*, uint8_t*, uint8_t*,
                            ContextKvTiling);
void dflash_context_kv_bf16(uint8_t*, uint8_t*, uint8_t*, uint8_t*, uint8_t*, uint8_t*,
                            ContextKvTiling);
#define DFLASH_PAGED_ATTENTION_KERNEL(NAME)                                                 \
  void NAME(uint8_t*, uint8_t*, uint8_t*, uint8_t*, uint8_t*, uint8_t*, uint8_t*, uint8_t*, \
            uint8_t*, uint8_t*, PagedAttentionTiling);
DFLASH_PAGED_ATTENTION_KERNEL(dflash_paged_attention_fp32)
DFLASH_PAGED_ATTENTION_KERNEL(dflash_paged_attention_fp16)
DFLASH_PAGED_ATTENTION_KERNEL(dflash_paged_attention_bf16)
#undef DFLASH_PAGED_ATTENTION_KERNEL
}

namespace dflash::emu {

// Rule snippets of the emulation's unit tests (tests/ascend_emu_snippets.cpp): a kernel taking one
// input and one output GM buffer, and the number of blocks to run it on.
using SnippetKernel = void (*)(uint8_t* input, uint8_t* output);
bool find_snippet(const std::string& name, uint32_t& blocks, SnippetKernel& kernel);

namespace {

// Set by the test-only op `configure`: the vector cores the launchers spread blocks over, a cap on
// rejection_sample's vocabulary tile (0: as large as the UB allows), and the unified buffer the
// tilings plan for (smaller than the hardware's to force small tiles on small inputs).
struct Config {
  uint32_t cores = 8;
  uint32_t max_tile = 0;
  uint64_t ub_bytes = dflash::ascend::kUbBytes;
} config;

// A GM buffer the kernel may touch: the whole extent of `t`'s elements, whatever its strides.
dflash::emu::GmArg gm(const at::Tensor& t, bool writable, std::string name) {
  if (!t.defined()) return {nullptr, 0, writable, std::move(name)};  // an absent optional input
  int64_t last = 0;
  for (int64_t i = 0; i < t.dim(); ++i) last += (t.size(i) - 1) * t.stride(i);
  const size_t bytes = t.numel() ? (last + 1) * t.element_size() : 0;
  return {t.data_ptr(), bytes, writable, std::move(name)};
}

using dflash::ascend::gm_ptr;

std::tuple<at::Tensor, at::Tensor> sample_into(
    const at::Tensor& draft_token_ids, const std::optional<at::Tensor>& draft_probs,
    const at::Tensor& target_probs, const at::Tensor& is_greedy, const at::Tensor& uniform,
    const at::Tensor& exponential, bool check, const std::optional<at::Tensor>& out_ids,
    const std::optional<at::Tensor>& num_accepted) {
  auto l = dflash::ascend::prepare_rejection_sample(
      draft_token_ids, draft_probs, target_probs, is_greedy, uniform, exponential, check, out_ids,
      num_accepted, config.cores, config.ub_bytes, config.max_tile);
  if (l.block_dim == 0) return {l.out_ids, l.num_accepted};
  std::vector<dflash::emu::GmArg> args{
      gm(l.draft_ids, false, "draft_token_ids"), gm(l.target_probs, false, "target_probs"),
      gm(l.is_greedy, false, "is_greedy"),       gm(l.uniform, false, "uniform"),
      gm(l.exponential, false, "exponential"),   gm(l.out_ids, true, "output_token_ids"),
      gm(l.num_accepted, true, "num_accepted")};
  if (l.draft_probs.defined()) args.push_back(gm(l.draft_probs, false, "draft_probs"));
  dflash::emu::launch(l.block_dim, std::move(args), [&] {
    dflash_rejection_sample(gm_ptr(l.draft_ids), gm_ptr(l.draft_probs), gm_ptr(l.target_probs),
                            gm_ptr(l.is_greedy), gm_ptr(l.uniform), gm_ptr(l.exponential),
                            gm_ptr(l.out_ids), gm_ptr(l.num_accepted), l.tiling);
  });
  return {l.out_ids, l.num_accepted};
}

void context_kv(const at::Tensor& hidden, const std::optional<at::Tensor>& fc_weight,
                const at::Tensor& hidden_norm_weight, const at::Tensor& kv_weight,
                const std::optional<at::Tensor>& kv_bias, const at::Tensor& k_norm_weight,
                const at::Tensor& positions, const at::Tensor& cos_sin_cache,
                const at::Tensor& slot_mapping, at::TensorList key_caches,
                at::TensorList value_caches, double eps, bool check) {
  auto l = dflash::ascend::prepare_context_kv(hidden, fc_weight, hidden_norm_weight, kv_weight,
                                              kv_bias, k_norm_weight, positions, cos_sin_cache,
                                              slot_mapping, key_caches, value_caches, eps, check,
                                              config.cores, config.ub_bytes);
  if (l.block_dim == 0) return;
  std::vector<dflash::emu::GmArg> args{gm(l.kv, false, "kv"),
                                       gm(l.k_norm_weight, false, "k_norm_weight"),
                                       gm(l.positions, false, "positions"),
                                       gm(l.cos_sin, false, "cos_sin_cache"),
                                       gm(l.slots, false, "slot_mapping"),
                                       gm(l.cache_table, false, "cache_table")};
  for (size_t i = 0; i < key_caches.size(); ++i) {
    args.push_back(gm(key_caches[i], true, "key_caches[" + std::to_string(i) + "]"));
    args.push_back(gm(value_caches[i], true, "value_caches[" + std::to_string(i) + "]"));
  }
  auto kernel = l.dtype_code == 0   ? dflash_context_kv_fp32
                : l.dtype_code == 1 ? dflash_context_kv_fp16
                                    : dflash_context_kv_bf16;
  dflash::emu::launch(l.block_dim, std::move(args), [&] {
    kernel(gm_ptr(l.kv), gm_ptr(l.k_norm_weight), gm_ptr(l.positions), gm_ptr(l.cos_sin),
           gm_ptr(l.slots), gm_ptr(l.cache_table), l.tiling);
  });
}

at::Tensor paged_attention_into(const at::Tensor& query, const at::Tensor& key,
                                const at::Tensor& value, const at::Tensor& key_cache,
                                const at::Tensor& value_cache, const at::Tensor& block_table,
                                const at::Tensor& context_lens, const at::Tensor& cu_query_lens,
                                double scale, bool causal, bool check,
                                const std::optional<at::Tensor>& tree_mask,
                                const std::optional<at::Tensor>& out) {
  auto l = dflash::ascend::prepare_paged_attention(
      query, key, value, key_cache, value_cache, block_table, context_lens, cu_query_lens, scale,
      causal, check, tree_mask, out, config.cores, config.ub_bytes);
  if (l.block_dim == 0) return l.out;
  std::vector<dflash::emu::GmArg> args{gm(l.query, false, "query"),
                                       gm(l.key, false, "key"),
                                       gm(l.value, false, "value"),
                                       gm(l.key_cache, false, "key_cache"),
                                       gm(l.value_cache, false, "value_cache"),
                                       gm(l.block_table, false, "block_table"),
                                       gm(l.context_lens, false, "context_lens"),
                                       gm(l.cu_query_lens, false, "cu_query_lens"),
                                       gm(l.tree_mask, false, "tree_mask"),
                                       gm(l.out, true, "output")};
  auto kernel = l.dtype_code == 0   ? dflash_paged_attention_fp32
                : l.dtype_code == 1 ? dflash_paged_attention_fp16
                                    : dflash_paged_attention_bf16;
  dflash::emu::launch(l.block_dim, std::move(args), [&] {
    kernel(gm_ptr(l.query), gm_ptr(l.key), gm_ptr(l.value), gm_ptr(l.key_cache),
           gm_ptr(l.value_cache), gm_ptr(l.block_table), gm_ptr(l.context_lens),
           gm_ptr(l.cu_query_lens), gm_ptr(l.tree_mask), gm_ptr(l.out), l.tiling);
  });
  return l.out;
}

// The tiling paged_attention would use under the current configuration:
// [q_tile, head_tile, kv_tile] (all 0 when nothing fits).
std::vector<int64_t> paged_attention_plan(int64_t q_heads, int64_t kv_heads, int64_t head_dim,
                                          int64_t block_size, int64_t max_query_len,
                                          int64_t elem_bytes) {
  const auto d = static_cast<uint32_t>(head_dim);
  auto t = dflash::ascend::paged_attention_tiling(
      q_heads, kv_heads, d, block_size, 1, max_query_len, false, 1.0f, elem_bytes, config.ub_bytes,
      dflash::ascend::emulated_sum_workspace(d));
  if (!t.q_tile) return {0, 0, 0};
  return {t.q_tile, t.head_tile, t.kv_tile};
}

// Host<->device copies, either direction, the shared host code (csrc/npu/ascend_host.h) has made.
int64_t transfers() {
  return dflash::ascend::transfers().load();
}

// Outputs the shared host code has allocated.
int64_t allocations() {
  return dflash::ascend::allocations().load();
}

// Graph capture's rules for the tests: while on, any host<->device copy and any output the
// launcher would allocate raise.
void set_capturing(bool on) {
  dflash::ascend::capturing() = on;
}

void configure(int64_t cores, int64_t max_tile, int64_t ub_bytes) {
  TORCH_CHECK_VALUE(cores >= 1 && max_tile >= 0 && ub_bytes >= 0,
                    "configure: cores >= 1, max_tile >= 0 and ub_bytes >= 0");
  config.cores = static_cast<uint32_t>(cores);
  config.max_tile = static_cast<uint32_t>(max_tile);
  config.ub_bytes =
      ub_bytes ? std::min<uint64_t>(ub_bytes, dflash::ascend::kUbBytes) : dflash::ascend::kUbBytes;
}

// Runs a rule snippet; returns the order in which its blocks ran.
std::vector<int64_t> run_snippet(const std::string& name, const at::Tensor& input,
                                 const at::Tensor& output) {
  uint32_t blocks = 0;
  SnippetKernel kernel = nullptr;
  TORCH_CHECK_VALUE(find_snippet(name, blocks, kernel), "unknown snippet ", name);
  TORCH_CHECK_VALUE(input.is_contiguous() && output.is_contiguous(),
                    "snippet buffers must be contiguous");
  // snippets are fragments of kernels: vector-only unless they test the declaration itself
  const bool declares = name.rfind("kernel_type_", 0) == 0;
  dflash::emu::launch(blocks, {gm(input, false, "input"), gm(output, true, "output")}, [&] {
    if (!declares) KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_AIV_ONLY);
    kernel(gm_ptr(input), gm_ptr(output));
  });
  const auto& order = dflash::emu::last_order();
  return {order.begin(), order.end()};
}

}  // namespace
}  // namespace dflash::emu

TORCH_LIBRARY(dflash_emu, m) {
  m.def(
      "context_kv(Tensor hidden, Tensor? fc_weight, Tensor hidden_norm_weight, Tensor kv_weight, "
      "Tensor? kv_bias, Tensor k_norm_weight, Tensor positions, Tensor cos_sin_cache, "
      "Tensor slot_mapping, Tensor(a!)[] key_caches, Tensor(b!)[] value_caches, float eps, "
      "bool check=True) -> ()");
  m.def(
      "rejection_sample(Tensor draft_token_ids, Tensor? draft_probs, Tensor target_probs, "
      "Tensor is_greedy, Tensor uniform, Tensor exponential, bool check=True) -> "
      "(Tensor, Tensor)");
  m.def(
      "rejection_sample.out(Tensor draft_token_ids, Tensor? draft_probs, Tensor target_probs, "
      "Tensor is_greedy, Tensor uniform, Tensor exponential, bool check=True, *, "
      "Tensor(a!) output_token_ids, Tensor(b!) num_accepted) -> ()");
  m.def(
      "paged_attention(Tensor query, Tensor key, Tensor value, Tensor key_cache, "
      "Tensor value_cache, Tensor block_table, Tensor context_lens, Tensor cu_query_lens, "
      "float scale, bool causal, bool check=True, Tensor? tree_mask=None) -> Tensor");
  m.def(
      "paged_attention.out(Tensor query, Tensor key, Tensor value, Tensor key_cache, "
      "Tensor value_cache, Tensor block_table, Tensor context_lens, Tensor cu_query_lens, "
      "float scale, bool causal, bool check=True, Tensor? tree_mask=None, *, Tensor(a!) out) -> "
      "()");
  m.def("configure(int cores, int max_tile, int ub_bytes=0) -> ()", &dflash::emu::configure);
  m.def("transfers() -> int", &dflash::emu::transfers);
  m.def("allocations() -> int", &dflash::emu::allocations);
  m.def("set_capturing(bool on) -> ()", &dflash::emu::set_capturing);
  m.def(
      "paged_attention_plan(int q_heads, int kv_heads, int head_dim, int block_size, "
      "int max_query_len, int elem_bytes) -> int[]",
      &dflash::emu::paged_attention_plan);
  m.def("run_snippet(str name, Tensor input, Tensor(a!) output) -> int[]",
        &dflash::emu::run_snippet);
}

TORCH_LIBRARY_IMPL(dflash_emu, CPU, m) {
  m.impl("context_kv", &dflash::emu::context_kv);
  using dflash::emu::paged_attention_into, dflash::emu::sample_into;
  m.impl("rejection_sample", &dflash::variants::rejection_sample<sample_into>);
  m.impl("rejection_sample.out", &dflash::variants::rejection_sample_out<sample_into>);
  m.impl("paged_attention", &dflash::variants::paged_attention<paged_attention_into>);
  m.impl("paged_attention.out", &dflash::variants::paged_attention_out<paged_attention_into>);
}
