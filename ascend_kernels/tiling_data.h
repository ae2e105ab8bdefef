// Tiling structs: computed on the host (tiling.h) and passed to the kernels by value, as kernel
// arguments (the launch packs them with the other arguments: no copy to GM before a launch).
#pragma once

struct RejectionSampleTiling {
  uint32_t batch;       // sequences (Bs)
  uint32_t drafts;      // draft tokens per sequence (K)
  uint32_t vocab;       // V
  uint32_t dense;       // 1: draft_probs given, 0: one-hot proposals
  uint32_t tile;        // vocabulary elements per UB tile, a multiple of 64 (256 bytes)
  uint32_t reduce_tmp;  // float elements of the reduction workspace
};

struct ContextKvTiling {
  uint32_t tokens;      // N
  uint32_t layers;      // L
  uint32_t kv_heads;    // Hkv
  uint32_t head_dim;    // D
  uint32_t half_pad;    // elements of one half head (D/2) padded to 32 bytes in the cache dtype
  uint32_t block_size;  // cache slots per block
  uint32_t reduce_tmp;  // float elements of the reduction workspace
  float eps;
};

// One paged_attention work item: query positions [q0, q0 + qn) of sequence `seq` (relative to the
// sequence's first row), query heads [h0, h0 + hn) of kv head `kv_head`'s group. The kernel
// enumerates them itself (ascend_kernels/paged_attention.cpp).
struct PagedAttentionItem {
  uint32_t seq;
  uint32_t kv_head;
  uint32_t q0;
  uint32_t qn;
  uint32_t h0;
  uint32_t hn;
};

// The kernel keeps each row's running max and sum in scalar registers: at most this many rows
// (query positions x heads) per work item.
constexpr uint32_t kPagedAttentionMaxRows = 256;

struct PagedAttentionTiling {
  uint32_t batch;       // sequences (rows of block_table)
  uint32_t q_heads;     // Hq
  uint32_t kv_heads;    // Hkv
  uint32_t head_dim;    // D
  uint32_t head_pad;    // D rounded up to 32 bytes of the input dtype: a head's stride in the UB
  uint32_t block_size;  // cache slots per block
  uint32_t max_blocks;  // block_table row length
  uint32_t group;       // Hq / Hkv
  uint32_t q_tile;      // query positions per work item (at most)
  uint32_t head_tile;   // query heads of one group per work item (at most)
  uint32_t kv_tile;     // keys per chunk (at most; a chunk never crosses a cache block)
  uint32_t causal;      // 1: new token i sees the context and new tokens 0..i
  uint32_t reduce_tmp;  // float elements of the ReduceMax / ReduceSum workspace
  uint32_t sum_tmp;     // bytes of the Sum workspace (row sums of kv_tile x head_dim products)
  float scale;
  uint32_t tree_width;  // bytes per row of tree_mask (0: no tree mask; docs/design.md 3.2)
};
