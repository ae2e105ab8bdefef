// Stub for the syntax check of csrc/npu (see ../../../../README.md).
#pragma once
#include <c10/core/Device.h>

#include <optional>

namespace c10_npu {
// Sets the current NPU to `device` for its lifetime (torch_npu's c10_npu::OptionalNPUGuard).
class OptionalNPUGuard {
 public:
  explicit OptionalNPUGuard(std::optional<c10::Device> device);
  ~OptionalNPUGuard();
};
}  // namespace c10_npu
