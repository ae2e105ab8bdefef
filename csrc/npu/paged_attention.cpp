// NPU launcher of the paged_attention Ascend C kernel (ascend_kernels/paged_attention.cpp).
#include "npu/npu_common.h"
#include "out_variants.h"
#include "tiling/tiling_api.h"
// the launch functions ascendc_library generates for the kernels, after the tiling struct
#include "aclrtlaunch_dflash_paged_attention_bf16.h"
#include "aclrtlaunch_dflash_paged_attention_fp16.h"
#include "aclrtlaunch_dflash_paged_attention_fp32.h"

namespace dflash::npu {

// The kernel's Sum workspace: the emulation's reading, or more if CANN's tiling API asks for it.
uint32_t device_sum_workspace(uint32_t head_dim) {
  uint32_t max_bytes = 0, min_bytes = 0;
  AscendC::GetSumMaxMinTmpSize(head_dim, sizeof(float), false, max_bytes, min_bytes);
  return std::max(dflash::ascend::sum_tmp_bytes(head_dim, sizeof(float)), min_bytes);
}

// Attention into `out`, or into a new tensor when it is absent (paged_attention.out).
at::Tensor paged_attention_into(const at::Tensor& query, const at::Tensor& key,
                                const at::Tensor& value, const at::Tensor& key_cache,
                                const at::Tensor& value_cache, const at::Tensor& block_table,
                                const at::Tensor& context_lens, const at::Tensor& cu_query_lens,
                                double scale, bool causal, bool check,
                                const std::optional<at::Tensor>& tree_mask,
                                const std::optional<at::Tensor>& out) {
  // the current device is the inputs': the stream, the platform and the allocations follow it
  c10_npu::OptionalNPUGuard guard(query.device());
  using namespace dflash::ascend;
  auto l = prepare_paged_attention(query, key, value, key_cache, value_cache, block_table,
                                   context_lens, cu_query_lens, scale, causal, check, tree_mask,
                                   out, vector_cores(), ub_bytes(), device_sum_workspace);
  if (l.block_dim) {
    const auto kernel = by_dtype(l.dtype_code, ACLRT_LAUNCH_KERNEL(dflash_paged_attention_fp32),
                                 ACLRT_LAUNCH_KERNEL(dflash_paged_attention_fp16),
                                 ACLRT_LAUNCH_KERNEL(dflash_paged_attention_bf16));
    run_on_stream("dflash::paged_attention", [l, kernel](void* stream) {  // the copy keeps them
      auto tiling = l.tiling;  // by pointer: the launch copies it (npu_common.h)
      return kernel(l.block_dim, stream, gm_ptr(l.query), gm_ptr(l.key), gm_ptr(l.value),
                    gm_ptr(l.key_cache), gm_ptr(l.value_cache), gm_ptr(l.block_table),
                    gm_ptr(l.context_lens), gm_ptr(l.cu_query_lens), gm_ptr(l.tree_mask),
                    gm_ptr(l.out), &tiling);
    });
  }
  return l.out;
}

}  // namespace dflash::npu

TORCH_LIBRARY_IMPL(dflash, PrivateUse1, m) {
  using dflash::npu::paged_attention_into;
  m.impl("paged_attention", &dflash::variants::paged_attention<paged_attention_into>);
  m.impl("paged_attention.out", &dflash::variants::paged_attention_out<paged_attention_into>);
}
