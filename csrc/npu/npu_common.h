// What the NPU launchers ask the device: vector cores and unified-buffer size (CANN platform API).
// Compiled only by the NPU build (ascend_kernels/CMakeLists.txt).
#pragma once

#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>

#include "npu/ascend_host.h"
#include "tiling/platform/platform_ascendc.h"
#include "torch_npu/csrc/core/npu/NPUGuard.h"
#include "torch_npu/csrc/core/npu/NPUStream.h"
#include "torch_npu/csrc/framework/OpCommand.h"

namespace dflash::ascend {

// CANN's description of the device; null when CANN cannot read it (no visible NPU, set_env.sh
// not sourced), which is an error here rather than a crash.
inline platform_ascendc::PlatformAscendC& platform() {
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

// The kernel of a dtype code (0: float32, 1: float16, 2: bfloat16) among its three instances.
template <typename Kernel>
Kernel by_dtype(int dtype_code, Kernel fp32, Kernel fp16, Kernel bf16) {
  return dtype_code == 0 ? fp32 : dtype_code == 1 ? fp16 : bf16;
}

// Queues `launch(stream)` on the caller's current NPU stream through torch_npu's task queue. The
// handler runs on the task queue's thread, where the current stream is that thread's own: the
// stream is read here, in the calling thread (so `torch.npu.stream(s)` and graph capture see the
// kernel on their stream), and captured. `launch` returns the runtime's status for the launch
// (the generated aclrtlaunch_<kernel> functions do; `<<<>>>` gives none): a failure is reported
// under the op's name, and the handler returns it, so torch_npu fails the op's task with it
// (the handler cannot throw: it may run on the queue's thread). A generated launch function
// takes the kernel's tiling struct by pointer and copies it into the launch's arguments, so the
// tiling needs no copy to the device of its own.
template <typename Launch>
void run_on_stream(const char* name, Launch launch) {
  void* stream = c10_npu::getCurrentNPUStream().stream(false);
  at_npu::native::OpCommand cmd;
  cmd.Name(name);
  cmd.SetCustomHandler([name, launch, stream]() -> int {
    const uint32_t status = launch(stream);
    if (status != 0)
      std::fprintf(stderr, "dflash: launching %s failed: aclrtlaunch returned %u\n", name,
                   static_cast<unsigned>(status));
    return static_cast<int>(status);
  });
  cmd.Run();
}

}  // namespace dflash::ascend
