// Ascend C kernel: rejection sampling for speculative decoding (docs/design.md 3.3).
//
// One sequence per block iteration (sequences are grid-strided over the blocks). The vocabulary is
// streamed through the unified buffer in tiles; every "argmax over the vocabulary" (greedy target
// rows, the residual r / exponential of a rejected position, the bonus token) is one pass over the
// tiles that keeps the first index of the maximum, exactly like torch.argmax. Acceptance coins are
// scalar reads. The host launcher has checked every input (dflash/ops/checks.py rules).
#include "kernel_common.h"

namespace {

using AscendC::HardEvent;
using AscendC::LocalTensor;
using AscendC::TPosition;

// Double buffering: the next tile's DMA overlaps this tile's vector work.
constexpr int32_t kBufferNum = 2;

// How one pass turns the tiles of p (and q, e) into the weights whose argmax it returns.
enum class Weights {
  kTarget,          // p: greedy rows
  kNoisy,           // p / e: the bonus token, or the fallback when the residual is all zero
  kResidualDense,   // max(p - q, 0) / e
  kResidualOneHot,  // p with the draft token zeroed, / e
};

struct PassResult {
  uint32_t index;      // first index of the maximal weight
  float residual_max;  // max of the residual (residual passes only)
};

class RejectionSampler {
 public:
  __aicore__ inline void Init(GM_ADDR draft_ids, GM_ADDR draft_probs, GM_ADDR target_probs,
                              GM_ADDR is_greedy, GM_ADDR uniform, GM_ADDR exponential,
                              GM_ADDR out_ids, GM_ADDR num_accepted,
                              const RejectionSampleTiling& tiling) {
    t_ = tiling;
    draftIds_.SetGlobalBuffer((__gm__ int64_t*)draft_ids);
    targetProbs_.SetGlobalBuffer((__gm__ float*)target_probs);
    if (t_.dense) draftProbs_.SetGlobalBuffer((__gm__ float*)draft_probs);
    isGreedy_.SetGlobalBuffer((__gm__ uint8_t*)is_greedy);
    uniform_.SetGlobalBuffer((__gm__ float*)uniform);
    exponential_.SetGlobalBuffer((__gm__ float*)exponential);
    outIds_.SetGlobalBuffer((__gm__ int64_t*)out_ids);
    numAccepted_.SetGlobalBuffer((__gm__ int64_t*)num_accepted);

    const uint32_t tileBytes = t_.tile * sizeof(float);
    pipe_.InitBuffer(pQue_, kBufferNum, tileBytes);
    pipe_.InitBuffer(eQue_, kBufferNum, tileBytes);
    if (t_.dense) pipe_.InitBuffer(qQue_, kBufferNum, tileBytes);
    pipe_.InitBuffer(workBuf_, tileBytes);
    pipe_.InitBuffer(rampBuf_, tileBytes);
    pipe_.InitBuffer(candBuf_, tileBytes);
    pipe_.InitBuffer(maskBuf_, dflash::ascend::kernel::Align32(t_.tile / 8));
    pipe_.InitBuffer(tmpBuf_, t_.reduce_tmp * sizeof(float));
    pipe_.InitBuffer(scalarBuf_, 3 * kSlot * sizeof(float));
    pipe_.InitBuffer(rowBuf_, dflash::ascend::kernel::Align32((t_.drafts + 1) * sizeof(int64_t)));
    pipe_.InitBuffer(countBuf_, dflash::ascend::kernel::Align32(sizeof(int64_t)));
    BuildIndexRamp();
  }

  __aicore__ inline void Process() {
    for (uint32_t b = AscendC::GetBlockIdx(); b < t_.batch; b += AscendC::GetBlockNum()) {
      uint32_t accepted = 0;
      const uint32_t last = isGreedy_.GetValue(b) ? Greedy(b, accepted) : Sample(b, accepted);
      WriteRow(b, accepted, last);
    }
  }

 private:
  static constexpr uint32_t kSlot = 8;  // one 32-byte slot per scalar result in scalarBuf_
  // The smallest normal float: a residual below it everywhere counts as empty (design.md 3.3), as
  // the vector unit flushes subnormals and would see no mass there.
  static constexpr float kMinNormal = 1.17549435e-38f;

  // ramp[i] = i (as float, exact below 2^24): Select picks indices from it. Eight scalar stores,
  // then doubling with vector adds keeps every operand 32-byte aligned.
  __aicore__ inline void BuildIndexRamp() {
    LocalTensor<float> ramp = rampBuf_.Get<float>();
    for (uint32_t i = 0; i < 8; ++i) ramp.SetValue(i, static_cast<float>(i));
    dflash::ascend::kernel::Sync<HardEvent::S_V>(pipe_);
    for (uint32_t have = 8; have < t_.tile; have *= 2) {
      const uint32_t n = have < t_.tile - have ? have : t_.tile - have;
      AscendC::Adds(ramp[have], ramp, static_cast<float>(have), n);
      AscendC::PipeBarrier<PIPE_V>();
    }
  }

