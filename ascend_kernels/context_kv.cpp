// Ascend C kernel: the epilogue of context_kv (docs/design.md 3.1).
//
// The host runs the two GEMMs (fc + hidden RMSNorm, then the fused layer-major K/V projection) and
// hands this kernel kv [N, L * 2 * Hkv * D]. Per token (grid-strided over blocks) and layer it
// RMS-normalizes every K head in float32, applies NeoX RoPE at the token's position, rounds to the
// cache dtype with round-to-nearest-even and scatters K and V into the paged caches; slot -1 skips
// the token.
//
// UB layout of one K row: every half head (D/2 elements) is its own 32-byte aligned block of
// `half_pad` elements, zero padded by DataCopyPad, so the rotate-half pairs (x1, x2) of any head
// dim are aligned vector operands and a head's padded lanes add nothing to its sum of squares.
#include "kernel_common.h"

namespace {

using AscendC::HardEvent;
using AscendC::LocalTensor;
using AscendC::TPosition;

constexpr int32_t kBufferNum = 2;
constexpr uint32_t kSlot = 8;  // floats per 32-byte slot

template <typename T>
class ContextKvEpilogue {
  static constexpr bool kFloat = dflash::ascend::kernel::IsSame<T, float>::value;

 public:
  __aicore__ inline void Init(GM_ADDR kv, GM_ADDR k_norm_weight, GM_ADDR positions, GM_ADDR cos_sin,
                              GM_ADDR slot_mapping, GM_ADDR cache_table,
                              const ContextKvTiling& tiling) {
    t_ = tiling;
    half_ = t_.head_dim / 2;
    headLanes_ = 2 * t_.half_pad;
    lanes_ = t_.kv_heads * headLanes_;
    rowElems_ = static_cast<uint64_t>(t_.layers) * 2 * t_.kv_heads * t_.head_dim;
    kv_.SetGlobalBuffer((__gm__ T*)kv);
    weights_.SetGlobalBuffer((__gm__ T*)k_norm_weight);
    positions_.SetGlobalBuffer((__gm__ int64_t*)positions);
    cosSin_.SetGlobalBuffer((__gm__ float*)cos_sin);
    slots_.SetGlobalBuffer((__gm__ int64_t*)slot_mapping);
    cacheTable_.SetGlobalBuffer((__gm__ int64_t*)cache_table);

    pipe_.InitBuffer(kInQue_, kBufferNum, lanes_ * sizeof(T));
    pipe_.InitBuffer(kOutQue_, kBufferNum, lanes_ * sizeof(T));
    if constexpr (!kFloat) {
      pipe_.InitBuffer(xBuf_, lanes_ * sizeof(float));
      pipe_.InitBuffer(weightRawBuf_, 2 * t_.layers * t_.half_pad * sizeof(T));
    }
    pipe_.InitBuffer(yBuf_, lanes_ * sizeof(float));
    pipe_.InitBuffer(tBuf_, lanes_ * sizeof(float));
    pipe_.InitBuffer(weightBuf_, 2 * t_.layers * t_.half_pad * sizeof(float));
    pipe_.InitBuffer(cosSinQue_, 1, 2 * CosSinStride() * sizeof(float));
    pipe_.InitBuffer(vBuf_, dflash::ascend::kernel::Align32(t_.kv_heads * t_.head_dim * sizeof(T)));
    pipe_.InitBuffer(sumBuf_, t_.kv_heads * kSlot * sizeof(float));
    pipe_.InitBuffer(onesBuf_, t_.kv_heads * kSlot * sizeof(float));
    pipe_.InitBuffer(tmpBuf_, t_.reduce_tmp * sizeof(float));
    valueWritten_.Init(pipe_);
    LoadNormWeights();
  }

