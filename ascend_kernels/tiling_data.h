// Tiling structs: computed on the host (tiling.h), copied to GM, read by the kernels.
// Only 32-bit fields, so a kernel can copy them word by word from GM.
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
