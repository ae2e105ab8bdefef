// Stub for the syntax check of csrc/npu (see ../../../../README.md).
#pragma once

namespace c10_npu {
class NPUStream {
 public:
  void* stream(const bool need_empty) const;  // aclrtStream
};
NPUStream getCurrentNPUStream(signed char device_index = -1);
}  // namespace c10_npu
