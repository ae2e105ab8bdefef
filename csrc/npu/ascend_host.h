// Host side of dflash's Ascend C ops, shared by the NPU launchers in this folder and by the
// emulated launchers the tests build (ascend_kernels/emu/launchers.cpp): input checks with the
// messages of dflash/ops/checks.py, the GEMMs context_kv runs before its kernel, the tiling and the
// kernel arguments. Everything here is device-agnostic ATen code; only the launch itself differs.
#pragma once

#include <atomic>
#include <cmath>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

#include "checks.h"
#include "tiling.h"

namespace dflash::ascend {

template <typename... Parts>
[[noreturn]] void fail(const char* op, const Parts&... parts) {
  TORCH_CHECK_VALUE(false, op, ": ", parts...);
  abort();  // unreachable: TORCH_CHECK_VALUE(false, ...) throws
}

// Every copy between host and device the launchers make, in either direction, counted so that
// tests can see which calls make them (torch.ops.dflash_emu.transfers). On an NPU a blocking copy
// drains the stream and cannot be captured into a graph: a launch with check = false makes none
// (tilings are kernel arguments; a context_kv cache table is uploaded once per set of caches).
inline std::atomic<int64_t>& transfers() {
  static std::atomic<int64_t> count{0};
  return count;
}

// While set (graph capture), a transfer is an error instead of a stall.
inline std::atomic<bool>& capturing() {
  static std::atomic<bool> on{false};
  return on;
}

inline void count_transfer(const char* what) {
  if (capturing())
    TORCH_CHECK(false, "dflash: ", what,
                " while capturing: a host<->device copy cannot be part "
                "of a captured graph (call the op with check=False on checked inputs)");
  ++transfers();
}

inline at::Tensor to_host(const at::Tensor& t) {
  count_transfer("a device-to-host copy");
  return t.cpu().contiguous();
}

inline at::Tensor to_device(const at::Tensor& t, const at::Device& device) {
  count_transfer("a host-to-device copy");
  return t.to(device);
}

// The outputs the launchers allocate, counted like transfers (torch.ops.dflash_emu.allocations).
// While capturing, an op that would allocate its output is refused: a captured graph replays
// into memory its caller owns, so a captured step calls the .out overloads.
inline std::atomic<int64_t>& allocations() {
  static std::atomic<int64_t> count{0};
  return count;
}

inline at::Tensor new_output(const char* op, at::IntArrayRef sizes, const at::TensorOptions& o) {
  TORCH_CHECK(!capturing(), "dflash::", op,
              " allocates its output while capturing: a captured graph replays into memory its "
              "caller owns (call the op's .out overload with preallocated outputs)");
  ++allocations();
  return at::empty(sizes, o);
}

// A kernel argument: the GM address of `t`, or nullptr for an absent optional tensor.
inline uint8_t* gm_ptr(const at::Tensor& t) {
  return t.defined() ? static_cast<uint8_t*>(t.data_ptr()) : nullptr;
}

// ---------------------------------------------------------------------------------------------
// rejection_sample
// ---------------------------------------------------------------------------------------------

inline void check_probs(const char* op, const char* name, const at::Tensor& probs) {
  at::Tensor bad = to_host((~at::isfinite(probs) | (probs < 0)).any(-1).nonzero());
  if (bad.size(0) == 0) return;
  const int64_t b = bad[0][0].item<int64_t>(), i = bad[0][1].item<int64_t>();
  const bool finite = to_host(at::isfinite(probs[b][i]).all()).item<bool>();
  const char* what = finite ? "negative" : "NaN/Inf";
  fail(op, name, " row (sequence ", b, ", position ", i, ") has ", what, " probabilities");
}

// The value checks (token ids, probabilities, noise): they read device tensors back to the host,
// so only a call with check = true makes them.
inline void check_rejection_sample_values(const at::Tensor& draft_token_ids,
                                          const std::optional<at::Tensor>& draft_probs,
                                          const at::Tensor& target_probs, const at::Tensor& uniform,
                                          const at::Tensor& exponential) {
  constexpr const char* op = "rejection_sample";
  const int64_t bs = draft_token_ids.size(0), k = draft_token_ids.size(1);
  const at::Tensor ids = to_host(draft_token_ids);
  checks::rejection_sample_ids(ids.const_data_ptr<int64_t>(), bs, k, target_probs.size(2));
  // The probabilities stay on the device: reduce them there, copy back only the verdicts.
  check_probs(op, "target_probs", target_probs);
  if (draft_probs) check_probs(op, "draft_probs", *draft_probs);
  const at::Tensor u = to_host(uniform);
  checks::rejection_sample_uniform(u.const_data_ptr<float>(), bs, k);
  at::Tensor bad = to_host((~((exponential > 0) & at::isfinite(exponential))).any(-1).nonzero());
  if (bad.size(0))
    fail(op, "exponential row ", bad[0][0].item<int64_t>(),
         " must be positive and finite (Exp(1) noise)");
}

struct RejectionSampleLaunch {
  RejectionSampleTiling tiling;
  uint32_t block_dim;  // 0: empty batch, nothing to launch
  at::Tensor draft_ids, draft_probs, target_probs, is_greedy, uniform,
      exponential;  // contiguous inputs
  at::Tensor out_ids, num_accepted;
};

inline RejectionSampleLaunch prepare_rejection_sample(
    const at::Tensor& draft_token_ids, const std::optional<at::Tensor>& draft_probs,
    const at::Tensor& target_probs, const at::Tensor& is_greedy, const at::Tensor& uniform,
    const at::Tensor& exponential, bool check, const std::optional<at::Tensor>& out_ids,
    const std::optional<at::Tensor>& num_accepted, uint32_t cores, uint64_t ub_bytes = kUbBytes,
    uint32_t max_tile = 0) {
  checks::rejection_sample_meta(draft_token_ids, draft_probs, target_probs, is_greedy, uniform,
                                exponential);
  if (out_ids) checks::rejection_sample_out(draft_token_ids, *out_ids, *num_accepted);
  if (check)
    check_rejection_sample_values(draft_token_ids, draft_probs, target_probs, uniform, exponential);
  const int64_t bs = draft_token_ids.size(0), k = draft_token_ids.size(1), v = target_probs.size(2);
  RejectionSampleLaunch l;
  l.tiling = rejection_sample_tiling(bs, k, v, draft_probs.has_value(), ub_bytes, max_tile);
  if (l.tiling.tile == 0)
    fail("rejection_sample", k,
         " draft tokens per sequence do not fit the Ascend kernel's unified buffer");
  l.block_dim = block_dim(bs, cores);
  l.draft_ids = draft_token_ids.contiguous();
  if (draft_probs) l.draft_probs = draft_probs->contiguous();
  l.target_probs = target_probs.contiguous();
  l.is_greedy = is_greedy.contiguous();
  l.uniform = uniform.contiguous();
  l.exponential = exponential.contiguous();
  l.out_ids =
      out_ids ? *out_ids : new_output("rejection_sample", {bs, k + 1}, draft_token_ids.options());
  l.num_accepted = num_accepted ? *num_accepted
                                : new_output("rejection_sample", {bs}, draft_token_ids.options());
  return l;
}

// ---------------------------------------------------------------------------------------------
// context_kv
// ---------------------------------------------------------------------------------------------

struct ContextKvLaunch {
  ContextKvTiling tiling;
  uint32_t block_dim;  // 0: no tokens, nothing to launch
  int dtype_code;      // 0 float32, 1 float16, 2 bfloat16: which kernel
  at::Tensor kv, k_norm_weight, positions, cos_sin, slots, cache_table;
};

// The device table of per-layer cache addresses and strides context_kv's kernel reads, uploaded
// once per set of caches (the engine's live for its lifetime) and kept: [layers, 2, 3] int64.
inline at::Tensor cache_table(at::TensorList key_caches, at::TensorList value_caches,
                              const at::Device& device) {
  const int64_t layers = static_cast<int64_t>(key_caches.size());
  at::Tensor table = at::empty({layers, 2, 3}, at::kLong);
  auto entry = table.accessor<int64_t, 3>();
  for (int64_t i = 0; i < layers; ++i) {
    for (int kind = 0; kind < 2; ++kind) {
      const at::Tensor& cache = kind == 0 ? key_caches[i] : value_caches[i];
      // A device address as the kernel reads it back: pointer -> uintptr_t -> int64_t.
      entry[i][kind][0] = static_cast<int64_t>(reinterpret_cast<uintptr_t>(cache.data_ptr()));
      entry[i][kind][1] = cache.stride(0);
      entry[i][kind][2] = cache.stride(1);
    }
  }
  static std::mutex lock;
  static std::map<std::vector<int64_t>, at::Tensor> uploaded;
  std::vector<int64_t> key(table.data_ptr<int64_t>(), table.data_ptr<int64_t>() + table.numel());
  key.push_back(static_cast<int64_t>(device.type()));
  key.push_back(device.index());
  std::lock_guard<std::mutex> guard(lock);
  auto it = uploaded.find(key);
  if (it == uploaded.end()) {
    if (uploaded.size() >= 64) uploaded.clear();  // caches come and go with engines: bounded
    it = uploaded.emplace(std::move(key), to_device(table, device)).first;
  }
  return it->second;
}

// When several tokens map to one slot the last one wins, as in the reference; the kernel's blocks
// run in any order, so the earlier tokens are skipped (slot -1) instead of racing.
inline at::Tensor last_writer_slots(const at::Tensor& slots) {
  at::Tensor order = std::get<1>(slots.sort(/*stable=*/std::optional<bool>(true), /*dim=*/0));
  at::Tensor sorted = slots.index_select(0, order);
  at::Tensor last = at::ones_like(sorted, sorted.options().dtype(at::kBool));
  if (slots.size(0) > 1) last.slice(0, 0, -1).copy_(sorted.slice(0, 1) != sorted.slice(0, 0, -1));
  at::Tensor keep = at::empty_like(last).index_put_({order}, last);
  return at::where(keep, slots, at::full_like(slots, -1));
}

inline ContextKvLaunch prepare_context_kv(
    const at::Tensor& hidden, const std::optional<at::Tensor>& fc_weight,
    const at::Tensor& hidden_norm_weight, const at::Tensor& kv_weight,
    const std::optional<at::Tensor>& kv_bias, const at::Tensor& k_norm_weight,
    const at::Tensor& positions, const at::Tensor& cos_sin_cache, const at::Tensor& slot_mapping,
    at::TensorList key_caches, at::TensorList value_caches, double eps, bool check, uint32_t cores,
    uint64_t ub_bytes = kUbBytes) {
  constexpr const char* op = "context_kv";
  checks::context_kv_meta(hidden, fc_weight, hidden_norm_weight, kv_weight, kv_bias, k_norm_weight,
                          positions, cos_sin_cache, slot_mapping, key_caches, value_caches, eps);
  if (check) {  // the index checks read positions and slots back to the host
    const at::Tensor pos = to_host(positions), slots = to_host(slot_mapping);
    checks::context_kv_values(pos.const_data_ptr<int64_t>(), slots.const_data_ptr<int64_t>(),
                              pos.numel(), cos_sin_cache.size(0), key_caches[0].size(0),
                              key_caches[0].size(1));
  }
  const auto dtype = hidden.scalar_type();
  const int64_t layers = k_norm_weight.size(0), d = k_norm_weight.size(1);
  const int64_t hkv = key_caches[0].size(2);
  for (auto [name, caches] :
       {std::pair{"key_caches", key_caches}, std::pair{"value_caches", value_caches}}) {
    for (size_t i = 0; i < caches.size(); ++i) {
      if (caches[i].stride(3) != 1 || caches[i].stride(2) != d)
        fail(op, name, "[", i, "] must have contiguous [Hkv, D] rows for the Ascend kernel");
    }
  }
  const auto elem = static_cast<uint32_t>(at::elementSize(dtype));
  ContextKvLaunch l;
  l.tiling = context_kv_tiling(hidden.size(0), layers, hkv, d, key_caches[0].size(1), elem,
                               static_cast<float>(eps));
  const uint64_t need = context_kv_ub_bytes(l.tiling, elem);
  if (need > ub_bytes)
    fail(op, "Hkv=", hkv, " x D=", d, " over ", layers, " layers needs ", need,
         " bytes of unified buffer in the Ascend kernel, more than the ", ub_bytes, " available");
  l.block_dim = block_dim(hidden.size(0), cores);
  l.dtype_code = dtype == at::kFloat ? 0 : dtype == at::kHalf ? 1 : 2;

  // The GEMMs and the hidden RMSNorm, with exactly the ATen calls of dflash.ops.reference.
  at::Tensor x = fc_weight ? at::linear(hidden, *fc_weight) : hidden;
  at::Tensor xf = x.to(at::kFloat);
  at::Tensor c =
      (xf * at::rsqrt(xf.pow(2).mean(-1, true) + eps) * hidden_norm_weight.to(at::kFloat))
          .to(dtype);
  l.kv = at::linear(c, kv_weight, kv_bias).contiguous();
  l.k_norm_weight = k_norm_weight.contiguous();
  l.positions = positions.contiguous();
  l.cos_sin = cos_sin_cache.contiguous();
  l.slots = last_writer_slots(slot_mapping.contiguous());

  l.cache_table = cache_table(key_caches, value_caches, hidden.device());
  return l;
}

// ---------------------------------------------------------------------------------------------
// paged_attention
// ---------------------------------------------------------------------------------------------

// The value checks of paged_attention (index ranges of cu_query_lens, context_lens and the block
// table): they read the three tensors back to the host, so only a call with check = true makes
// them.
inline void check_paged_attention_values(const at::Tensor& query, const at::Tensor& key_cache,
                                         const at::Tensor& block_table,
                                         const at::Tensor& context_lens,
                                         const at::Tensor& cu_query_lens,
                                         const std::optional<at::Tensor>& tree_mask) {
  const at::Tensor cu = to_host(cu_query_lens), ctx = to_host(context_lens);
  const at::Tensor table = to_host(block_table);
  checks::paged_attention_values(query.size(0), key_cache.size(0), key_cache.size(1),
                                 table.const_data_ptr<int32_t>(), table.size(0), table.size(1),
                                 ctx.const_data_ptr<int32_t>(), cu.const_data_ptr<int32_t>());
  if (tree_mask) {
    const at::Tensor mask = to_host(*tree_mask);
    checks::tree_mask_values(mask.const_data_ptr<uint8_t>(), mask.size(1),
                             cu.const_data_ptr<int32_t>(), table.size(0));
  }
}

struct PagedAttentionLaunch {
  PagedAttentionTiling tiling;
  uint32_t block_dim;  // 0: no query rows, nothing to launch
  int dtype_code;      // 0 float32, 1 float16, 2 bfloat16: which kernel
  at::Tensor query, key, value, key_cache, value_cache, block_table, context_lens, cu_query_lens;
  at::Tensor tree_mask;  // undefined without a tree mask
  at::Tensor out;
};

// Bytes of Sum workspace the kernel reserves for rows of `head_dim` floats.
using SumWorkspace = uint32_t (*)(uint32_t head_dim);
inline uint32_t emulated_sum_workspace(uint32_t head_dim) {
  return sum_tmp_bytes(head_dim, 4);
}

// Checks and tiles a call from shapes alone (plus the values when `check`): the tiling plans
// for the longest sequence there could be, all Tq rows, so it never depends on the lengths, and
// the kernel enumerates its work items from cu_query_lens on the device.
inline PagedAttentionLaunch prepare_paged_attention(
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
    const at::Tensor& key_cache, const at::Tensor& value_cache, const at::Tensor& block_table,
    const at::Tensor& context_lens, const at::Tensor& cu_query_lens, double scale, bool causal,
    bool check, const std::optional<at::Tensor>& tree_mask, const std::optional<at::Tensor>& out,
    uint32_t cores, uint64_t ub_bytes = kUbBytes,
    SumWorkspace sum_workspace = emulated_sum_workspace) {
  constexpr const char* op = "paged_attention";
  checks::paged_attention_meta(query, key, value, key_cache, value_cache, block_table, context_lens,
                               cu_query_lens, scale, causal, tree_mask);
  if (out) checks::paged_attention_out(query, *out);
  // the kernel finds a block at block * block_size rows: a strided cache would be copied whole
  // on every call
  for (const auto& [name, cache] :
       {std::pair{"key_cache", &key_cache}, {"value_cache", &value_cache}})
    if (!cache->is_contiguous())
      fail(op, name, " must be contiguous for the Ascend kernel, got strides ", cache->strides(),
           " (make it contiguous once, not per call)");
  if (check)
    check_paged_attention_values(query, key_cache, block_table, context_lens, cu_query_lens,
                                 tree_mask);
  PagedAttentionLaunch l{};
  l.out = out ? *out : new_output(op, query.sizes(), query.options());
  if (query.numel() == 0) return l;  // no rows, heads or head_dim: nothing to launch
  const int64_t tq = query.size(0), d = query.size(2), hkv = key.size(1);
  const int64_t batch = block_table.size(0);
  const auto elem = static_cast<uint32_t>(query.element_size());
  l.tiling = paged_attention_tiling(query.size(1), hkv, d, key_cache.size(1), block_table.size(1),
                                    tq, causal, static_cast<float>(scale), elem, ub_bytes,
                                    sum_workspace(static_cast<uint32_t>(d)));
  if (l.tiling.q_tile == 0)
    fail(op, "head_dim ", d, " does not fit the Ascend kernel's unified buffer of ", ub_bytes,
         " bytes");
  l.tiling.batch = static_cast<uint32_t>(batch);
  // At most this many items: a sequence of n rows has ceil(n / q_tile) <= n / q_tile + 1 query
  // tiles (none when n = 0), and all of them together no more than Tq.
  const int64_t q_tiles = std::min<int64_t>(tq, tq / l.tiling.q_tile + batch);
  const int64_t head_tiles = ceil_div(l.tiling.group, l.tiling.head_tile);
  l.block_dim = block_dim(q_tiles * hkv * head_tiles, cores);
  l.dtype_code = query.scalar_type() == at::kFloat ? 0 : query.scalar_type() == at::kHalf ? 1 : 2;
  l.query = query.contiguous();
  l.key = key.contiguous();
  l.value = value.contiguous();
  l.key_cache = key_cache;
  l.value_cache = value_cache;
  l.block_table = block_table.contiguous();
  l.context_lens = context_lens.contiguous();
  l.cu_query_lens = cu_query_lens.contiguous();
  if (tree_mask) {
    l.tree_mask = tree_mask->contiguous();
    l.tiling.tree_width = static_cast<uint32_t>(l.tree_mask.size(1));
  }
  return l;
}

}  // namespace dflash::ascend
