// Stand-in for CANN's "kernel_operator.h" when the Ascend C kernels are compiled for x86 (tests).
// It provides the subset of the Ascend C API that dflash's kernels use, written from the public
// API documentation, and checks the hardware rules listed in ascend_kernels/README.md.
#pragma once

#include "emu_copy.h"
#include "emu_runtime.h"
#include "emu_tensor.h"
#include "emu_types.h"
#include "emu_vector.h"

// Kernel task types (a kernel's first statement declares one: KERNEL_TASK_TYPE_DEFAULT).
enum KernelTaskTypeValue {
  KERNEL_TYPE_AIV_ONLY,
  KERNEL_TYPE_AIC_ONLY,
  KERNEL_TYPE_MIX_AIV_1_0,
  KERNEL_TYPE_MIX_AIC_1_0,
  KERNEL_TYPE_MIX_AIC_1_1,
  KERNEL_TYPE_MIX_AIC_1_2,
};

namespace dflash::emu {
inline void declare_kernel_type(KernelTaskTypeValue type) {
  if (type == KERNEL_TYPE_AIC_ONLY || type == KERNEL_TYPE_MIX_AIC_1_0)
    fail("kernel-type", "the emulation runs vector cores only");
  block().declare(type == KERNEL_TYPE_AIV_ONLY ? KernelType::kAivOnly : KernelType::kMix);
}
}  // namespace dflash::emu

#define KERNEL_TASK_TYPE_DEFAULT(type) dflash::emu::declare_kernel_type(type)