  // The token's cos | sin row goes through a VECIN queue: its FreeTensor / AllocTensor order the
  // next token's load after this token's last use.
  __aicore__ inline void Process() {
    for (uint32_t t = AscendC::GetBlockIdx(); t < t_.tokens; t += AscendC::GetBlockNum()) {
      const int64_t slot = slots_.GetValue(t);
      if (slot < 0) continue;
      const int64_t pos = positions_.GetValue(t);
      LocalTensor<float> cosSin = cosSinQue_.AllocTensor<float>();
      AscendC::DataCopyExtParams cs{2, static_cast<uint32_t>(half_ * sizeof(float)), 0, 0, 0};
      AscendC::DataCopyPad(cosSin, cosSin_[pos * t_.head_dim], cs,
                           AscendC::DataCopyPadExtParams<float>{false, 0, 0, 0});
      cosSinQue_.EnQue(cosSin);
      cosSin = cosSinQue_.DeQue<float>();
      for (uint32_t l = 0; l < t_.layers; ++l) {
        Key(t, l, slot, cosSin);
        Value(t, l, slot);
      }
      cosSinQue_.FreeTensor(cosSin);
    }
    valueWritten_.Release(pipe_);
  }

 private:
  __aicore__ inline uint32_t CosSinStride() const { return (half_ + kSlot - 1) / kSlot * kSlot; }

  // The per-layer k_norm weights in float, laid out like one head: [layer][x1 | x2] halves.
  __aicore__ inline void LoadNormWeights() {
    AscendC::DataCopyExtParams rows{static_cast<uint16_t>(2 * t_.layers),
                                    static_cast<uint32_t>(half_ * sizeof(T)), 0, 0, 0};
    AscendC::DataCopyPadExtParams<T> zeroPad{true, 0, static_cast<uint8_t>(t_.half_pad - half_), 0};
    LocalTensor<float> w = weightBuf_.Get<float>();
    if constexpr (kFloat) {
      AscendC::DataCopyPad(w, weights_, rows, zeroPad);
    } else {
      AscendC::DataCopyPad(weightRawBuf_.Get<T>(), weights_, rows, zeroPad);
    }
    dflash::ascend::kernel::Sync<HardEvent::MTE2_V>(pipe_);
    if constexpr (!kFloat) {
      AscendC::Cast(w, weightRawBuf_.Get<T>(), AscendC::RoundMode::CAST_NONE,
                    2 * t_.layers * t_.half_pad);
    }
    AscendC::Duplicate(onesBuf_.Get<float>(), 1.0f, t_.kv_heads * kSlot);
    AscendC::PipeBarrier<PIPE_V>();
  }

  // Where layer l's K (kind 0) or V (kind 1) row of `slot` lives: the host passes, per layer and
  // kind, the cache's GM address and its block and slot strides in elements.
  __aicore__ inline AscendC::GlobalTensor<T> CacheRow(uint32_t l, uint32_t kind, int64_t slot) {
    const uint32_t entry = (2 * l + kind) * 3;
    const int64_t base = cacheTable_.GetValue(entry);
    const int64_t offset = slot / t_.block_size * cacheTable_.GetValue(entry + 1) +
                           slot % t_.block_size * cacheTable_.GetValue(entry + 2);
    AscendC::GlobalTensor<T> row;
    row.SetGlobalBuffer(reinterpret_cast<__gm__ T*>(static_cast<uintptr_t>(base)) + offset);
    return row;
  }

  __aicore__ inline void Key(uint32_t t, uint32_t l, int64_t slot,
                             const LocalTensor<float>& cosSin) {
    LocalTensor<T> raw = kInQue_.template AllocTensor<T>();
    AscendC::DataCopyExtParams halves{static_cast<uint16_t>(2 * t_.kv_heads),
                                      static_cast<uint32_t>(half_ * sizeof(T)), 0, 0, 0};
    AscendC::DataCopyPadExtParams<T> zeroPad{true, 0, static_cast<uint8_t>(t_.half_pad - half_), 0};
    AscendC::DataCopyPad(raw, kv_[t * rowElems_ + 2 * l * t_.kv_heads * t_.head_dim], halves,
                         zeroPad);
    kInQue_.EnQue(raw);
    raw = kInQue_.template DeQue<T>();

    LocalTensor<float> x;
    if constexpr (kFloat) {
      x = raw;
    } else {
      x = xBuf_.Get<float>();
      AscendC::Cast(x, raw, AscendC::RoundMode::CAST_NONE, lanes_);
      AscendC::PipeBarrier<PIPE_V>();
    }
    RmsNorm(x, l);
    Rope(x, l, slot, cosSin);
    kInQue_.FreeTensor(raw);
  }

