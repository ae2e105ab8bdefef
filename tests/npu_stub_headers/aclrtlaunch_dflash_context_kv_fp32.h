// Stub of the header ascendc_library generates for this kernel, for the syntax check of
// csrc/npu (see README.md): its launch function returns the runtime's status.
#pragma once
#include <cstdint>

#include "acl/acl_base.h"

#ifndef ACLRT_LAUNCH_KERNEL
#define ACLRT_LAUNCH_KERNEL(kernel) aclrtlaunch_##kernel
#endif

extern "C" uint32_t aclrtlaunch_dflash_context_kv_fp32(uint32_t blockDim, aclrtStream stream,
                                                       void* kv, void* k_norm_weight,
                                                       void* positions, void* cos_sin,
                                                       void* slot_mapping, void* cache_table,
                                                       ContextKvTiling tiling);
