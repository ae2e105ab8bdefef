// Ascend C kernel: paged attention of each sequence's new tokens over its cached context followed
// by the new tokens themselves (docs/design.md 3.2), causal or not, on the vector cores.
//
// Work items are (sequence, kv head, query tile, head tile): up to q_tile query positions times up
// to head_tile query heads of one GQA group, so every K/V row loaded serves all of them. Every
// block enumerates them itself from cu_query_lens (sequence by sequence) and takes every
// GetBlockNum()-th one: the launch needs no value of the step's lengths on the host, so it makes
// no device-to-host copy and can be captured in a graph (docs/design.md 3.2). The item's keys
// (cached ones through the block table, then the new tokens' own K/V) stream through the UB in
// chunks of at most kv_tile rows that never cross a cache block, double-buffered: the next
// chunk's DMA is issued before this chunk is processed.
//
// Per query row and chunk, in float32 (online softmax): scores s = (q . k_j) * scale by Mul and a
// row-wise Sum; m' = max(m, s) with the old running max m in an extra score lane, so that one Exp
// yields both p_j = exp(s_j - m') and the rescale factor exp(m - m'); l = l * exp(m - m') + sum p;
// o = o * exp(m - m') + sum_j p_j v_j, the products summed by halving. Causal rows only see the
// keys up to their own position, so a chunk is cut short per row. At the end o / l is rounded to
// the output dtype (round to nearest even).
//
// UB layout: every head row (queries, keys, values, accumulators) is padded to 32 bytes of the input
// dtype (`head_pad` elements, zero filled by DataCopyPad), so every row is an aligned operand for any
// head_dim; only the first head_dim lanes are computed and written back.
#include "kernel_common.h"

namespace {

using AscendC::HardEvent;
using AscendC::LocalTensor;
using AscendC::TPosition;

constexpr int32_t kBufferNum = 2;
constexpr uint32_t kSlot = 8;       // floats per 32-byte slot
constexpr float kNoMax = -3.0e38f;  // running max before any key: exp(kNoMax - m) is 0

// The keys [first, first + count) of the current item, all in one cache block or all new tokens.
struct Chunk {
  uint32_t first;
  uint32_t count;   // 0: no keys left
  uint64_t offset;  // element offset of the first key's row for this kv head
  bool cached;      // in key_cache / value_cache, else in key / value
};

template <typename T>
class PagedAttention {
  static constexpr bool kFloat = dflash::ascend::kernel::IsSame<T, float>::value;

 public:
  __aicore__ inline void Init(GM_ADDR query, GM_ADDR key, GM_ADDR value, GM_ADDR key_cache,
                              GM_ADDR value_cache, GM_ADDR block_table, GM_ADDR context_lens,
                              GM_ADDR cu_query_lens, GM_ADDR tree_mask, GM_ADDR out,
                              const PagedAttentionTiling& tiling) {
    t_ = tiling;
    pad_ = t_.head_pad;
    // Sum's rows are D floats rounded up to 32 bytes (its documented inner), which for a 16-bit
    // input is not the input's head stride when D is not a multiple of 16
    sumPad_ = dflash::ascend::kernel::Align32(t_.head_dim * sizeof(float)) / sizeof(float);
    rowStride_ = t_.kv_heads * t_.head_dim;
    query_.SetGlobalBuffer((__gm__ T*)query);
    key_.SetGlobalBuffer((__gm__ T*)key);
    value_.SetGlobalBuffer((__gm__ T*)value);
    keyCache_.SetGlobalBuffer((__gm__ T*)key_cache);
    valueCache_.SetGlobalBuffer((__gm__ T*)value_cache);
    out_.SetGlobalBuffer((__gm__ T*)out);
    blockTable_.SetGlobalBuffer((__gm__ int32_t*)block_table);
    contextLens_.SetGlobalBuffer((__gm__ int32_t*)context_lens);
    cuQueryLens_.SetGlobalBuffer((__gm__ int32_t*)cu_query_lens);
    if (t_.tree_width) treeMask_.SetGlobalBuffer((__gm__ uint8_t*)tree_mask);

    const uint32_t rows = t_.q_tile * t_.head_tile, keys = t_.kv_tile * pad_;
    pipe_.InitBuffer(qBuf_, rows * pad_ * sizeof(float));
    pipe_.InitBuffer(oBuf_, rows * pad_ * sizeof(float));
    pipe_.InitBuffer(kQue_, kBufferNum, dflash::ascend::kernel::Align32(keys * sizeof(T)));
    pipe_.InitBuffer(vQue_, kBufferNum, dflash::ascend::kernel::Align32(keys * sizeof(T)));
    pipe_.InitBuffer(prodBuf_, keys * sizeof(float));
    if constexpr (!kFloat) {
      pipe_.InitBuffer(rawBuf_, dflash::ascend::kernel::Align32(rows * pad_ * sizeof(T)));
      pipe_.InitBuffer(kBuf_, keys * sizeof(float));
      pipe_.InitBuffer(vBuf_, keys * sizeof(float));
    }
    pipe_.InitBuffer(scoreBuf_, dflash::ascend::kernel::Align32((t_.kv_tile + 1) * sizeof(float)));
    pipe_.InitBuffer(resultBuf_, 2 * kSlot * sizeof(float));
    pipe_.InitBuffer(reduceTmpBuf_, t_.reduce_tmp * sizeof(float));
    pipe_.InitBuffer(sumTmpBuf_, t_.sum_tmp);
    outputWritten_.Init(pipe_);
  }

