// Stub for the syntax check of csrc/npu (see ../../README.md).
#pragma once
#include <cstdint>

namespace platform_ascendc {
enum class CoreMemType { L0_A, L0_B, L0_C, L1, L2, UB, HBM };
// the device's description: what GetInstance() returns
class PlatformAscendC {
 public:
  uint32_t GetCoreNumAiv() const;
  void GetCoreMemSize(const CoreMemType& mem_type, uint64_t& size) const;
};
class PlatformAscendCManager {
 public:
  static PlatformAscendC* GetInstance();
};
}  // namespace platform_ascendc