  // x[h] *= 1 / sqrt(mean(x[h]^2) + eps) * k_norm_weight[l], in place, every head h.
  __aicore__ inline void RmsNorm(const LocalTensor<float>& x, uint32_t l) {
    LocalTensor<float> sq = yBuf_.Get<float>();
    LocalTensor<float> sums = sumBuf_.Get<float>();
    LocalTensor<float> tmp = tmpBuf_.Get<float>();
    const uint32_t n = t_.kv_heads * kSlot;
    AscendC::Mul(sq, x, x, lanes_);
    AscendC::PipeBarrier<PIPE_V>();
    for (uint32_t h = 0; h < t_.kv_heads; ++h)
      AscendC::ReduceSum(sums[h * kSlot], sq[h * headLanes_], tmp, headLanes_);
    AscendC::PipeBarrier<PIPE_V>();
    AscendC::Muls(sums, sums, 1.0f / static_cast<float>(t_.head_dim), n);
    AscendC::PipeBarrier<PIPE_V>();
    AscendC::Adds(sums, sums, t_.eps, n);
    AscendC::PipeBarrier<PIPE_V>();
    AscendC::Sqrt(sums, sums, n);
    AscendC::PipeBarrier<PIPE_V>();
    AscendC::Div(sums, onesBuf_.Get<float>(), sums, n);
    dflash::ascend::kernel::Sync<HardEvent::V_S>(pipe_);
    for (uint32_t h = 0; h < t_.kv_heads; ++h) {
      AscendC::Muls(x[h * headLanes_], x[h * headLanes_], sums.GetValue(h * kSlot), headLanes_);
    }
    AscendC::PipeBarrier<PIPE_V>();
    LocalTensor<float> w = weightBuf_.Get<float>()[l * headLanes_];
    for (uint32_t h = 0; h < t_.kv_heads; ++h)
      AscendC::Mul(x[h * headLanes_], x[h * headLanes_], w, headLanes_);
    AscendC::PipeBarrier<PIPE_V>();
  }

  // NeoX rotate-half: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), each product rounded to float
  // as in the reference; then round to T and write the cache row.
  __aicore__ inline void Rope(const LocalTensor<float>& x, uint32_t l, int64_t slot,
                              const LocalTensor<float>& cos) {
    LocalTensor<float> sin = cos[CosSinStride()];
    LocalTensor<float> y = yBuf_.Get<float>();
    LocalTensor<float> p = tBuf_.Get<float>();
    const uint32_t pad = t_.half_pad;
    for (uint32_t h = 0; h < t_.kv_heads; ++h) {
      const uint32_t x1 = h * headLanes_, x2 = x1 + pad;
      AscendC::Mul(y[x1], x[x1], cos, half_);
      AscendC::Mul(y[x2], x[x2], cos, half_);
      AscendC::Mul(p[x1], x[x2], sin, half_);
      AscendC::Mul(p[x2], x[x1], sin, half_);
    }
    AscendC::PipeBarrier<PIPE_V>();
    LocalTensor<T> out = kOutQue_.template AllocTensor<T>();
    LocalTensor<float> rotated;
    if constexpr (kFloat) {
      rotated = out;
    } else {
      rotated = y;
    }
    for (uint32_t h = 0; h < t_.kv_heads; ++h) {
      const uint32_t x1 = h * headLanes_, x2 = x1 + pad;
      AscendC::Sub(rotated[x1], y[x1], p[x1], half_);
      AscendC::Add(rotated[x2], y[x2], p[x2], half_);
    }
    AscendC::PipeBarrier<PIPE_V>();  // the Cast reads `rotated`; the next layer overwrites y and p
    if constexpr (!kFloat) AscendC::Cast(out, y, AscendC::RoundMode::CAST_RINT, lanes_);
    kOutQue_.EnQue(out);
    out = kOutQue_.template DeQue<T>();
    AscendC::DataCopyExtParams halves{static_cast<uint16_t>(2 * t_.kv_heads),
                                      static_cast<uint32_t>(half_ * sizeof(T)), 0, 0, 0};
    AscendC::DataCopyPad(CacheRow(l, 0, slot), out, halves);
    kOutQue_.FreeTensor(out);
  }