  __aicore__ inline void Process() {
    const uint32_t block = AscendC::GetBlockIdx(), blocks = AscendC::GetBlockNum();
    uint32_t item = 0;  // index of the next work item in the enumeration order
    for (uint32_t seq = 0; seq < t_.batch; ++seq) {
      seqStart_ = static_cast<uint32_t>(cuQueryLens_.GetValue(seq));
      const uint32_t newTokens = static_cast<uint32_t>(cuQueryLens_.GetValue(seq + 1)) - seqStart_;
      context_ = static_cast<uint32_t>(contextLens_.GetValue(seq));
      for (uint32_t q0 = 0; q0 < newTokens; q0 += t_.q_tile) {
        for (uint32_t g = 0; g < t_.kv_heads; ++g) {
          for (uint32_t h0 = 0; h0 < t_.group; h0 += t_.head_tile, ++item) {
            if (item % blocks != block) continue;
            item_ = {seq, g,
                     q0,  dflash::ascend::kernel::Min(t_.q_tile, newTokens - q0),
                     h0,  dflash::ascend::kernel::Min(t_.head_tile, t_.group - h0)};
            // causal: the item's last position sees keys up to the context plus itself
            keyEnd_ = context_ + (t_.causal ? item_.q0 + item_.qn : newTokens);
            rows_ = item_.qn * item_.hn;
            outputWritten_.Wait();  // it read rawBuf_ / oBuf_
            LoadQueries();
            Attend();
            WriteOutput();
          }
        }
      }
    }
    outputWritten_.Release(pipe_);
  }

 private:
  // GM offset of the item's first query head at its position p (the output's is the same).
  __aicore__ inline uint64_t HeadOffset(uint32_t p) const {
    return (static_cast<uint64_t>(seqStart_) + item_.q0 + p) * t_.q_heads * t_.head_dim +
           (static_cast<uint64_t>(item_.kv_head) * t_.group + item_.h0) * t_.head_dim;
  }

  // Rows r = p * hn + h: the item's query heads of position p are contiguous in GM.
  __aicore__ inline void LoadQueries() {
    LocalTensor<T> dst;
    if constexpr (kFloat) {
      dst = qBuf_.Get<float>();
    } else {
      dst = rawBuf_.Get<T>();
    }
    AscendC::DataCopyExtParams heads{static_cast<uint16_t>(item_.hn),
                                     static_cast<uint32_t>(t_.head_dim * sizeof(T)), 0, 0, 0};
    AscendC::DataCopyPadExtParams<T> zeroPad{true, 0, static_cast<uint8_t>(pad_ - t_.head_dim), 0};
    for (uint32_t p = 0; p < item_.qn; ++p)
      AscendC::DataCopyPad(dst[p * item_.hn * pad_], query_[HeadOffset(p)], heads, zeroPad);
    dflash::ascend::kernel::Sync<HardEvent::MTE2_V>(pipe_);
    if constexpr (!kFloat) {
      AscendC::Cast(qBuf_.Get<float>(), dst, AscendC::RoundMode::CAST_NONE, rows_ * pad_);
    }
    AscendC::Duplicate(oBuf_.Get<float>(), 0.0f, rows_ * pad_);
    AscendC::PipeBarrier<PIPE_V>();
    for (uint32_t r = 0; r < rows_; ++r) {
      max_[r] = kNoMax;
      sum_[r] = 0.0f;
    }
  }

