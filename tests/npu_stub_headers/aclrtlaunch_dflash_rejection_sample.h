// Stub of the header ascendc_library generates for this kernel, for the syntax check of
// csrc/npu (see README.md): its launch function returns the runtime's status.
#pragma once
#include <cstdint>

#include "acl/acl_base.h"

#ifndef ACLRT_LAUNCH_KERNEL
#define ACLRT_LAUNCH_KERNEL(kernel) aclrtlaunch_##kernel
#endif

extern "C" uint32_t aclrtlaunch_dflash_rejection_sample(uint32_t blockDim, aclrtStream stream,
                                                        void* draft_ids, void* draft_probs,
                                                        void* target_probs, void* is_greedy,
                                                        void* uniform, void* exponential,
                                                        void* out_ids, void* num_accepted,
                                                        RejectionSampleTiling tiling);
