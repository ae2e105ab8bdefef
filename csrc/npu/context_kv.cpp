// NPU launcher of context_kv: the GEMMs run as torch_npu (aclnn) ops in prepare_context_kv, then
// the Ascend C epilogue kernel (ascend_kernels/context_kv.cpp) normalizes, rotates and scatters.
#include "npu/npu_common.h"
// the launch functions ascendc_library generates for the kernels, after the tiling struct
#include "aclrtlaunch_dflash_context_kv_bf16.h"
#include "aclrtlaunch_dflash_context_kv_fp16.h"
#include "aclrtlaunch_dflash_context_kv_fp32.h"

namespace dflash::npu {

void context_kv_npu(const at::Tensor& hidden, const std::optional<at::Tensor>& fc_weight,
                    const at::Tensor& hidden_norm_weight, const at::Tensor& kv_weight,
                    const std::optional<at::Tensor>& kv_bias, const at::Tensor& k_norm_weight,
                    const at::Tensor& positions, const at::Tensor& cos_sin_cache,
                    const at::Tensor& slot_mapping, at::TensorList key_caches,
                    at::TensorList value_caches, double eps, bool check) {
  // the current device is the inputs': the stream, the platform and the allocations follow it
  c10_npu::OptionalNPUGuard guard(hidden.device());
  using namespace dflash::ascend;
  auto l = prepare_context_kv(hidden, fc_weight, hidden_norm_weight, kv_weight, kv_bias,
                              k_norm_weight, positions, cos_sin_cache, slot_mapping, key_caches,
                              value_caches, eps, check, vector_cores(), ub_bytes());
  if (!l.block_dim) return;
  const auto kernel = by_dtype(l.dtype_code, ACLRT_LAUNCH_KERNEL(dflash_context_kv_fp32),
                               ACLRT_LAUNCH_KERNEL(dflash_context_kv_fp16),
                               ACLRT_LAUNCH_KERNEL(dflash_context_kv_bf16));
  run_on_stream("dflash::context_kv", [l, kernel](void* stream) {  // caches: through cache_table
    auto tiling = l.tiling;  // by pointer: the launch copies it into its arguments (npu_common.h)
    return kernel(l.block_dim, stream, gm_ptr(l.kv), gm_ptr(l.k_norm_weight), gm_ptr(l.positions),
                  gm_ptr(l.cos_sin), gm_ptr(l.slots), gm_ptr(l.cache_table), &tiling);
  });
}

}  // namespace dflash::npu

TORCH_LIBRARY_IMPL(dflash, PrivateUse1, m) {
  m.impl("context_kv", &dflash::npu::context_kv_npu);
}