  // The chunk starting at key `first`: up to kv_tile keys, inside one cache block or the new tokens.
  __aicore__ inline Chunk Locate(uint32_t first) {
    Chunk c{first, 0, 0, first < context_};
    if (first >= keyEnd_) return c;
    const uint64_t head = static_cast<uint64_t>(item_.kv_head) * t_.head_dim;
    if (c.cached) {
      const uint32_t inBlock = first % t_.block_size;
      const uint32_t left =
          t_.block_size - inBlock < context_ - first ? t_.block_size - inBlock : context_ - first;
      c.count = left < t_.kv_tile ? left : t_.kv_tile;
      const uint64_t block = static_cast<uint32_t>(blockTable_.GetValue(
          static_cast<uint64_t>(item_.seq) * t_.max_blocks + first / t_.block_size));
      c.offset = (block * t_.block_size + inBlock) * rowStride_ + head;
    } else {
      const uint32_t left = keyEnd_ - first;
      c.count = left < t_.kv_tile ? left : t_.kv_tile;
      c.offset = (static_cast<uint64_t>(seqStart_) + first - context_) * rowStride_ + head;
    }
    return c;
  }

  __aicore__ inline void Prefetch(const Chunk& c) {
    AscendC::DataCopyExtParams rows{
        static_cast<uint16_t>(c.count), static_cast<uint32_t>(t_.head_dim * sizeof(T)),
        static_cast<uint32_t>((rowStride_ - t_.head_dim) * sizeof(T)), 0, 0};
    AscendC::DataCopyPadExtParams<T> zeroPad{true, 0, static_cast<uint8_t>(pad_ - t_.head_dim), 0};
    LocalTensor<T> k = kQue_.template AllocTensor<T>();
    AscendC::DataCopyPad(k, (c.cached ? keyCache_ : key_)[c.offset], rows, zeroPad);
    kQue_.EnQue(k);
    LocalTensor<T> v = vQue_.template AllocTensor<T>();
    AscendC::DataCopyPad(v, (c.cached ? valueCache_ : value_)[c.offset], rows, zeroPad);
    vQue_.EnQue(v);
  }

  __aicore__ inline void Attend() {
    Chunk c = Locate(0);
    Prefetch(c);
    while (c.count) {
      const Chunk next = Locate(c.first + c.count);
      if (next.count) Prefetch(next);
      AttendChunk(c);
      c = next;
    }
  }

  // Keys of chunk c that row r may see: all, or (causal) those up to its own position.
  __aicore__ inline uint32_t Visible(uint32_t r, const Chunk& c) const {
    if (!t_.causal) return c.count;
    const uint32_t limit = context_ + item_.q0 + r / item_.hn + 1;
    if (limit <= c.first) return 0;
    return limit - c.first < c.count ? limit - c.first : c.count;
  }

  __aicore__ inline void AttendChunk(const Chunk& c) {
    LocalTensor<T> kRaw = kQue_.template DeQue<T>();
    LocalTensor<T> vRaw = vQue_.template DeQue<T>();
    LocalTensor<float> k, v;
    if constexpr (kFloat) {
      k = kRaw;
      v = vRaw;
    } else {
      k = kBuf_.Get<float>();
      v = vBuf_.Get<float>();
      AscendC::PipeBarrier<PIPE_V>();  // the previous chunk's rows read k and v
      AscendC::Cast(k, kRaw, AscendC::RoundMode::CAST_NONE, c.count * pad_);
      AscendC::Cast(v, vRaw, AscendC::RoundMode::CAST_NONE, c.count * pad_);
      kQue_.FreeTensor(kRaw);
      vQue_.FreeTensor(vRaw);
      AscendC::PipeBarrier<PIPE_V>();
    }
    for (uint32_t r = 0; r < rows_; ++r) {
      const uint32_t visible = Visible(r, c);
      if (visible && SeesAny(r, c, visible)) Row(r, visible, c, k, v);
    }
    if constexpr (kFloat) {
      kQue_.FreeTensor(kRaw);
      vQue_.FreeTensor(vRaw);
    }
  }

