// Kernel snippets for tests/test_ascend_emu.py: for every hardware rule the emulation enforces, a
// snippet that breaks it (name ending in "_bad") and, mostly, a twin that does the same job legally
// ("_ok") so the test can show the rule is caught and the legal form computes the right answer.
// Every snippet gets `in` (256 floats, read-only) and `out` (256 floats).
#include <cstring>
#include <string>

#include "kernel_operator.h"

using namespace AscendC;

namespace {

constexpr uint32_t kFloats = 256;

struct Gm {
  GlobalTensor<float> in, out;
  Gm(GM_ADDR i, GM_ADDR o) {
    in.SetGlobalBuffer((__gm__ float*)i, kFloats);
    out.SetGlobalBuffer((__gm__ float*)o, kFloats);
  }
};

void CopyOut(const GlobalTensor<float>& dst, const LocalTensor<float>& src, uint32_t n) {
  DataCopyPad(dst, src, DataCopyExtParams{1, static_cast<uint32_t>(n * sizeof(float)), 0, 0, 0});
}

// ---- dma-granularity: DataCopy moves whole 32-byte blocks
// ----------------------------------------

void dma_granularity_bad(GM_ADDR i, GM_ADDR o) {
  Gm gm(i, o);
  TPipe pipe;
  TBuf<TPosition::VECIN> buf;
  pipe.InitBuffer(buf, 64 * sizeof(float));
  DataCopy(buf.Get<float>(), gm.in, 9);  // 36 bytes
}

// out[0:9] = in[0:9], nothing else written, through a TBuf at position Pos.
template <TPosition Pos>
void PadRoundTrip(GM_ADDR i, GM_ADDR o) {
  Gm gm(i, o);
  TPipe pipe;
  TBuf<Pos> buf;
  pipe.InitBuffer(buf, 64 * sizeof(float));
  DataCopyPad(buf.template Get<float>(), gm.in, DataCopyExtParams{1, 9 * sizeof(float), 0, 0, 0},
              DataCopyPadExtParams<float>{false, 0, 0, 0});
  SetFlag<HardEvent::MTE2_MTE3>(0);
  WaitFlag<HardEvent::MTE2_MTE3>(0);
  CopyOut(gm.out, buf.template Get<float>(), 9);
}

void dma_granularity_ok(GM_ADDR i, GM_ADDR o) {
  PadRoundTrip<TPosition::VECIN>(i, o);
}

// ---- alignment: UB operands start on 32-byte boundaries
// --------------------------------------------

void alignment_bad(GM_ADDR i, GM_ADDR o) {
  Gm gm(i, o);
  TPipe pipe;
  TBuf<TPosition::VECIN> buf;
  pipe.InitBuffer(buf, 64 * sizeof(float));
  Duplicate(buf.Get<float>()[3], 1.0f, 8);  // byte 12
}

void alignment_ok(GM_ADDR i, GM_ADDR o) {  // out[0:8] = 1
  Gm gm(i, o);
  TPipe pipe;
  TBuf<TPosition::VECIN> buf;
  pipe.InitBuffer(buf, 64 * sizeof(float));
  Duplicate(buf.Get<float>()[8], 1.0f, 8);  // byte 32
  SetFlag<HardEvent::V_MTE3>(0);
  WaitFlag<HardEvent::V_MTE3>(0);
  CopyOut(gm.out, buf.Get<float>()[8], 8);
}

// ---- ub-bounds: an operand stays inside its buffer
// -------------------------------------------------

void ub_bounds_bad(GM_ADDR, GM_ADDR) {
  TPipe pipe;
  TBuf<TPosition::VECIN> buf;
  pipe.InitBuffer(buf, 64 * sizeof(float));
  Duplicate(buf.Get<float>(), 0.0f, 128);
}

// ---- ub-budget: 192 KiB of unified buffer per core
// -------------------------------------------------

void ub_budget_bad(GM_ADDR, GM_ADDR) {
  TPipe pipe;
  TBuf<TPosition::VECIN> a, b, c;
  pipe.InitBuffer(a, 64 * 1024);
  pipe.InitBuffer(b, 64 * 1024);
  pipe.InitBuffer(c, 64 * 1024 + 32);
}

void ub_budget_ok(GM_ADDR i, GM_ADDR o) {  // out[0:8] = 3, written from the last UB bytes
  Gm gm(i, o);
  TPipe pipe;
  TBuf<TPosition::VECIN> a, b, c;
  pipe.InitBuffer(a, 64 * 1024);
  pipe.InitBuffer(b, 64 * 1024);
  pipe.InitBuffer(c, 64 * 1024);
  const uint32_t last = 64 * 1024 / sizeof(float) - 8;  // the final 32 bytes of the budget
  Duplicate(c.Get<float>()[last], 3.0f, 8);
  SetFlag<HardEvent::V_MTE3>(0);
  WaitFlag<HardEvent::V_MTE3>(0);
  CopyOut(gm.out, c.Get<float>()[last], 8);
}

// ---- queue-depth: buffers, queue depth, empty queues
// ----------------------------------------------

void queue_alloc_bad(GM_ADDR, GM_ADDR) {
  TPipe pipe;
  TQue<TPosition::VECIN, 1> que;
  pipe.InitBuffer(que, 2, 256);
  que.AllocTensor<float>();
  que.AllocTensor<float>();
  que.AllocTensor<float>();  // both buffers are taken
}

void queue_alloc_ok(GM_ADDR i, GM_ADDR o) {  // out[0:192] = in[0:192] + 1: 3 tiles, 2 buffers
  Gm gm(i, o);
  TPipe pipe;
  TQue<TPosition::VECIN, 1> que;
  TQue<TPosition::VECOUT, 1> outQue;
  pipe.InitBuffer(que, 2, 256);
  pipe.InitBuffer(outQue, 1, 256);
  for (uint32_t k = 0; k < 3; ++k) {  // a freed buffer is handed out again
    LocalTensor<float> t = que.AllocTensor<float>();
    DataCopy(t, gm.in[k * 64], 64);
    que.EnQue(t);
    t = que.DeQue<float>();
    LocalTensor<float> y = outQue.AllocTensor<float>();
    Adds(y, t, 1.0f, 64);
    que.FreeTensor(t);
    outQue.EnQue(y);
    y = outQue.DeQue<float>();
    DataCopy(gm.out[k * 64], y, 64);
    outQue.FreeTensor(y);
  }
}

void queue_enque_bad(GM_ADDR, GM_ADDR) {
  TPipe pipe;
  TQue<TPosition::VECIN, 1> que;
  pipe.InitBuffer(que, 2, 256);
  LocalTensor<float> a = que.AllocTensor<float>(), b = que.AllocTensor<float>();
  que.EnQue(a);
  que.EnQue(b);  // depth 1
}

void queue_enque_ok(GM_ADDR i, GM_ADDR o) {  // out[0:64] = in[0:64] + in[64:128]
  Gm gm(i, o);
  TPipe pipe;
  TQue<TPosition::VECIN, 1> que;
  TQue<TPosition::VECOUT, 1> outQue;
  pipe.InitBuffer(que, 2, 256);
  pipe.InitBuffer(outQue, 1, 256);
  LocalTensor<float> a = que.AllocTensor<float>(), b = que.AllocTensor<float>();
  DataCopy(a, gm.in, 64);
  que.EnQue(a);
  a = que.DeQue<float>();  // depth 1: dequeue before the next enqueue
  DataCopy(b, gm.in[64], 64);
  que.EnQue(b);
  b = que.DeQue<float>();
  LocalTensor<float> y = outQue.AllocTensor<float>();
  Add(y, a, b, 64);
  que.FreeTensor(a);
  que.FreeTensor(b);
  outQue.EnQue(y);
  y = outQue.DeQue<float>();
  DataCopy(gm.out, y, 64);
  outQue.FreeTensor(y);
}

void queue_deque_bad(GM_ADDR, GM_ADDR) {
  TPipe pipe;
  TQue<TPosition::VECOUT, 1> que;
  pipe.InitBuffer(que, 1, 256);
  que.DeQue<float>();
}

// ---- bf16-arith: no bf16 arithmetic on A2; cast to float
// ------------------------------------------

void bf16_arith_bad(GM_ADDR, GM_ADDR) {
  TPipe pipe;
  TBuf<TPosition::VECIN> buf;
  pipe.InitBuffer(buf, 64 * sizeof(bfloat16_t));
  LocalTensor<bfloat16_t> x = buf.Get<bfloat16_t>();
  Duplicate(x, bfloat16_t(1.0f), 64);
  PipeBarrier<PIPE_V>();
  Add(x, x, x, 64);
}

void bf16_arith_ok(GM_ADDR i, GM_ADDR o) {  // out[0:64] = float(bf16(2 * float(bf16(in))))
  Gm gm(i, o);
  TPipe pipe;
  TBuf<TPosition::VECIN> f, h;
  pipe.InitBuffer(f, 64 * sizeof(float));
  pipe.InitBuffer(h, 64 * sizeof(bfloat16_t));
  LocalTensor<float> x = f.Get<float>();
  LocalTensor<bfloat16_t> b = h.Get<bfloat16_t>();
  DataCopy(x, gm.in, 64);
  SetFlag<HardEvent::MTE2_V>(0);
  WaitFlag<HardEvent::MTE2_V>(0);
  Cast(b, x, RoundMode::CAST_RINT, 64);
  PipeBarrier<PIPE_V>();
  Cast(x, b, RoundMode::CAST_NONE, 64);
  PipeBarrier<PIPE_V>();
  Add(x, x, x, 64);
  PipeBarrier<PIPE_V>();
  Cast(b, x, RoundMode::CAST_RINT, 64);
  PipeBarrier<PIPE_V>();
  Cast(x, b, RoundMode::CAST_NONE, 64);
  SetFlag<HardEvent::V_MTE3>(0);
  WaitFlag<HardEvent::V_MTE3>(0);
  CopyOut(gm.out, x, 64);
}

// Conversions round to nearest even: out[0:128] = float(bf16(in)), out[128:256] = float(half(in)).
void cast_roundtrip_ok(GM_ADDR i, GM_ADDR o) {
  Gm gm(i, o);
  TPipe pipe;
  TBuf<TPosition::VECIN> f, h;
  pipe.InitBuffer(f, kFloats * sizeof(float));
  pipe.InitBuffer(h, 128 * sizeof(half));
  LocalTensor<float> x = f.Get<float>();
  DataCopy(x, gm.in, kFloats);
  SetFlag<HardEvent::MTE2_V>(0);
  WaitFlag<HardEvent::MTE2_V>(0);
  LocalTensor<bfloat16_t> b = h.Get<bfloat16_t>();
  Cast(b, x, RoundMode::CAST_RINT, 128);
  PipeBarrier<PIPE_V>();
  Cast(x, b, RoundMode::CAST_NONE, 128);
  PipeBarrier<PIPE_V>();
  LocalTensor<half> s = h.Get<half>();
  Cast(s, x[128], RoundMode::CAST_RINT, 128);
  PipeBarrier<PIPE_V>();
  Cast(x[128], s, RoundMode::CAST_NONE, 128);
  SetFlag<HardEvent::V_MTE3>(0);
  WaitFlag<HardEvent::V_MTE3>(0);
  DataCopy(gm.out, x, kFloats);
}

// Loads in[0:200] into f, lets `reduce` write results into w (64 floats), copies out[0:n] = w[0:n].
template <typename Reduce>
void Reduction(GM_ADDR i, GM_ADDR o, uint32_t n, Reduce reduce) {
  Gm gm(i, o);
  TPipe pipe;
  TBuf<TPosition::VECIN> f, w;
  pipe.InitBuffer(f, kFloats * sizeof(float));
  pipe.InitBuffer(w, 64 * sizeof(float));
  DataCopy(f.Get<float>(), gm.in, 200);
  SetFlag<HardEvent::MTE2_V>(0);
  WaitFlag<HardEvent::MTE2_V>(0);
  reduce(w.Get<float>(), f.Get<float>());
  SetFlag<HardEvent::V_MTE3>(0);
  WaitFlag<HardEvent::V_MTE3>(0);
  CopyOut(gm.out, w.Get<float>(), n);
}

// out[0] = max(in[0:200]), out[1] = the bits of the index of its first occurrence (uint32).
void reduce_max_index_ok(GM_ADDR i, GM_ADDR o) {
  Reduction(i, o, 2, [](const LocalTensor<float>& w, const LocalTensor<float>& f) {
    ReduceMax(w, f, w[8], 200, true);
  });
}

// ---- sum: Sum reduces rows that are whole 32-byte blocks long
// -------------------------------------

void sum_bad(GM_ADDR, GM_ADDR) {
  TPipe pipe;
  TBuf<TPosition::VECIN> f, w;
  pipe.InitBuffer(f, 64 * sizeof(float));
  pipe.InitBuffer(w, 64 * sizeof(float));
  Duplicate(f.Get<float>(), 1.0f, 64);
  PipeBarrier<PIPE_V>();
  Sum(w.Get<float>(), f.Get<float>(), w.Get<uint8_t>()[32], SumParams{2, 6, 6});  // 24-byte rows
}

// out[0:4] = sums of the first 37 of each 40 floats of in[0:160]; out[4:8] = Sum's unspecified
// tail of the 32-byte destination block.
void sum_ok(GM_ADDR i, GM_ADDR o) {
  Gm gm(i, o);
  TPipe pipe;
  TBuf<TPosition::VECIN> f, w;
  pipe.InitBuffer(f, 160 * sizeof(float));
  pipe.InitBuffer(w, 64 * sizeof(float));
  DataCopy(f.Get<float>(), gm.in, 160);
  SetFlag<HardEvent::MTE2_V>(0);
  WaitFlag<HardEvent::MTE2_V>(0);
  Sum(w.Get<float>(), f.Get<float>(), w.Get<uint8_t>()[32], SumParams{4, 40, 37});
  SetFlag<HardEvent::V_MTE3>(0);
  WaitFlag<HardEvent::V_MTE3>(0);
  CopyOut(gm.out, w.Get<float>(), 8);
}

// The other elementwise ops, 32 lanes each: x = in[0:32], y = in[32:64] (y > 0):
// out = [max(x, y), min(x, y), x - y, x / y, exp(x), ln(y), sqrt(y), rsqrt(y)].
void elementwise_ok(GM_ADDR i, GM_ADDR o) {
  Gm gm(i, o);
  TPipe pipe;
  TBuf<TPosition::VECIN> f, g;
  pipe.InitBuffer(f, 64 * sizeof(float));
  pipe.InitBuffer(g, kFloats * sizeof(float));
  LocalTensor<float> x = f.Get<float>(), y = x[32], r = g.Get<float>();
  DataCopy(x, gm.in, 64);
  SetFlag<HardEvent::MTE2_V>(0);
  WaitFlag<HardEvent::MTE2_V>(0);
  Max(r, x, y, 32);
  Min(r[32], x, y, 32);
  Sub(r[64], x, y, 32);
  Div(r[96], x, y, 32);
  Exp(r[128], x, 32);
  Ln(r[160], y, 32);
  Sqrt(r[192], y, 32);
  Rsqrt(r[224], y, 32);
  SetFlag<HardEvent::V_MTE3>(0);
  WaitFlag<HardEvent::V_MTE3>(0);
  DataCopy(gm.out, r, kFloats);
}

// ---- compare-256: Compare works on whole 256-byte repeats
// -----------------------------------------

void compare_bad(GM_ADDR, GM_ADDR) {
  TPipe pipe;
  TBuf<TPosition::VECIN> f, m;
  pipe.InitBuffer(f, 128 * sizeof(float));
  pipe.InitBuffer(m, 32);
  LocalTensor<float> x = f.Get<float>();
  Duplicate(x, 0.0f, 128);
  PipeBarrier<PIPE_V>();
  Compare(m.Get<uint8_t>(), x, x[64], CMPMODE::LT, 48);  // 192 bytes
}

void compare_ok(GM_ADDR i, GM_ADDR o) {  // out[0:64] = in < in[64:128] ? in : -1
  Gm gm(i, o);
  TPipe pipe;
  TBuf<TPosition::VECIN> f, m;
  pipe.InitBuffer(f, 192 * sizeof(float));
  pipe.InitBuffer(m, 32);
  LocalTensor<float> x = f.Get<float>();
  DataCopy(x, gm.in, 128);
  SetFlag<HardEvent::MTE2_V>(0);
  WaitFlag<HardEvent::MTE2_V>(0);
  Compare(m.Get<uint8_t>(), x, x[64], CMPMODE::LT, 64);
  PipeBarrier<PIPE_V>();
  Select(x[128], m.Get<uint8_t>(), x, -1.0f, SELMODE::VSEL_TENSOR_SCALAR_MODE, 64);
  SetFlag<HardEvent::V_MTE3>(0);
  WaitFlag<HardEvent::V_MTE3>(0);
  CopyOut(gm.out, x[128], 64);
}

// ---- poison: fresh UB and unpadded DataCopyPad lanes hold NaN patterns
// ----------------------------

void Sum(const Gm& gm, const LocalTensor<float>& x, const LocalTensor<float>& work, uint32_t n) {
  ReduceSum(work, x, work[8], n);
  SetFlag<HardEvent::V_MTE3>(0);
  WaitFlag<HardEvent::V_MTE3>(0);
  CopyOut(gm.out, work, 1);
}

void poison_fresh_bad(GM_ADDR i, GM_ADDR o) {  // out[0] = sum of 8 loaded and 56 never written
  Gm gm(i, o);
  TPipe pipe;
  TBuf<TPosition::VECIN> f, w;
  pipe.InitBuffer(f, 64 * sizeof(float));
  pipe.InitBuffer(w, 64 * sizeof(float));
  DataCopy(f.Get<float>(), gm.in, 8);
  SetFlag<HardEvent::MTE2_V>(0);
  WaitFlag<HardEvent::MTE2_V>(0);
  Sum(gm, f.Get<float>(), w.Get<float>(), 64);
}

void poison_fresh_ok(GM_ADDR i, GM_ADDR o) {  // out[0] = sum(in[0:8])
  Gm gm(i, o);
  TPipe pipe;
  TBuf<TPosition::VECIN> f, w;
  pipe.InitBuffer(f, 64 * sizeof(float));
  pipe.InitBuffer(w, 64 * sizeof(float));
  Duplicate(f.Get<float>(), 0.0f, 64);
  SetFlag<HardEvent::V_MTE2>(0);
  WaitFlag<HardEvent::V_MTE2>(0);
  DataCopy(f.Get<float>(), gm.in, 8);
  SetFlag<HardEvent::MTE2_V>(0);
  WaitFlag<HardEvent::MTE2_V>(0);
  Sum(gm, f.Get<float>(), w.Get<float>(), 64);
}

void PadSum(GM_ADDR i, GM_ADDR o, bool isPad) {  // out[0] = sum of 5 loaded + 3 padding lanes
  Gm gm(i, o);
  TPipe pipe;
  TBuf<TPosition::VECIN> f, w;
  pipe.InitBuffer(f, 8 * sizeof(float));
  pipe.InitBuffer(w, 64 * sizeof(float));
  DataCopyPad(f.Get<float>(), gm.in, DataCopyExtParams{1, 5 * sizeof(float), 0, 0, 0},
              DataCopyPadExtParams<float>{isPad, 0, 3, 0.0f});
  SetFlag<HardEvent::MTE2_V>(0);
  WaitFlag<HardEvent::MTE2_V>(0);
  Sum(gm, f.Get<float>(), w.Get<float>(), 8);
}

void poison_pad_bad(GM_ADDR i, GM_ADDR o) {
  PadSum(i, o, false);
}
void poison_pad_ok(GM_ADDR i, GM_ADDR o) {
  PadSum(i, o, true);
}

// ---- overlap: operands overlap only as an identical in-place destination
// ---------------------------

void OverlapAdd(GM_ADDR i, GM_ADDR o, uint32_t dst) {  // out[0:64] = in[0:64] + in[64:128]
  Gm gm(i, o);
  TPipe pipe;
  TBuf<TPosition::VECIN> f;
  pipe.InitBuffer(f, 192 * sizeof(float));
  LocalTensor<float> x = f.Get<float>();
  DataCopy(x, gm.in, 128);
  SetFlag<HardEvent::MTE2_V>(0);
  WaitFlag<HardEvent::MTE2_V>(0);
  Add(x[dst], x, x[64], 64);
  SetFlag<HardEvent::V_MTE3>(0);
  WaitFlag<HardEvent::V_MTE3>(0);
  CopyOut(gm.out, x[dst], 64);
}

void overlap_bad(GM_ADDR i, GM_ADDR o) {
  OverlapAdd(i, o, 8);
}
void overlap_ok(GM_ADDR i, GM_ADDR o) {
  OverlapAdd(i, o, 0);
}

// ---- sync: pipes run asynchronously; flags and barriers order them
// ---------------------------------

void MaxOfInput(GM_ADDR i, GM_ADDR o, bool flag) {  // out[0] = max(in[0:64]) via a scalar read
  Gm gm(i, o);
  TPipe pipe;
  TBuf<TPosition::VECIN> f, w, r;
  pipe.InitBuffer(f, 64 * sizeof(float));
  pipe.InitBuffer(w, 64 * sizeof(float));
  pipe.InitBuffer(r, 8 * sizeof(float));
  DataCopy(f.Get<float>(), gm.in, 64);
  SetFlag<HardEvent::MTE2_V>(0);
  WaitFlag<HardEvent::MTE2_V>(0);
  ReduceMax(w.Get<float>(), f.Get<float>(), w.Get<float>()[8], 64);
  if (flag) {
    SetFlag<HardEvent::V_S>(0);
    WaitFlag<HardEvent::V_S>(0);
  }
  const float m = w.Get<float>().GetValue(0);
  r.Get<float>().SetValue(0, m);
  SetFlag<HardEvent::S_MTE3>(0);
  WaitFlag<HardEvent::S_MTE3>(0);
  CopyOut(gm.out, r.Get<float>(), 1);
}

void sync_v_s_bad(GM_ADDR i, GM_ADDR o) {
  MaxOfInput(i, o, false);
}
void sync_v_s_ok(GM_ADDR i, GM_ADDR o) {
  MaxOfInput(i, o, true);
}

void ScaleShift(GM_ADDR i, GM_ADDR o, bool loadFlag, bool barrier,
                bool storeFlag) {  // out = 2 in + 1
  Gm gm(i, o);
  TPipe pipe;
  TBuf<TPosition::VECIN> f;
  pipe.InitBuffer(f, 64 * sizeof(float));
  LocalTensor<float> x = f.Get<float>();
  DataCopy(x, gm.in, 64);
  if (loadFlag) {
    SetFlag<HardEvent::MTE2_V>(0);
    WaitFlag<HardEvent::MTE2_V>(0);
  }
  Muls(x, x, 2.0f, 64);
  if (barrier) PipeBarrier<PIPE_V>();
  Adds(x, x, 1.0f, 64);
  if (storeFlag) {
    SetFlag<HardEvent::V_MTE3>(0);
    WaitFlag<HardEvent::V_MTE3>(0);
  }
  CopyOut(gm.out, x, 64);
}

void sync_mte2_v_bad(GM_ADDR i, GM_ADDR o) {
  ScaleShift(i, o, false, true, true);
}
void sync_v_v_bad(GM_ADDR i, GM_ADDR o) {
  ScaleShift(i, o, true, false, true);
}
void sync_v_mte3_bad(GM_ADDR i, GM_ADDR o) {
  ScaleShift(i, o, true, true, false);
}
void sync_ok(GM_ADDR i, GM_ADDR o) {
  ScaleShift(i, o, true, true, true);
}

// Reloading a buffer the vector unit may still be reading needs V_MTE2 first.
void Reload(GM_ADDR i, GM_ADDR o, bool flag) {  // out[0:64] = 2 in[0:64] + in[64:128]
  Gm gm(i, o);
  TPipe pipe;
  TBuf<TPosition::VECIN> f, g;
  pipe.InitBuffer(f, 64 * sizeof(float));
  pipe.InitBuffer(g, 64 * sizeof(float));
  LocalTensor<float> x = f.Get<float>(), y = g.Get<float>();
  DataCopy(x, gm.in, 64);
  SetFlag<HardEvent::MTE2_V>(0);
  WaitFlag<HardEvent::MTE2_V>(0);
  Muls(y, x, 2.0f, 64);
  if (flag) {
    SetFlag<HardEvent::V_MTE2>(0);
    WaitFlag<HardEvent::V_MTE2>(0);
  }
  DataCopy(x, gm.in[64], 64);
  SetFlag<HardEvent::MTE2_V>(0);
  WaitFlag<HardEvent::MTE2_V>(0);
  PipeBarrier<PIPE_V>();
  Add(y, y, x, 64);
  SetFlag<HardEvent::V_MTE3>(0);
  WaitFlag<HardEvent::V_MTE3>(0);
  CopyOut(gm.out, y, 64);
}

void sync_war_bad(GM_ADDR i, GM_ADDR o) {
  Reload(i, o, false);
}
void sync_war_ok(GM_ADDR i, GM_ADDR o) {
  Reload(i, o, true);
}

// A queue's EnQue/DeQue and FreeTensor/AllocTensor carry the flags themselves.
void sync_queue_ok(GM_ADDR i, GM_ADDR o) {  // out[0:128] = 2 in[0:128] + 1, two tiles
  Gm gm(i, o);
  TPipe pipe;
  TQue<TPosition::VECIN, 1> inQue;
  TQue<TPosition::VECOUT, 1> outQue;
  pipe.InitBuffer(inQue, 1, 64 * sizeof(float));
  pipe.InitBuffer(outQue, 1, 64 * sizeof(float));
  for (uint32_t tile = 0; tile < 2; ++tile) {
    LocalTensor<float> x = inQue.AllocTensor<float>();
    DataCopy(x, gm.in[tile * 64], 64);
    inQue.EnQue(x);
    x = inQue.DeQue<float>();
    LocalTensor<float> y = outQue.AllocTensor<float>();
    Muls(y, x, 2.0f, 64);
    PipeBarrier<PIPE_V>();
    Adds(y, y, 1.0f, 64);
    inQue.FreeTensor(x);
    outQue.EnQue(y);
    y = outQue.DeQue<float>();
    DataCopy(gm.out[tile * 64], y, 64);
    outQue.FreeTensor(y);
  }
}

void sync_s_mte3_bad(GM_ADDR i, GM_ADDR o) {
  Gm gm(i, o);
  TPipe pipe;
  TBuf<TPosition::VECOUT> f;
  pipe.InitBuffer(f, 8 * sizeof(float));
  f.Get<float>().SetValue(0, 1.0f);
  CopyOut(gm.out, f.Get<float>(), 1);
}

void event_deadlock_bad(GM_ADDR, GM_ADDR) {
  WaitFlag<HardEvent::V_S>(0);
}
void event_leftover_bad(GM_ADDR, GM_ADDR) {
  SetFlag<HardEvent::V_S>(0);
}
void event_ok(GM_ADDR, GM_ADDR) {
  SetFlag<HardEvent::V_S>(0);
  WaitFlag<HardEvent::V_S>(0);
}
void pipe_s_bad(GM_ADDR, GM_ADDR) {
  PipeBarrier<PIPE_S>();
}

// ---- gm-bounds: GM accesses stay inside the tensors passed; inputs are read-only
// -------------------

void gm_bounds_bad(GM_ADDR i, GM_ADDR) {
  GlobalTensor<float> in;
  in.SetGlobalBuffer((__gm__ float*)i);  // no size: only the launcher's tensor bounds apply
  TPipe pipe;
  TBuf<TPosition::VECIN> f;
  pipe.InitBuffer(f, 512 * sizeof(float));
  DataCopy(f.Get<float>(), in, 512);
}

void gm_readonly_bad(GM_ADDR i, GM_ADDR) {
  GlobalTensor<float> in;
  in.SetGlobalBuffer((__gm__ float*)i);
  TPipe pipe;
  TBuf<TPosition::VECIN> f;
  pipe.InitBuffer(f, 8 * sizeof(float));
  Duplicate(f.Get<float>(), 0.0f, 8);
  SetFlag<HardEvent::V_MTE3>(0);
  WaitFlag<HardEvent::V_MTE3>(0);
  DataCopy(in, f.Get<float>(), 8);
}

// ---- argument checks: DMA padding, round modes, select modes, foreign queue tensors -------------

void dma_params_bad(GM_ADDR i, GM_ADDR o) {
  Gm gm(i, o);
  TPipe pipe;
  TBuf<TPosition::VECIN> f;
  pipe.InitBuffer(f, 64 * sizeof(float));
  DataCopyPad(f.Get<float>(), gm.in, DataCopyExtParams{1, 4 * sizeof(float), 0, 0, 0},
              DataCopyPadExtParams<float>{true, 0, 9, 0.0f});  // 36 bytes of padding
}

void dma_block_count_bad(GM_ADDR i, GM_ADDR o) {
  Gm gm(i, o);
  TPipe pipe;
  TBuf<TPosition::VECIN> f;
  pipe.InitBuffer(f, 4096 * 32);
  DataCopyPad(f.Get<float>(), gm.in, DataCopyExtParams{4096, sizeof(float), 0, 0, 0},
              DataCopyPadExtParams<float>{false, 0, 0, 0.0f});  // one block more than allowed
}

void cast_mode_bad(GM_ADDR, GM_ADDR) {
  TPipe pipe;
  TBuf<TPosition::VECIN> f, h;
  pipe.InitBuffer(f, 64 * sizeof(float));
  pipe.InitBuffer(h, 64 * sizeof(bfloat16_t));
  Duplicate(f.Get<float>(), 1.5f, 64);
  PipeBarrier<PIPE_V>();
  Cast(h.Get<bfloat16_t>(), f.Get<float>(), RoundMode::CAST_FLOOR, 64);
}

void select_mode_bad(GM_ADDR, GM_ADDR) {
  TPipe pipe;
  TBuf<TPosition::VECIN> f, m;
  pipe.InitBuffer(f, 128 * sizeof(float));
  pipe.InitBuffer(m, 32);
  Duplicate(f.Get<float>(), 1.0f, 64);
  Duplicate(m.Get<uint8_t>(), static_cast<uint8_t>(0xFF), 32);
  PipeBarrier<PIPE_V>();
  Select(f.Get<float>()[64], m.Get<uint8_t>(), f.Get<float>(), 0.0f,
         SELMODE::VSEL_TENSOR_TENSOR_MODE, 64);
}

void queue_free_bad(GM_ADDR, GM_ADDR) {
  TPipe pipe;
  TQue<TPosition::VECIN, 1> a, b;
  pipe.InitBuffer(a, 1, 256);
  pipe.InitBuffer(b, 1, 256);
  LocalTensor<float> t = a.AllocTensor<float>();
  b.FreeTensor(t);
}

// ---- event: queue flags and kernel flags share one pool of IDs per pipe pair
// ---------------------

// A VECIN queue's FreeTensor holds V_MTE2 ID 0 until the buffer is allocated again; then either a
// hand-coded SetFlag<V_MTE2>(0) lands on the set flag, or a hand-coded WaitFlag<V_MTE2>(0) takes
// it and the AllocTensor waits on a flag nothing sets again.
void QueueThenHandFlag(GM_ADDR i, GM_ADDR o, int mode) {
  Gm gm(i, o);
  TPipe pipe;
  TQue<TPosition::VECIN, 1> que;
  pipe.InitBuffer(que, 1, 64 * sizeof(float));
  LocalTensor<float> t = que.AllocTensor<float>();
  DataCopy(t, gm.in, 64);
  que.EnQue(t);
  t = que.DeQue<float>();
  Adds(t, t, 1.0f, 64);
  que.FreeTensor(t);
  if (mode == 0) {  // collision: the ID is hard-coded
    SetFlag<HardEvent::V_MTE2>(0);
    WaitFlag<HardEvent::V_MTE2>(0);
  } else if (mode == 1) {  // hang: a hand-coded wait consumes the queue's flag
    WaitFlag<HardEvent::V_MTE2>(0);
  } else {  // legal: the ID comes from the pool
    TEventID id = pipe.FetchEventID(HardEvent::V_MTE2);
    SetFlag<HardEvent::V_MTE2>(id);
    WaitFlag<HardEvent::V_MTE2>(id);
  }
  t = que.AllocTensor<float>();
  DataCopy(t, gm.in[64], 64);
  que.EnQue(t);
  t = que.DeQue<float>();
  Adds(t, t, 2.0f, 64);
  TEventID out = pipe.AllocEventID<HardEvent::V_MTE3>();
  SetFlag<HardEvent::V_MTE3>(out);
  WaitFlag<HardEvent::V_MTE3>(out);
  pipe.ReleaseEventID<HardEvent::V_MTE3>(out);
  CopyOut(gm.out, t, 64);  // out[0:64] = in[64:128] + 2
  que.FreeTensor(t);
}

void event_queue_collision_bad(GM_ADDR i, GM_ADDR o) {
  QueueThenHandFlag(i, o, 0);
}
void event_queue_hang_bad(GM_ADDR i, GM_ADDR o) {
  QueueThenHandFlag(i, o, 1);
}
void event_queue_ok(GM_ADDR i, GM_ADDR o) {
  QueueThenHandFlag(i, o, 2);
}

// A queue's FreeTensor flag still held when the pipe ends is waited there; a kernel that took it
// by hand leaves that wait unsatisfiable.
void event_pipe_end_bad(GM_ADDR i, GM_ADDR o) {
  Gm gm(i, o);
  TPipe pipe;
  TQue<TPosition::VECOUT, 1> que;
  pipe.InitBuffer(que, 1, 64 * sizeof(float));
  LocalTensor<float> t = que.AllocTensor<float>();
  Duplicate(t, 1.0f, 64);
  que.EnQue(t);
  t = que.DeQue<float>();
  CopyOut(gm.out, t, 64);
  que.FreeTensor(t);
  WaitFlag<HardEvent::MTE3_V>(0);
}

void event_pool_bad(GM_ADDR, GM_ADDR) {
  TPipe pipe;
  for (int n = 0; n < 9; ++n) pipe.AllocEventID<HardEvent::V_S>();
}

// ---- select-reserved: tensor-scalar Select writes its scalar into the UB's last 8 KiB
// -------------

void SelectWithBudget(GM_ADDR i, GM_ADDR o, uint32_t bytes) {  // out[0:64] = in < 0 ? in : 5
  Gm gm(i, o);
  TPipe pipe;
  TBuf<TPosition::VECIN> f, m, rest;
  pipe.InitBuffer(f, 128 * sizeof(float));
  pipe.InitBuffer(m, 32);
  pipe.InitBuffer(rest, bytes - 128 * sizeof(float) - 32);
  LocalTensor<float> x = f.Get<float>();
  DataCopy(x, gm.in, 64);
  Duplicate(x[64], 0.0f, 64);
  SetFlag<HardEvent::MTE2_V>(0);
  WaitFlag<HardEvent::MTE2_V>(0);
  PipeBarrier<PIPE_V>();
  Compare(m.Get<uint8_t>(), x, x[64], CMPMODE::LT, 64);
  PipeBarrier<PIPE_V>();
  Select(x[64], m.Get<uint8_t>(), x, 5.0f, SELMODE::VSEL_TENSOR_SCALAR_MODE, 64);
  SetFlag<HardEvent::V_MTE3>(0);
  WaitFlag<HardEvent::V_MTE3>(0);
  CopyOut(gm.out, x[64], 64);
}

void select_reserved_bad(GM_ADDR i, GM_ADDR o) {
  SelectWithBudget(i, o, 184 * 1024 + 32);
}
void select_reserved_ok(GM_ADDR i, GM_ADDR o) {
  SelectWithBudget(i, o, 184 * 1024);
}

// ---- dma-position: DataCopyPad on A2 moves GM <-> VECIN / VECOUT only
// -----------------------------

void dma_position_bad(GM_ADDR i, GM_ADDR o) {
  PadRoundTrip<TPosition::VECCALC>(i, o);
}

// ---- reductions add in A2's tree order
// ------------------------------------------------------------

// out[0] = ReduceSum(in[0:200]), out[8:12] = Sum of the 4 rows in[0:160] as [4, 40] (first 37).
void reduce_sum_tree_ok(GM_ADDR i, GM_ADDR o) {
  Reduction(i, o, 12, [](const LocalTensor<float>& w, const LocalTensor<float>& f) {
    ReduceSum(w, f, w[32], 200);
    Sum(w[8], f, w.ReinterpretCast<uint8_t>()[192], SumParams{4, 40, 37});
  });
}

// ---- block-race and launch order: blocks run in any order, so they must write disjoint GM
// ---------

// `out` (all 256 floats) and an 8-float UB buffer `x` at position Pos.
template <TPosition Pos>
struct OutAndBuffer {
  GlobalTensor<float> out;
  TPipe pipe;
  TBuf<Pos> buf;
  LocalTensor<float> x;
  explicit OutAndBuffer(GM_ADDR o) {
    out.SetGlobalBuffer((__gm__ float*)o, kFloats);
    pipe.InitBuffer(buf, 8 * sizeof(float));
    x = buf.template Get<float>();
  }
};

void BlockWrites(GM_ADDR o, uint32_t slot) {  // out[8 slot : 8 slot + 8] = (idx, num, ...)
  OutAndBuffer<TPosition::VECIN> s(o);
  GlobalTensor<float>& out = s.out;
  LocalTensor<float>& x = s.x;
  Duplicate(x, static_cast<float>(GetBlockNum()), 8);
  PipeBarrier<PIPE_V>();
  Duplicate(x, static_cast<float>(GetBlockIdx()), 1);
  SetFlag<HardEvent::V_MTE3>(0);
  WaitFlag<HardEvent::V_MTE3>(0);
  DataCopy(out[8 * slot], x, 8);
}

void block_race_bad(GM_ADDR, GM_ADDR o) {
  BlockWrites(o, 0);
}

// ---- auto-sync: a flag between the scalar pipe and a DMA pipe is waited at once, never held
// across scalar UB accesses (bisheng's --cce-auto-sync syncs those itself, on IDs of its own)
template <bool kHeld>
void ScalarAfterCopyOut(GM_ADDR o) {  // out[0:8] = 1, then out[8:16] = 2 from the same buffer
  OutAndBuffer<TPosition::VECOUT> s(o);
  GlobalTensor<float>& out = s.out;
  LocalTensor<float>& x = s.x;
  TPipe& pipe = s.pipe;
  for (uint32_t i = 0; i < 8; ++i) x.SetValue(i, 1.0f);
  const int32_t to_mte3 = pipe.FetchEventID(HardEvent::S_MTE3);
  SetFlag<HardEvent::S_MTE3>(to_mte3);
  WaitFlag<HardEvent::S_MTE3>(to_mte3);
  DataCopy(out, x, 8);
  const int32_t id = pipe.AllocEventID<HardEvent::MTE3_S>();
  SetFlag<HardEvent::MTE3_S>(id);
  if (!kHeld) WaitFlag<HardEvent::MTE3_S>(id);
  const float previous = x.GetValue(0);  // scalar code the compiler would sync itself
  if (kHeld) WaitFlag<HardEvent::MTE3_S>(id);
  pipe.ReleaseEventID<HardEvent::MTE3_S>(id);
  for (uint32_t i = 0; i < 8; ++i) x.SetValue(i, previous + 1.0f);
  SetFlag<HardEvent::S_MTE3>(to_mte3);
  WaitFlag<HardEvent::S_MTE3>(to_mte3);
  DataCopy(out[8], x, 8);
}
void auto_sync_bad(GM_ADDR, GM_ADDR o) {
  ScalarAfterCopyOut<true>(o);
}
void auto_sync_ok(GM_ADDR, GM_ADDR o) {
  ScalarAfterCopyOut<false>(o);
}

// ---- kernel-type: a kernel declares its task type; a MIX type launches two vector blocks per
// block, so work split by GetBlockIdx() / GetBlockNum() runs twice
void GridStrideWrites(GM_ADDR o) {  // slots 0..15 over the blocks, each once with AIV indexing
  for (uint32_t slot = GetBlockIdx(); slot < 16; slot += GetBlockNum()) {
    BlockWrites(o, slot);
    SetFlag<HardEvent::MTE3_V>(0);  // the next slot's Duplicate reuses the UB the copy reads
    WaitFlag<HardEvent::MTE3_V>(0);
  }
}
void kernel_type_undeclared_bad(GM_ADDR, GM_ADDR o) {
  GridStrideWrites(o);
}
void kernel_type_mix_bad(GM_ADDR, GM_ADDR o) {
  KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_MIX_AIC_1_2);
  GridStrideWrites(o);
}
void kernel_type_aiv_ok(GM_ADDR, GM_ADDR o) {
  KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_AIV_ONLY);
  GridStrideWrites(o);
}
void block_race_ok(GM_ADDR, GM_ADDR o) {
  BlockWrites(o, GetBlockIdx());
}