  __aicore__ inline uint64_t TargetRow(uint32_t b, uint32_t i) const {
    return (static_cast<uint64_t>(b) * (t_.drafts + 1) + i) * t_.vocab;
  }

  // Greedy row: accept drafts while they equal the target argmax; the next argmax is emitted.
  __aicore__ inline uint32_t Greedy(uint32_t b, uint32_t& accepted) {
    for (uint32_t i = 0;; ++i) {
      const uint32_t y = Pass(Weights::kTarget, b, i, 0).index;
      if (i == t_.drafts || draftIds_.GetValue(static_cast<uint64_t>(b) * t_.drafts + i) != y) {
        accepted = i;
        return y;
      }
    }
  }

  // Sampling row: accept x_i while u_i * q_i(x_i) < p_i(x_i) (q = 1 for one-hot proposals); at
  // the first rejection emit argmax r / e (r = residual, or p when the residual is all zero); with
  // every draft accepted emit the bonus argmax p_K / e.
  __aicore__ inline uint32_t Sample(uint32_t b, uint32_t& accepted) {
    uint32_t i = 0;
    uint32_t x = 0;
    for (; i < t_.drafts; ++i) {
      const uint64_t row = static_cast<uint64_t>(b) * t_.drafts + i;
      x = static_cast<uint32_t>(draftIds_.GetValue(row));
      const float p = targetProbs_.GetValue(TargetRow(b, i) + x);
      const float q = t_.dense ? draftProbs_.GetValue(row * t_.vocab + x) : 1.0f;
      const float coin = uniform_.GetValue(row) * q;
      if (!(coin < p)) break;
    }
    accepted = i;
    if (i < t_.drafts) {
      const Weights residual = t_.dense ? Weights::kResidualDense : Weights::kResidualOneHot;
      const PassResult r = Pass(residual, b, i, x);
      if (r.residual_max >= kMinNormal) return r.index;
    }
    return Pass(Weights::kNoisy, b, i, 0).index;
  }

  // One pass over the vocabulary tiles of target row (b, i): the first index of the maximal weight.
  __aicore__ inline PassResult Pass(Weights weights, uint32_t b, uint32_t i, uint32_t draft) {
    const bool noisy = weights != Weights::kTarget;
    const bool residual = weights == Weights::kResidualDense || weights == Weights::kResidualOneHot;
    const uint64_t pRow = TargetRow(b, i);
    const uint64_t qRow = (static_cast<uint64_t>(b) * t_.drafts + i) * t_.vocab;
    const uint64_t eRow = static_cast<uint64_t>(b) * t_.vocab;
    LocalTensor<float> work = workBuf_.Get<float>();
    LocalTensor<float> scalars = scalarBuf_.Get<float>();
    float best = -1.0f;  // every weight is >= 0
    PassResult result{0, 0.0f};

    for (uint32_t start = 0; start < t_.vocab; start += t_.tile) {
      const uint32_t n = t_.vocab - start < t_.tile ? t_.vocab - start : t_.tile;
      Load(pQue_, targetProbs_[pRow + start], n);
      if (noisy) Load(eQue_, exponential_[eRow + start], n);
      if (weights == Weights::kResidualDense) Load(qQue_, draftProbs_[qRow + start], n);

      LocalTensor<float> p = pQue_.DeQue<float>();
      LocalTensor<float> e, q;
      if (noisy) e = eQue_.DeQue<float>();
      if (weights == Weights::kResidualDense) {
        q = qQue_.DeQue<float>();
        AscendC::Sub(work, p, q, n);
        AscendC::PipeBarrier<PIPE_V>();
        AscendC::Maxs(work, work, 0.0f, n);
        AscendC::PipeBarrier<PIPE_V>();
      } else if (weights == Weights::kResidualOneHot) {
        AscendC::Muls(work, p, 1.0f, n);  // exact copy
        if (draft >= start && draft < start + n) {
          dflash::ascend::kernel::Sync<HardEvent::V_S>(pipe_);
          work.SetValue(draft - start, 0.0f);
          dflash::ascend::kernel::Sync<HardEvent::S_V>(pipe_);
        } else {
          AscendC::PipeBarrier<PIPE_V>();
        }
      } else if (weights == Weights::kNoisy) {
        AscendC::Div(work, p, e, n);
        AscendC::PipeBarrier<PIPE_V>();
      }
      if (residual) {
        AscendC::ReduceMax(scalars[2 * kSlot], work, tmpBuf_.Get<float>(), n);
        AscendC::PipeBarrier<PIPE_V>();  // Div overwrites what ReduceMax reads
        AscendC::Div(work, work, e, n);
        AscendC::PipeBarrier<PIPE_V>();
      }
      const LocalTensor<float>& w = weights == Weights::kTarget ? p : work;
      TileArgmax(w, n, start, residual, best, result);

      pQue_.FreeTensor(p);
      if (noisy) eQue_.FreeTensor(e);
      if (weights == Weights::kResidualDense) qQue_.FreeTensor(q);
    }
    return result;
  }

