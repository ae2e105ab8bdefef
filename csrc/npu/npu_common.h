// What the NPU launchers ask the device: vector cores and unified-buffer size (CANN platform API).
// Compiled only by the NPU build (ascend_kernels/CMakeLists.txt).
#pragma once

#include <torch/library.h>

#include <algorithm>

#include "npu/ascend_host.h"
#include "tiling/platform/platform_ascendc.h"
#include "torch_npu/csrc/core/npu/NPUGuard.h"
#include "torch_npu/csrc/core/npu/NPUStream.h"
#include "torch_npu/csrc/framework/OpCommand.h"

namespace dflash::ascend {

// CANN's description of the device; null when CANN cannot read it (no visible NPU, set_env.sh
// not sourced), which is an error here rather than a crash.
inline platform_ascendc::PlatformAscendCManager& platform() {
  auto* p = platform_ascendc::PlatformAscendCManager::GetInstance();
  TORCH_CHECK(p != nullptr,
              "dflash: CANN's platform information is unavailable "
              "(PlatformAscendCManager::GetInstance() returned null): is an NPU visible and "
              "CANN's set_env.sh sourced?");
  return *p;
}

inline uint32_t vector_cores() {
  return platform().GetCoreNumAiv();
}

inline uint64_t ub_bytes() {
  uint64_t ub = 0;
  platform().GetCoreMemSize(platform_ascendc::CoreMemType::UB, ub);
  return ub ? std::min(ub, kUbBytes) : kUbBytes;
}

// Queues `launch(stream)` on the caller's current NPU stream through torch_npu's task queue. The
// handler runs on the task queue's thread, where the current stream is that thread's own: the
// stream is read here, in the calling thread (so `torch.npu.stream(s)` and graph capture see the
// kernel on their stream), and captured.
template <typename Launch>
void run_on_stream(const char* name, Launch launch) {
  void* stream = c10_npu::getCurrentNPUStream().stream(false);
  at_npu::native::OpCommand cmd;
  cmd.Name(name);
  cmd.SetCustomHandler([launch, stream]() -> int {
    launch(stream);
    return 0;
  });
  cmd.Run();
}

}  // namespace dflash::ascend
