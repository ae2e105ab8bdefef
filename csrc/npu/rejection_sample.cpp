// NPU launcher of the rejection_sample Ascend C kernel (ascend_kernels/rejection_sample.cpp).
#include "npu/npu_common.h"
#include "out_variants.h"
// the launch function ascendc_library generates for the kernel, after the tiling struct
#include "aclrtlaunch_dflash_rejection_sample.h"

namespace dflash::npu {

// Into `out_ids` / `num_out` (rejection_sample.out), or into new tensors when they are absent.
std::tuple<at::Tensor, at::Tensor> sample_into(
    const at::Tensor& draft_token_ids, const std::optional<at::Tensor>& draft_probs,
    const at::Tensor& target_probs, const at::Tensor& is_greedy, const at::Tensor& uniform,
    const at::Tensor& exponential, bool check, const std::optional<at::Tensor>& out_ids,
    const std::optional<at::Tensor>& num_out) {
  // the current device is the inputs': the stream, the platform and the allocations follow it
  c10_npu::OptionalNPUGuard guard(draft_token_ids.device());
  using namespace dflash::ascend;
  auto l =
      prepare_rejection_sample(draft_token_ids, draft_probs, target_probs, is_greedy, uniform,
                               exponential, check, out_ids, num_out, vector_cores(), ub_bytes());
  if (l.block_dim) {
    run_on_stream("dflash::rejection_sample", [l](void* stream) {  // the copy keeps them alive
      auto tiling = l.tiling;  // by pointer: the launch copies it (npu_common.h)
      return ACLRT_LAUNCH_KERNEL(dflash_rejection_sample)(
          l.block_dim, stream, gm_ptr(l.draft_ids), gm_ptr(l.draft_probs), gm_ptr(l.target_probs),
          gm_ptr(l.is_greedy), gm_ptr(l.uniform), gm_ptr(l.exponential), gm_ptr(l.out_ids),
          gm_ptr(l.num_accepted), &tiling);
    });
  }
  return {l.out_ids, l.num_accepted};
}

}  // namespace dflash::npu

TORCH_LIBRARY_IMPL(dflash, PrivateUse1, m) {
  using dflash::npu::sample_into;
  m.impl("rejection_sample", &dflash::variants::rejection_sample<sample_into>);
  m.impl("rejection_sample.out", &dflash::variants::rejection_sample_out<sample_into>);
}