  // V is stored as projected: a DMA round trip through the UB.
  __aicore__ inline void Value(uint32_t t, uint32_t l, int64_t slot) {
    valueWritten_.Wait();
    LocalTensor<T> v = vBuf_.Get<T>();
    const uint32_t n = t_.kv_heads * t_.head_dim;
    dflash::ascend::kernel::CopyIn(v, kv_[t * rowElems_ + (2 * l + 1) * n], n);
    dflash::ascend::kernel::Sync<HardEvent::MTE2_MTE3>(pipe_);
    dflash::ascend::kernel::CopyOut(CacheRow(l, 1, slot), v, n);
    valueWritten_.Set();
  }

  ContextKvTiling t_;
  uint32_t half_, headLanes_, lanes_;
  uint64_t rowElems_;
  AscendC::TPipe pipe_;
  AscendC::TQue<TPosition::VECIN, kBufferNum> kInQue_;
  AscendC::TQue<TPosition::VECOUT, kBufferNum> kOutQue_;
  AscendC::TQue<TPosition::VECIN, 1> cosSinQue_;
  AscendC::TBuf<TPosition::VECIN> weightRawBuf_, weightBuf_, vBuf_;  // DataCopyPad: VECIN on A2
  dflash::ascend::kernel::CarriedFlag<HardEvent::MTE3_MTE2> valueWritten_;  // vBuf_ is reused
  AscendC::TBuf<TPosition::VECCALC> xBuf_, yBuf_, tBuf_, sumBuf_, onesBuf_, tmpBuf_;
  AscendC::GlobalTensor<T> kv_, weights_;
  AscendC::GlobalTensor<float> cosSin_;
  AscendC::GlobalTensor<int64_t> positions_, slots_, cacheTable_;
};

template <typename T>
__aicore__ inline void RunContextKv(GM_ADDR kv, GM_ADDR k_norm_weight, GM_ADDR positions,
                                    GM_ADDR cos_sin, GM_ADDR slot_mapping, GM_ADDR cache_table,
                                    ContextKvTiling tiling) {
  ContextKvEpilogue<T> op;
  op.Init(kv, k_norm_weight, positions, cos_sin, slot_mapping, cache_table, tiling);
  op.Process();
}

}  // namespace

#define DFLASH_CONTEXT_KV_KERNEL(NAME, TYPE)                                                       \
  extern "C" __global__ __aicore__ void NAME(GM_ADDR kv, GM_ADDR k_norm_weight, GM_ADDR positions, \
                                             GM_ADDR cos_sin, GM_ADDR slot_mapping,                \
                                             GM_ADDR cache_table, ContextKvTiling tiling) {        \
    KERNEL_TASK_TYPE_DEFAULT(                                                                      \
        KERNEL_TYPE_AIV_ONLY); /* several kernels here: CANN cannot infer it */                    \
    RunContextKv<TYPE>(kv, k_norm_weight, positions, cos_sin, slot_mapping, cache_table, tiling);  \
  }
DFLASH_CONTEXT_KV_KERNEL(dflash_context_kv_fp32, float)
DFLASH_CONTEXT_KV_KERNEL(dflash_context_kv_fp16, half)
DFLASH_CONTEXT_KV_KERNEL(dflash_context_kv_bf16, bfloat16_t)
#undef DFLASH_CONTEXT_KV_KERNEL
