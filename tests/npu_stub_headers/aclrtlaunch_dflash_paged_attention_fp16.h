// Stub of the header ascendc_library generates for this kernel, for the syntax check of
// csrc/npu (see README.md): its launch function returns the runtime's status.
#pragma once
#include <cstdint>

#include "acl/acl_base.h"

#ifndef ACLRT_LAUNCH_KERNEL
#define ACLRT_LAUNCH_KERNEL(kernel) aclrtlaunch_##kernel
#endif

extern "C" uint32_t aclrtlaunch_dflash_paged_attention_fp16(uint32_t blockDim, aclrtStream stream,
                                                            void* query, void* key, void* value,
                                                            void* key_cache, void* value_cache,
                                                            void* block_table, void* context_lens,
                                                            void* cu_query_lens, void* tree_mask,
                                                            void* out, PagedAttentionTiling tiling);