  // Whether row r's tree mask bit for new token j is set (docs/design.md 3.2).
  __aicore__ inline bool TreeBit(uint32_t r, uint32_t j) {
    const uint64_t row = seqStart_ + item_.q0 + r / item_.hn;
    return (treeMask_.GetValue(row * t_.tree_width + j / 8) >> (j % 8)) & 1;
  }

  // Whether row r sees any of the first n keys of chunk c: always without a tree mask or for
  // context keys; for new tokens, when one of their bits is set (a chunk it sees none of is
  // skipped, so no row's softmax starts from masked keys alone).
  __aicore__ inline bool SeesAny(uint32_t r, const Chunk& c, uint32_t n) {
    if (!t_.tree_width || c.cached) return true;
    for (uint32_t t = 0; t < n; ++t)
      if (TreeBit(r, c.first + t - context_)) return true;
    return false;
  }

  // One query row against the first n keys of the chunk (online softmax update).
  __aicore__ inline void Row(uint32_t r, uint32_t n, const Chunk& c, const LocalTensor<float>& k,
                             const LocalTensor<float>& v) {
    const uint32_t d = t_.head_dim;
    LocalTensor<float> q = qBuf_.Get<float>()[r * pad_];
    LocalTensor<float> o = oBuf_.Get<float>()[r * pad_];
    LocalTensor<float> prod = prodBuf_.Get<float>();
    LocalTensor<float> s = scoreBuf_.Get<float>();
    LocalTensor<float> result = resultBuf_.Get<float>();
    LocalTensor<float> reduceTmp = reduceTmpBuf_.Get<float>();

    for (uint32_t j = 0; j < n; ++j) AscendC::Mul(prod[j * sumPad_], q, k[j * pad_], d);
    AscendC::PipeBarrier<PIPE_V>();
    AscendC::Sum(s, prod, sumTmpBuf_.Get<uint8_t>(), AscendC::SumParams{n, sumPad_, d});
    AscendC::PipeBarrier<PIPE_V>();
    AscendC::Muls(s, s, t_.scale, n);
    dflash::ascend::kernel::Sync<HardEvent::V_S>(pipe_);
    if (t_.tree_width && !c.cached) {  // new tokens outside the row's tree path: weight 0
      for (uint32_t j = 0; j < n; ++j)
        if (!TreeBit(r, c.first + j - context_)) s.SetValue(j, kNoMax);
    }
    s.SetValue(n, max_[r]);  // lane n: exp(m - m') comes out of the same Exp as the p_j
    dflash::ascend::kernel::Sync<HardEvent::S_V>(pipe_);
    AscendC::ReduceMax(result, s, reduceTmp, n + 1);
    dflash::ascend::kernel::Sync<HardEvent::V_S>(pipe_);
    const float newMax = result.GetValue(0);
    AscendC::Adds(s, s, -newMax, n + 1);
    AscendC::PipeBarrier<PIPE_V>();
    AscendC::Exp(s, s, n + 1);
    AscendC::PipeBarrier<PIPE_V>();
    AscendC::ReduceSum(result[kSlot], s, reduceTmp, n);
    dflash::ascend::kernel::Sync<HardEvent::V_S>(pipe_);
    const float rescale = s.GetValue(n);
    sum_[r] = sum_[r] * rescale + result.GetValue(kSlot);
    max_[r] = newMax;

    AscendC::Muls(o, o, rescale, d);
    for (uint32_t j = 0; j < n; ++j) AscendC::Muls(prod[j * pad_], v[j * pad_], s.GetValue(j), d);
    AscendC::PipeBarrier<PIPE_V>();
    for (uint32_t left = n; left > 1;) {  // sum the n weighted value rows by halving
      const uint32_t half = left / 2;
      AscendC::Add(prod, prod, prod[(left - half) * pad_], half * pad_);
      AscendC::PipeBarrier<PIPE_V>();
      left -= half;
    }
    AscendC::Add(o, o, prod, d);
    AscendC::PipeBarrier<PIPE_V>();  // the next row overwrites prod and s
  }

