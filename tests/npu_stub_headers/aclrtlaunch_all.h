// Stub of the headers ascendc_library generates, one per kernel (aclrtlaunch_<kernel>.h), for
// the syntax check of csrc/npu (see README.md): each launch function returns the runtime's
// status, and takes a kernel's tiling struct by pointer (the generated stub copies it into the
// launch arguments). Declared after the tiling structs (the launchers include them first).
#pragma once
#include <cstdint>

#include "acl/acl_base.h"

#ifndef ACLRT_LAUNCH_KERNEL
#define ACLRT_LAUNCH_KERNEL(kernel) aclrtlaunch_##kernel
#endif

extern "C" uint32_t aclrtlaunch_dflash_context_kv_bf16(uint32_t blockDim, aclrtStream stream,
                                                       void* kv, void* k_norm_weight,
                                                       void* positions, void* cos_sin,
                                                       void* slot_mapping, void* cache_table,
                                                       ContextKvTiling* tiling);
extern "C" uint32_t aclrtlaunch_dflash_context_kv_fp16(uint32_t blockDim, aclrtStream stream,
                                                       void* kv, void* k_norm_weight,
                                                       void* positions, void* cos_sin,
                                                       void* slot_mapping, void* cache_table,
                                                       ContextKvTiling* tiling);
extern "C" uint32_t aclrtlaunch_dflash_context_kv_fp32(uint32_t blockDim, aclrtStream stream,
                                                       void* kv, void* k_norm_weight,
                                                       void* positions, void* cos_sin,
                                                       void* slot_mapping, void* cache_table,
                                                       ContextKvTiling* tiling);
extern "C" uint32_t aclrtlaunch_dflash_paged_attention_bf16(uint32_t blockDim, aclrtStream stream,
                                                            void* query, void* key, void* value,
                                                            void* key_cache, void* value_cache,
                                                            void* block_table, void* context_lens,
                                                            void* cu_query_lens, void* tree_mask,
                                                            void* out, PagedAttentionTiling* tiling);
extern "C" uint32_t aclrtlaunch_dflash_paged_attention_fp16(uint32_t blockDim, aclrtStream stream,
                                                            void* query, void* key, void* value,
                                                            void* key_cache, void* value_cache,
                                                            void* block_table, void* context_lens,
                                                            void* cu_query_lens, void* tree_mask,
                                                            void* out, PagedAttentionTiling* tiling);
extern "C" uint32_t aclrtlaunch_dflash_paged_attention_fp32(uint32_t blockDim, aclrtStream stream,
                                                            void* query, void* key, void* value,
                                                            void* key_cache, void* value_cache,
                                                            void* block_table, void* context_lens,
                                                            void* cu_query_lens, void* tree_mask,
                                                            void* out, PagedAttentionTiling* tiling);
extern "C" uint32_t aclrtlaunch_dflash_rejection_sample(uint32_t blockDim, aclrtStream stream,
                                                        void* draft_ids, void* draft_probs,
                                                        void* target_probs, void* is_greedy,
                                                        void* uniform, void* exponential,
                                                        void* out_ids, void* num_accepted,
                                                        RejectionSampleTiling* tiling);