  __aicore__ inline void Load(AscendC::TQue<TPosition::VECIN, kBufferNum>& que,
                              const AscendC::GlobalTensor<float>& src, uint32_t n) {
    LocalTensor<float> tile = que.AllocTensor<float>();
    dflash::ascend::kernel::CopyIn(tile, src, n);
    que.EnQue(tile);
  }

  // Folds tile `w` (n weights starting at vocabulary index `start`) into the running argmax. Only
  // when the tile's maximum beats the best so far does it locate the first index of that maximum:
  // Compare(w == max) selects ramp indices, and the smallest selected index wins.
  __aicore__ inline void TileArgmax(const LocalTensor<float>& w, uint32_t n, uint32_t start,
                                    bool residual, float& best, PassResult& result) {
    LocalTensor<float> scalars = scalarBuf_.Get<float>();
    LocalTensor<float> tmp = tmpBuf_.Get<float>();
    LocalTensor<float> cand = candBuf_.Get<float>();
    AscendC::ReduceMax(scalars, w, tmp, n);
    dflash::ascend::kernel::Sync<HardEvent::V_S>(pipe_);
    const float tileMax = scalars.GetValue(0);
    if (residual) {
      const float r = scalars.GetValue(2 * kSlot);
      if (r > result.residual_max) result.residual_max = r;
    }
    if (!(tileMax > best)) return;  // ties keep the earlier tile: first index wins

    const uint32_t compared = (n + 63) / 64 * 64;  // Compare works on whole 256-byte repeats
    AscendC::Duplicate(cand, tileMax, compared);
    AscendC::PipeBarrier<PIPE_V>();
    LocalTensor<uint8_t> mask = maskBuf_.Get<uint8_t>();
    AscendC::Compare(mask, w, cand, AscendC::CMPMODE::EQ, compared);
    AscendC::PipeBarrier<PIPE_V>();
    AscendC::Select(cand, mask, rampBuf_.Get<float>(), static_cast<float>(t_.tile),
                    AscendC::SELMODE::VSEL_TENSOR_SCALAR_MODE, n);
    AscendC::PipeBarrier<PIPE_V>();
    AscendC::ReduceMin(scalars[kSlot], cand, tmp, n);
    dflash::ascend::kernel::Sync<HardEvent::V_S>(pipe_);
    best = tileMax;
    result.index = start + static_cast<uint32_t>(scalars.GetValue(kSlot));
  }

  // out_ids[b] = accepted drafts, the last token, then -1; num_accepted[b] = accepted.
  __aicore__ inline void WriteRow(uint32_t b, uint32_t accepted, uint32_t last) {
    // rows are reused: the previous row's copy-out must be done. An immediate sync, not a flag
    // held from there: scalar code in between would share IDs with bisheng's auto-sync.
    dflash::ascend::kernel::Sync<HardEvent::MTE3_S>(pipe_);
    LocalTensor<int64_t> row = rowBuf_.Get<int64_t>();
    LocalTensor<int64_t> count = countBuf_.Get<int64_t>();
    for (uint32_t i = 0; i <= t_.drafts; ++i) {
      int64_t token = -1;
      if (i < accepted) token = draftIds_.GetValue(static_cast<uint64_t>(b) * t_.drafts + i);
      if (i == accepted) token = last;
      row.SetValue(i, token);
    }
    count.SetValue(0, accepted);
    dflash::ascend::kernel::Sync<HardEvent::S_MTE3>(pipe_);
    dflash::ascend::kernel::CopyOut(outIds_[static_cast<uint64_t>(b) * (t_.drafts + 1)], row,
                                    t_.drafts + 1);
    dflash::ascend::kernel::CopyOut(numAccepted_[b], count, 1);
  }

  RejectionSampleTiling t_;
  AscendC::TPipe pipe_;
  AscendC::TQue<TPosition::VECIN, kBufferNum> pQue_, eQue_, qQue_;
  AscendC::TBuf<TPosition::VECCALC> workBuf_, rampBuf_, candBuf_, maskBuf_, tmpBuf_, scalarBuf_;
  AscendC::TBuf<TPosition::VECOUT> rowBuf_, countBuf_;
  AscendC::GlobalTensor<int64_t> draftIds_, outIds_, numAccepted_;
  AscendC::GlobalTensor<float> targetProbs_, draftProbs_, uniform_, exponential_;
  AscendC::GlobalTensor<uint8_t> isGreedy_;
};

}  // namespace

extern "C" __global__ __aicore__ void dflash_rejection_sample(
    GM_ADDR draft_ids, GM_ADDR draft_probs, GM_ADDR target_probs, GM_ADDR is_greedy,
    GM_ADDR uniform, GM_ADDR exponential, GM_ADDR out_ids, GM_ADDR num_accepted,
    RejectionSampleTiling tiling) {
  KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_AIV_ONLY);  // vector only: one block a vector core
  RejectionSampler sampler;
  sampler.Init(draft_ids, draft_probs, target_probs, is_greedy, uniform, exponential, out_ids,
               num_accepted, tiling);
  sampler.Process();
}
