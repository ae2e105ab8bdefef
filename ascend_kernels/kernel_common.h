// Helpers shared by dflash's Ascend C kernels (device code).
#pragma once

#include "kernel_operator.h"
#include "tiling_data.h"

namespace dflash_kernels {

template <typename A, typename B>
struct IsSame {
  static constexpr bool value = false;
};
template <typename A>
struct IsSame<A, A> {
  static constexpr bool value = true;
};

// DMA into the UB writes whole 32-byte blocks, so buffers are sized in them.
__aicore__ inline uint32_t Align32(uint32_t bytes) { return (bytes + 31) / 32 * 32; }

// Tiling structs hold 32-bit words only; scalar loads copy them out of GM.
template <typename T>
__aicore__ inline void LoadTiling(T& tiling, GM_ADDR src) {
  auto* words = reinterpret_cast<uint32_t*>(&tiling);
  auto* gm = reinterpret_cast<__gm__ uint32_t*>(src);
  for (uint32_t i = 0; i < sizeof(T) / sizeof(uint32_t); ++i) words[i] = gm[i];
}

// GM -> UB of `count` contiguous elements: DataCopy when it is whole 32-byte blocks, else
// DataCopyPad (a DataCopy would drop the tail).
template <typename T>
__aicore__ inline void CopyIn(const AscendC::LocalTensor<T>& dst,
                              const AscendC::GlobalTensor<T>& src, uint32_t count) {
  if (count * sizeof(T) % 32 == 0) {
    AscendC::DataCopy(dst, src, count);
  } else {
    AscendC::DataCopyExtParams params{1, static_cast<uint32_t>(count * sizeof(T)), 0, 0, 0};
    AscendC::DataCopyPadExtParams<T> pad{false, 0, 0, 0};
    AscendC::DataCopyPad(dst, src, params, pad);
  }
}

// UB -> GM of exactly `count` elements (DataCopyPad never writes past the end, so neighbouring rows
// owned by other blocks stay intact).
template <typename T>
__aicore__ inline void CopyOut(const AscendC::GlobalTensor<T>& dst,
                               const AscendC::LocalTensor<T>& src, uint32_t count) {
  AscendC::DataCopyExtParams params{1, static_cast<uint32_t>(count * sizeof(T)), 0, 0, 0};
  AscendC::DataCopyPad(dst, src, params);
}

}  // namespace dflash_kernels
