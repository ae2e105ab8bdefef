// Writing tokens' K/V rows into paged caches [num_blocks, block_size, Hkv, D] (context_kv and
// qkv_rope_cache).
#pragma once

#include <cstring>
#include <string>
#include <unordered_set>
#include <vector>

#include "cpu/common.h"

namespace dflash::cpu {

// Kernel-only limit of qkv_rope_cache: it stores rows as whole heads, so its caches need a
// contiguous head_dim; every other stride is free (separate tensors, views of one stacked tensor,
// K/V interleaved). context_kv takes any strides (CacheView::store_head).
inline void check_cache_layout(const char* op, const std::string& name, const at::Tensor& cache) {
  DFLASH_CHECK(cache.size(3) <= 1 || cache.stride(3) == 1, op, name, " has strides ",
               cache.strides(), "; the CPU kernel needs a contiguous head_dim (stride 1 in dim 3)");
}

template <typename T>
struct CacheView {
  T* data;
  int64_t block_size, block_stride, slot_stride, head_stride, dim_stride;

  explicit CacheView(const at::Tensor& cache)
      : data(cache.mutable_data_ptr<T>()),
        block_size(cache.size(1)),
        block_stride(cache.stride(0)),
        slot_stride(cache.stride(1)),
        head_stride(cache.stride(2)),
        dim_stride(cache.size(3) <= 1 ? 1 : cache.stride(3)) {}
  T* slot(int64_t slot) const {
    return data + slot / block_size * block_stride + slot % block_size * slot_stride;
  }
  // Store one head's d values (contiguous in `src`) at `dst`, d elements dim_stride apart: caches
  // whose blocks keep K transposed ([D, block_size] per head, as vLLM's CPU attention does).
  void store_head(const T* src, T* dst, int64_t d) const {
    if (dim_stride == 1) {
      std::memcpy(dst, src, d * sizeof(T));
      return;
    }
    for (int64_t i = 0; i < d; ++i) dst[i * dim_stride] = src[i];
  }
};

// Tokens that store: slot != -1, and no later token maps to the same slot (the reference writes
// tokens in order, so the last one wins; skipping the others keeps a parallel pass race-free).
inline std::vector<uint8_t> tokens_to_store(const int64_t* slots, int64_t n) {
  std::vector<uint8_t> store(n, 0);
  std::unordered_set<int64_t> taken;
  taken.reserve(n);
  for (int64_t t = n - 1; t >= 0; --t) store[t] = slots[t] != -1 && taken.insert(slots[t]).second;
  return store;
}

}  // namespace dflash::cpu