  // o / l, rounded to T, written to the item's output heads.
  __aicore__ inline void WriteOutput() {
    LocalTensor<float> o = oBuf_.Get<float>();
    for (uint32_t r = 0; r < rows_; ++r)
      AscendC::Muls(o[r * pad_], o[r * pad_], 1.0f / sum_[r], t_.head_dim);
    AscendC::PipeBarrier<PIPE_V>();
    LocalTensor<T> src;
    if constexpr (kFloat) {
      src = o;
    } else {
      src = rawBuf_.Get<T>();
      AscendC::Cast(src, o, AscendC::RoundMode::CAST_RINT, rows_ * pad_);
    }
    dflash::ascend::kernel::Sync<HardEvent::V_MTE3>(pipe_);
    AscendC::DataCopyExtParams heads{static_cast<uint16_t>(item_.hn),
                                     static_cast<uint32_t>(t_.head_dim * sizeof(T)), 0, 0, 0};
    for (uint32_t p = 0; p < item_.qn; ++p)
      AscendC::DataCopyPad(out_[HeadOffset(p)], src[p * item_.hn * pad_], heads);
    outputWritten_.Set();
  }

  PagedAttentionTiling t_;
  PagedAttentionItem item_;
  uint32_t pad_, sumPad_, rowStride_, seqStart_, context_, keyEnd_, rows_;
  float max_[kPagedAttentionMaxRows], sum_[kPagedAttentionMaxRows];
  AscendC::TPipe pipe_;
  AscendC::TQue<TPosition::VECIN, kBufferNum> kQue_, vQue_;
  // DataCopyPad moves queries in and outputs out: VECIN / VECOUT buffers on A2.
  AscendC::TBuf<TPosition::VECIN> qBuf_, rawBuf_;
  AscendC::TBuf<TPosition::VECOUT> oBuf_;
  AscendC::TBuf<TPosition::VECCALC> prodBuf_, kBuf_, vBuf_, scoreBuf_, resultBuf_, reduceTmpBuf_,
      sumTmpBuf_;
  dflash::ascend::kernel::CarriedFlag<HardEvent::MTE3_MTE2> outputWritten_;
  AscendC::GlobalTensor<T> query_, key_, value_, keyCache_, valueCache_, out_;
  AscendC::GlobalTensor<int32_t> blockTable_, contextLens_, cuQueryLens_;
  AscendC::GlobalTensor<uint8_t> treeMask_;
};

template <typename T>
__aicore__ inline void RunPagedAttention(GM_ADDR query, GM_ADDR key, GM_ADDR value,
                                         GM_ADDR key_cache, GM_ADDR value_cache,
                                         GM_ADDR block_table, GM_ADDR context_lens,
                                         GM_ADDR cu_query_lens, GM_ADDR tree_mask, GM_ADDR out,
                                         PagedAttentionTiling tiling) {
  PagedAttention<T> op;
  op.Init(query, key, value, key_cache, value_cache, block_table, context_lens, cu_query_lens,
          tree_mask, out, tiling);
  op.Process();
}

}  // namespace

#define DFLASH_PAGED_ATTENTION_KERNEL(NAME, TYPE)                                                 \
  extern "C" __global__ __aicore__ void NAME(                                                     \
      GM_ADDR query, GM_ADDR key, GM_ADDR value, GM_ADDR key_cache, GM_ADDR value_cache,          \
      GM_ADDR block_table, GM_ADDR context_lens, GM_ADDR cu_query_lens, GM_ADDR tree_mask,        \
      GM_ADDR out, PagedAttentionTiling tiling) {                                                 \
    KERNEL_TASK_TYPE_DEFAULT(                                                                     \
        KERNEL_TYPE_AIV_ONLY); /* several kernels here: CANN cannot infer it */                   \
    RunPagedAttention<TYPE>(query, key, value, key_cache, value_cache, block_table, context_lens, \
                            cu_query_lens, tree_mask, out, tiling);                               \
  }
DFLASH_PAGED_ATTENTION_KERNEL(dflash_paged_attention_fp32, float)
DFLASH_PAGED_ATTENTION_KERNEL(dflash_paged_attention_fp16, half)
DFLASH_PAGED_ATTENTION_KERNEL(dflash_paged_attention_bf16, bfloat16_t)
#undef DFLASH_PAGED_ATTENTION_KERNEL
