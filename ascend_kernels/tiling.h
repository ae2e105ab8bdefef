// Host-side tiling of dflash's Ascend C kernels. The NPU launchers (csrc/npu/) and the emulated
// launchers of the tests both include this header, so the emulation runs the kernels with exactly
// the parameters the NPU gets.
#pragma once

#include <algorithm>
#include <cstdint>

#include "tiling_data.h"

namespace dflash::ascend {

constexpr uint64_t kUbBytes = 192 * 1024;  // unified buffer of one 910B vector core
// Select in tensor-scalar mode stores its scalar in the UB's last 8 KiB: kernels that use it plan
// their buffers below this.
constexpr uint64_t kSelectUbBytes = 184 * 1024;

inline uint64_t align32(uint64_t bytes) {
  return (bytes + 31) / 32 * 32;
}

inline uint32_t ceil_div(uint32_t a, uint32_t b) {
  return (a + b - 1) / b;
}

// Workspace of the count-form reductions: one (value, index) pair per 256-byte repeat.
inline uint32_t reduce_tmp_elems(uint32_t count, uint32_t elem_bytes) {
  const uint64_t repeats = (static_cast<uint64_t>(count) * elem_bytes + 255) / 256;
  return static_cast<uint32_t>(align32(repeats * 2 * elem_bytes) / elem_bytes);
}

// The UB the rejection_sample kernel's InitBuffer calls take.
inline uint64_t rejection_sample_ub_bytes(const RejectionSampleTiling& t) {
  const uint64_t tile = align32(uint64_t{t.tile} * 4);
  const uint64_t queues = (t.dense ? 3 : 2) * 2 * tile;  // p, e (and q), double buffered
  return queues + 3 * tile + align32(t.tile / 8) + align32(uint64_t{t.reduce_tmp} * 4) +
         align32(3 * 8 * 4) + align32((uint64_t{t.drafts} + 1) * 8) + align32(8);
}

// The largest vocabulary tile (a multiple of 64 floats, so Compare sees whole 256-byte repeats;
// at most `max_tile` when non-zero) whose buffers fit in `ub_bytes`, and below the UB Select
// reserves (the kernel's argmax uses it). tile == 0: nothing fits.
inline RejectionSampleTiling rejection_sample_tiling(uint32_t batch, uint32_t drafts,
                                                     uint32_t vocab, bool dense,
                                                     uint64_t ub_bytes = kUbBytes,
                                                     uint32_t max_tile = 0) {
  RejectionSampleTiling t{batch, drafts, vocab, dense ? 1u : 0u, 0, 0};
  ub_bytes = std::min(ub_bytes, kSelectUbBytes);
  uint32_t cap = (vocab + 63) / 64 * 64;
  if (max_tile) cap = std::min(cap, std::max(64u, max_tile / 64 * 64));
  for (uint32_t tile = cap; tile >= 64; tile -= 64) {
    t.tile = tile;
    t.reduce_tmp = reduce_tmp_elems(tile, 4);
    if (rejection_sample_ub_bytes(t) <= ub_bytes) return t;
  }
  t.tile = 0;
  return t;
}

// Half a head (D / 2 elements) rounded up to 32 bytes of the cache dtype: its stride in the UB.
inline uint32_t context_kv_half_pad(uint32_t head_dim, uint32_t elem_bytes) {
  return static_cast<uint32_t>(align32(uint64_t{head_dim} / 2 * elem_bytes) / elem_bytes);
}

inline ContextKvTiling context_kv_tiling(uint32_t tokens, uint32_t layers, uint32_t kv_heads,
                                         uint32_t head_dim, uint32_t block_size,
                                         uint32_t elem_bytes, float eps) {
  const uint32_t pad = context_kv_half_pad(head_dim, elem_bytes);
  return ContextKvTiling{
      tokens, layers, kv_heads, head_dim, pad, block_size, reduce_tmp_elems(2 * pad, 4), eps};
}

// The UB the context_kv kernel's InitBuffer calls take for a cache dtype of `elem_bytes`.
inline uint64_t context_kv_ub_bytes(const ContextKvTiling& t, uint32_t elem_bytes) {
  const uint64_t lanes = uint64_t{t.kv_heads} * 2 * t.half_pad;
  const uint64_t weights = 2ull * t.layers * t.half_pad;
  uint64_t bytes = 2 * 2 * align32(lanes * elem_bytes);  // K in / out queues, double buffered
  if (elem_bytes != 4) bytes += align32(lanes * 4) + align32(weights * elem_bytes);  // float copies
  bytes += 2 * align32(lanes * 4) + align32(weights * 4);            // products, weights
  bytes += align32(2 * ((t.head_dim / 2 + 7) / 8 * 8) * 4);          // cos | sin
  bytes += align32(uint64_t{t.kv_heads} * t.head_dim * elem_bytes);  // V row
  bytes += 2 * align32(uint64_t{t.kv_heads} * 8 * 4) + align32(uint64_t{t.reduce_tmp} * 4);
  return bytes;
}

// Workspace of Sum over rows of `n` elements: one partial per 32-byte block of a row. This is the
// emulation's reading of the API; the NPU launchers use the larger of it and CANN's
// GetSumMaxMinTmpSize.
inline uint32_t sum_tmp_bytes(uint32_t n, uint32_t elem_bytes) {
  return static_cast<uint32_t>(align32((uint64_t{n} * elem_bytes + 31) / 32 * elem_bytes));
}

// A head of D elements padded to 32 bytes of the input dtype (DataCopyPad's UB row footprint).
inline uint32_t head_pad(uint32_t head_dim, uint32_t elem_bytes) {
  return static_cast<uint32_t>(align32(uint64_t{head_dim} * elem_bytes) / elem_bytes);
}

// The UB the paged_attention kernel's InitBuffer calls take for an input dtype of `elem_bytes`.
inline uint64_t paged_attention_ub_bytes(const PagedAttentionTiling& t, uint32_t elem_bytes) {
  const uint64_t rows = uint64_t{t.q_tile} * t.head_tile;
  const uint64_t row = uint64_t{t.head_pad} * 4, keys = uint64_t{t.kv_tile} * t.head_pad;
  uint64_t bytes = 2 * rows * row;              // queries and output accumulators, float
  bytes += 2 * 2 * align32(keys * elem_bytes);  // K and V chunks, double buffered
  bytes += keys * 4;                            // products
  if (elem_bytes != 4) bytes += align32(rows * t.head_pad * elem_bytes) + 2 * keys * 4;
  bytes += align32((uint64_t{t.kv_tile} + 1) * 4) + align32(2 * 8 * 4);  // scores, results
  return bytes + align32(uint64_t{t.reduce_tmp} * 4) + align32(t.sum_tmp);
}

// Work items hold whole GQA groups and as many query positions as fit (K/V are read once per
// item); chunks hold up to 32 keys. When the UB is too small, chunks shrink to 16 keys first, then
// items take fewer positions, then fewer heads of the group; only then do chunks go below 16 keys
// (8, then down to 1), again with the largest items that fit. Split items are then evened out.
// q_tile == 0: nothing fits.
inline PagedAttentionTiling paged_attention_tiling(uint32_t q_heads, uint32_t kv_heads,
                                                   uint32_t head_dim, uint32_t block_size,
                                                   uint32_t max_blocks, uint32_t max_query_len,
                                                   bool causal, float scale, uint32_t elem_bytes,
                                                   uint64_t ub_bytes, uint32_t sum_tmp) {
  const uint32_t group = q_heads / kv_heads;
  PagedAttentionTiling t{
      0,          q_heads,          kv_heads, head_dim, head_pad(head_dim, elem_bytes),
      block_size, max_blocks,       group,    0,        0,
      0,          causal ? 1u : 0u, 0,        sum_tmp,  scale,
      0};
  const uint32_t query_len = std::max(max_query_len, 1u);
  auto fits = [&](uint32_t q, uint32_t heads, uint32_t kv) {
    t.q_tile = q;
    t.head_tile = heads;
    t.kv_tile = kv;
    t.reduce_tmp = reduce_tmp_elems(kv + 1, 4);
    return paged_attention_ub_bytes(t, elem_bytes) <= ub_bytes;
  };
  for (uint32_t min_kv : {16u, 8u, 1u}) {
    for (uint32_t heads = group; heads >= 1; heads = heads == 1 ? 0 : (heads + 1) / 2) {
      for (uint32_t q = std::min(query_len, kPagedAttentionMaxRows / heads); q >= 1; --q) {
        for (uint32_t kv = 32; kv >= min_kv; kv /= 2) {
          if (!fits(q, heads, kv)) continue;
          // As many items as needed, but of even sizes (16 positions: 8 + 8 rather than 15 + 1);
          // the room that frees may take larger chunks (at worst kv fits again).
          const uint32_t even_q = ceil_div(query_len, ceil_div(query_len, q));
          const uint32_t even_heads = ceil_div(group, ceil_div(group, heads));
          for (uint32_t larger = 32; !fits(even_q, even_heads, larger); larger /= 2) {
          }
          return t;
        }
      }
    }
  }
  t.q_tile = 0;
  return t;
}

// One block per work item (sequence or token) up to the number of vector cores.
inline uint32_t block_dim(uint64_t items, uint32_t cores) {
  return static_cast<uint32_t>(std::min<uint64_t>(items, std::max(cores, 1u)));
}

}  // namespace dflash::ascend