struct Entry {
  const char* name;
  uint32_t blocks;
  void (*kernel)(GM_ADDR, GM_ADDR);
};

#define SNIPPET(NAME, BLOCKS) {#NAME, BLOCKS, NAME}
const Entry kSnippets[] = {
    SNIPPET(dma_granularity_bad, 1),
    SNIPPET(dma_granularity_ok, 1),
    SNIPPET(alignment_bad, 1),
    SNIPPET(alignment_ok, 1),
    SNIPPET(ub_bounds_bad, 1),
    SNIPPET(ub_budget_bad, 1),
    SNIPPET(ub_budget_ok, 1),
    SNIPPET(queue_alloc_bad, 1),
    SNIPPET(queue_alloc_ok, 1),
    SNIPPET(queue_enque_bad, 1),
    SNIPPET(queue_enque_ok, 1),
    SNIPPET(queue_deque_bad, 1),
    SNIPPET(bf16_arith_bad, 1),
    SNIPPET(bf16_arith_ok, 1),
    SNIPPET(cast_roundtrip_ok, 1),
    SNIPPET(reduce_max_index_ok, 1),
    SNIPPET(elementwise_ok, 1),
    SNIPPET(sum_bad, 1),
    SNIPPET(sum_ok, 1),
    SNIPPET(compare_bad, 1),
    SNIPPET(compare_ok, 1),
    SNIPPET(poison_fresh_bad, 1),
    SNIPPET(poison_fresh_ok, 1),
    SNIPPET(poison_pad_bad, 1),
    SNIPPET(poison_pad_ok, 1),
    SNIPPET(overlap_bad, 1),
    SNIPPET(overlap_ok, 1),
    SNIPPET(sync_v_s_bad, 1),
    SNIPPET(sync_v_s_ok, 1),
    SNIPPET(sync_mte2_v_bad, 1),
    SNIPPET(sync_v_v_bad, 1),
    SNIPPET(sync_v_mte3_bad, 1),
    SNIPPET(sync_ok, 1),
    SNIPPET(sync_queue_ok, 1),
    SNIPPET(sync_s_mte3_bad, 1),
    SNIPPET(sync_war_bad, 1),
    SNIPPET(sync_war_ok, 1),
    SNIPPET(event_deadlock_bad, 1),
    SNIPPET(event_leftover_bad, 1),
    SNIPPET(event_ok, 1),
    SNIPPET(pipe_s_bad, 1),
    SNIPPET(gm_bounds_bad, 1),
    SNIPPET(gm_readonly_bad, 1),
    SNIPPET(dma_params_bad, 1),
    SNIPPET(dma_block_count_bad, 1),
    SNIPPET(cast_mode_bad, 1),
    SNIPPET(select_mode_bad, 1),
    SNIPPET(queue_free_bad, 1),
    SNIPPET(event_queue_collision_bad, 1),
    SNIPPET(event_queue_hang_bad, 1),
    SNIPPET(event_queue_ok, 1),
    SNIPPET(event_pipe_end_bad, 1),
    SNIPPET(event_pool_bad, 1),
    SNIPPET(select_reserved_bad, 1),
    SNIPPET(select_reserved_ok, 1),
    SNIPPET(dma_position_bad, 1),
    SNIPPET(reduce_sum_tree_ok, 1),
    SNIPPET(block_race_bad, 4),
    SNIPPET(auto_sync_bad, 1),
    SNIPPET(auto_sync_ok, 1),
    SNIPPET(kernel_type_undeclared_bad, 4),
    SNIPPET(kernel_type_mix_bad, 4),
    SNIPPET(kernel_type_aiv_ok, 4),
    SNIPPET(block_race_ok, 16),
};
#undef SNIPPET

}  // namespace

namespace dflash::emu {

using SnippetKernel = void (*)(uint8_t* input, uint8_t* output);

bool find_snippet(const std::string& name, uint32_t& blocks, SnippetKernel& kernel) {
  for (const Entry& e : kSnippets) {
    if (name == e.name) {
      blocks = e.blocks;
      kernel = e.kernel;
      return true;
    }
  }
  return false;
}

}  // namespace dflash::emu
