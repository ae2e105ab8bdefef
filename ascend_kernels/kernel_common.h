// Helpers shared by dflash's Ascend C kernels (device code).
#pragma once

#include "kernel_operator.h"
#include "tiling_data.h"

namespace dflash::ascend::kernel {

template <typename A, typename B>
struct IsSame {
  static constexpr bool value = false;
};
template <typename A>
struct IsSame<A, A> {
  static constexpr bool value = true;
};

// Flag IDs come from the pipe's pool, which the queues draw from too (EnQue and FreeTensor hold
// theirs until DeQue / the next AllocTensor), so kernels never hard-code one.

// A SetFlag / WaitFlag pair that follows at once, on an ID nobody holds.
template <AscendC::HardEvent E>
__aicore__ inline void Sync(AscendC::TPipe& pipe) {
  const int32_t id = pipe.FetchEventID(E);
  AscendC::SetFlag<E>(id);
  AscendC::WaitFlag<E>(id);
}

// A flag set at the end of one iteration and waited before the next one reuses what it guards, on
// an ID held from Init to Release (Release waits for the last one).
template <AscendC::HardEvent E>
class CarriedFlag {
 public:
  __aicore__ inline void Init(AscendC::TPipe& pipe) { id_ = pipe.AllocEventID<E>(); }
  __aicore__ inline void Set() {
    AscendC::SetFlag<E>(id_);
    set_ = true;
  }
  __aicore__ inline void Wait() {
    if (set_) AscendC::WaitFlag<E>(id_);
    set_ = false;
  }
  __aicore__ inline void Release(AscendC::TPipe& pipe) {
    Wait();
    pipe.ReleaseEventID<E>(id_);
  }

 private:
  int32_t id_ = 0;
  bool set_ = false;
};

// DMA into the UB writes whole 32-byte blocks, so buffers are sized in them.
__aicore__ inline uint32_t Align32(uint32_t bytes) {
  return (bytes + 31) / 32 * 32;
}

__aicore__ inline uint32_t Min(uint32_t a, uint32_t b) {
  return a < b ? a : b;
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

}  // namespace dflash::ascend::kernel
