// DataCopy (32-byte granular DMA) and DataCopyPad (byte-exact DMA with UB-side padding).
#pragma once

#include "emu_tensor.h"

namespace AscendC {

struct DataCopyExtParams {
  uint16_t blockCount = 0;
  uint32_t blockLen = 0;   // bytes per block
  uint32_t srcStride = 0;  // gap between blocks: bytes in GM, 32-byte units in UB
  uint32_t dstStride = 0;  // likewise
  uint32_t rsv = 0;
};

template <typename T>
struct DataCopyPadExtParams {
  bool isPad = false;        // fill the padding with paddingValue (else its contents are unknown)
  uint8_t leftPadding = 0;   // elements before each block in UB
  uint8_t rightPadding = 0;  // elements after each block in UB
  T paddingValue = 0;
};

namespace detail {

// Every UB operand of a DMA or vector instruction starts 32-byte aligned and stays in its buffer.
template <typename T>
void ub_operand(const LocalTensor<T>& t, uint32_t bytes, const char* what,
                uint32_t align = dflash::emu::kAlign) {
  if (t.offset() % align)
    dflash::emu::fail("alignment", what, " starts at UB byte ", t.offset(), ", not ", align,
                      "-byte aligned");
  if (bytes > t.GetSize() * sizeof(T))
    dflash::emu::fail("ub-bounds", what, " covers ", bytes, " bytes of a tensor of ",
                      t.GetSize() * sizeof(T));
}

// A2 moves DataCopyPad data between GM and VECIN / VECOUT buffers only (GM <-> VECCALC is
// documented for newer SoCs).
template <typename T>
void pad_position(const LocalTensor<T>& t, const char* what) {
  if (t.position() != TPosition::VECIN && t.position() != TPosition::VECOUT)
    dflash::emu::fail("dma-position", what,
                      " on a VECCALC buffer: on A2 DataCopyPad moves data between "
                      "GM and VECIN / VECOUT buffers only (use a TQue or a TBuf<VECIN / VECOUT>)");
}

inline void dma_blocks(uint32_t bytes, const char* what) {
  if (bytes % dflash::emu::kAlign)
    dflash::emu::fail(
        "dma-granularity", what, " moves ", bytes, " bytes, not a multiple of 32: the hardware ",
        "moves whole 32-byte blocks, so the tail would be lost or overrun (use DataCopyPad)");
}

inline void pad_params(const DataCopyExtParams& p, size_t elem, uint32_t gm_stride, uint32_t left,
                       uint32_t right) {
  if (p.blockCount == 0 || p.blockLen == 0)
    dflash::emu::fail("dma-params", "DataCopyPad needs blockCount and blockLen >= 1");
  if (p.blockCount > 4095)  // DataCopyExtParams: blockCount in [0, 4095]
    dflash::emu::fail("dma-params", "DataCopyPad blockCount ", p.blockCount, " exceeds 4095");
  if (p.blockLen % elem || gm_stride % elem)
    dflash::emu::fail("dma-params", "DataCopyPad blockLen and GM stride must be whole elements");
  if (left * elem > dflash::emu::kAlign || right * elem > dflash::emu::kAlign)
    dflash::emu::fail("dma-params", "DataCopyPad padding may not exceed 32 bytes per side");
}

}  // namespace detail

template <typename T>
void DataCopy(const LocalTensor<T>& dst, const GlobalTensor<T>& src, uint32_t count) {
  const uint32_t bytes = count * sizeof(T);
  detail::dma_blocks(bytes, "DataCopy GM->UB");
  detail::ub_operand(dst, bytes, "DataCopy dst");
  src.check(0, count, false, "DataCopy GM->UB");
  auto& h = dflash::emu::block().hazards();
  h.issue(dflash::emu::kMte2);
  h.write(dflash::emu::kMte2, dst.offset(), bytes, "DataCopy GM->UB");
  std::memcpy(dst.data(), src.data(), bytes);
}

template <typename T>
void DataCopy(const GlobalTensor<T>& dst, const LocalTensor<T>& src, uint32_t count) {
  const uint32_t bytes = count * sizeof(T);
  detail::dma_blocks(bytes, "DataCopy UB->GM");
  detail::ub_operand(src, bytes, "DataCopy src");
  dst.check(0, count, true, "DataCopy UB->GM");
  auto& h = dflash::emu::block().hazards();
  h.issue(dflash::emu::kMte3);
  h.read(dflash::emu::kMte3, src.offset(), bytes, "DataCopy UB->GM");
  std::memcpy(dst.data(), src.data(), bytes);
  dflash::emu::block().record_gm_write(dst.data(), bytes);
}

// GM -> UB: blockCount blocks of blockLen bytes; in UB each block is laid out as
// [leftPadding][data][rightPadding] rounded up to 32 bytes, then dstStride more 32-byte units.
template <typename T>
void DataCopyPad(const LocalTensor<T>& dst, const GlobalTensor<T>& src, const DataCopyExtParams& p,
                 const DataCopyPadExtParams<T>& pad) {
  detail::pad_params(p, sizeof(T), p.srcStride, pad.leftPadding, pad.rightPadding);
  detail::pad_position(dst, "DataCopyPad GM->UB");
  const uint32_t n = p.blockLen / sizeof(T);
  const uint32_t footprint = dflash::emu::round_up(
      (pad.leftPadding + n + pad.rightPadding) * sizeof(T), dflash::emu::kAlign);
  const uint32_t ub_step = footprint + p.dstStride * dflash::emu::kAlign;
  const uint64_t gm_step = p.blockLen + p.srcStride;
  detail::ub_operand(dst, (p.blockCount - 1) * ub_step + footprint, "DataCopyPad dst");
  auto& blk = dflash::emu::block();
  auto& h = blk.hazards();
  h.issue(dflash::emu::kMte2);
  for (uint32_t j = 0; j < p.blockCount; ++j) {
    const uint64_t gm_first = j * gm_step / sizeof(T);
    src.check(gm_first, n, false, "DataCopyPad GM->UB");
    const uint32_t ub = dst.offset() + j * ub_step;
    h.write(dflash::emu::kMte2, ub, footprint, "DataCopyPad GM->UB");
    blk.poison(ub, footprint);
    T* out = reinterpret_cast<T*>(blk.ub(ub));
    if (pad.isPad) {
      for (uint32_t i = 0; i < pad.leftPadding; ++i) out[i] = pad.paddingValue;
      for (uint32_t i = 0; i < pad.rightPadding; ++i)
        out[pad.leftPadding + n + i] = pad.paddingValue;
    }
    std::memcpy(out + pad.leftPadding, src.data() + gm_first, p.blockLen);
  }
}

// UB -> GM: writes exactly blockLen bytes per block; UB blocks start 32-byte aligned.
template <typename T>
void DataCopyPad(const GlobalTensor<T>& dst, const LocalTensor<T>& src,
                 const DataCopyExtParams& p) {
  detail::pad_params(p, sizeof(T), p.dstStride, 0, 0);
  detail::pad_position(src, "DataCopyPad UB->GM");
  const uint32_t n = p.blockLen / sizeof(T);
  const uint32_t ub_step =
      dflash::emu::round_up(p.blockLen, dflash::emu::kAlign) + p.srcStride * dflash::emu::kAlign;
  const uint64_t gm_step = p.blockLen + p.dstStride;
  detail::ub_operand(src, (p.blockCount - 1) * ub_step + p.blockLen, "DataCopyPad src");
  auto& blk = dflash::emu::block();
  auto& h = blk.hazards();
  h.issue(dflash::emu::kMte3);
  for (uint32_t j = 0; j < p.blockCount; ++j) {
    const uint64_t gm_first = j * gm_step / sizeof(T);
    dst.check(gm_first, n, true, "DataCopyPad UB->GM");
    const uint32_t ub = src.offset() + j * ub_step;
    h.read(dflash::emu::kMte3, ub, p.blockLen, "DataCopyPad UB->GM");
    std::memcpy(dst.data() + gm_first, blk.ub(ub), p.blockLen);
    blk.record_gm_write(dst.data() + gm_first, p.blockLen);
  }
}

}  // namespace AscendC
