// Stub for the syntax check of csrc/npu (see ../README.md).
#pragma once
#include <cstdint>

namespace AscendC {
void GetSumMaxMinTmpSize(const uint32_t n, const uint32_t typeSize, const bool isReuseSource,
                         uint32_t& maxSize, uint32_t& minSize);
}  // namespace AscendC
