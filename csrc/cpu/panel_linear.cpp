// panel_linear on CPU: y = x @ W^T + bias for a weight stored in column panels.
//
// Why it exists: a decode step multiplies a few rows (1 per sequence, 16 per DFlash block) by
// every weight of the model, so its GEMMs stream weights from memory. torch's float32 GEMM
// (MKL) takes 2.3x as long for 16 rows as for one on this model's shapes, although the weights
// it streams are the same; here each weight element is read once per call and the rows ride
// along. The panel layout (dflash.ops.to_panels: panels[p, k, j] = W[16 p + j, k]) makes the
// inner loop one contiguous 16-float load per k per panel, shared by a block of rows of x.
//
// Pair panels (dflash.ops.to_pair_panels, bfloat16 only: pairs[p, i, j, t] = W[16 p + j, 2 i + t])
// hold each column's weights k and k + 1 side by side, the operand order of AVX512-BF16's
// VDPBF16PS, which multiplies 16 pairs of bf16 weights by a pair of bf16 inputs and adds both
// products (exact in float32) to 16 float32 sums: per weight element one instruction per row
// where the column layout needs a widening load and an FMA. On CPUs without that instruction
// (and in the AVX2 / scalar builds) the same layout runs as two FMAs per pair in the order the
// instruction is documented to add them (k + 1, then k; the instruction also flushes float32
// subnormals). Whether a CPU's instruction rounds exactly so is not relied on: what decoding needs
// is that each row goes through the same instructions however many rows a call has.
//
// Precision: float32 math (x converted once, bf16 / fp16 weights widened as they are loaded, so
// they stream at half the bytes), each output one fused multiply-add chain over k in order, plus
// the bias, rounded once to the dtype. A row's result does not depend on the other rows of the
// call nor on the thread split, so the rows of a 16-token verification equal the 1-token decodes
// of the same tokens bit for bit.
#include "cpu/common.h"

namespace dflash::cpu::panel_linear {
namespace {

using fVec = at::vec::Vectorized<float>;
constexpr int64_t kPanel = 16;                // output columns per panel (the layout's width)
constexpr int kVecs = kPanel / fVec::size();  // vectors per panel row
static_assert(kPanel % fVec::size() == 0, "a panel row must be whole vectors");

// fVec::size() weights at `p` as float32: a plain load, or for bf16 / fp16 a widening one (the
// exact float32 values of the 16-bit ones).
template <typename T>
inline fVec load_weights(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return fVec::loadu(p);
  } else {
#if defined(CPU_CAPABILITY_AVX512)
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    if constexpr (std::is_same_v<T, at::BFloat16>) {
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    } else {
      return _mm512_cvtph_ps(h);
    }
#elif defined(CPU_CAPABILITY_AVX2)
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    if constexpr (std::is_same_v<T, at::BFloat16>) {
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    } else {
      return _mm256_cvtph_ps(h);
    }
#else
    float wide[fVec::size()];
    for (int j = 0; j < fVec::size(); ++j) wide[j] = static_cast<float>(p[j]);
    return fVec::loadu(wide);
#endif
  }
}

// fVec::size() 32-bit lanes of weight pairs at `q` as float32: the first weight of each pair (the
// low half) and the second (the high half), both exact.
inline std::pair<fVec, fVec> split_pairs(const uint32_t* q) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512i v = _mm512_loadu_si512(q);
  return {_mm512_castsi512_ps(_mm512_slli_epi32(v, 16)),
          _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(0xffff0000u)))};
#elif defined(CPU_CAPABILITY_AVX2)
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
  return {_mm256_castsi256_ps(_mm256_slli_epi32(v, 16)),
          _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(0xffff0000u)))};
#else
  float lo[fVec::size()], hi[fVec::size()];
  for (int j = 0; j < fVec::size(); ++j) {
    const uint32_t first = q[j] << 16, second = q[j] & 0xffff0000u;
    std::memcpy(lo + j, &first, sizeof(float));
    std::memcpy(hi + j, &second, sizeof(float));
  }
  return {fVec::loadu(lo), fVec::loadu(hi)};
#endif
}

// Threads split the panels; each walks its share in tiles of NP panels and, inside a tile, blocks
// of MR rows of x that share each weight load (NP * MR * kVecs accumulators in registers). Few
// rows want more panels (independent FMA chains), more rows want more rows per weight load.
#if defined(CPU_CAPABILITY_AVX512)
constexpr int kFewRows = 2;  // up to this many rows: 8 panels x 2 rows, else 4 x 4 (16 of 32)
constexpr int kFewNP = 8, kFewMR = 2, kManyNP = 4, kManyMR = 4;
// the dot path loads one vector per panel and pair, not two: room for 4 x 6 accumulators
constexpr int kDotNP = 4, kDotMR = 6;
#elif defined(CPU_CAPABILITY_AVX2)
// up to 2 rows: 2 panels x 2 rows x 2 vectors (8 of the 16 registers), else 1 panel x 5 rows
// (10, with the panel's 2 widened weight vectors and a row's broadcast: 13): 3-5 rows then cost
// little more than one, where 2-row blocks widened every weight again for each pair of rows
constexpr int kFewRows = 2;
constexpr int kFewNP = 2, kFewMR = 2, kManyNP = 1, kManyMR = 5;
#else
constexpr int kFewRows = 0;  // 2 panels x 2 rows x 2 vectors: 8 of the 16 registers
constexpr int kFewNP = 2, kFewMR = 2, kManyNP = 2, kManyMR = 2;
#endif

// out[m * ldo + c] = sum_k x[m, k] * tile[k, c] for MR rows of x and the NP * kPanel columns of
// the NP panels at `tile` ([k, kPanel] floats each, consecutive).
template <int NP, int MR, typename T>
void multiply_rows(const float* x, int64_t k, const T* tile, float* out, int64_t ldo,
                   int64_t ahead) {
  constexpr int kAcc = NP * kVecs;
  fVec acc[MR][kAcc];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < kAcc; ++j) acc[m][j] = fVec(0.0f);
  for (int64_t i = 0; i < k; ++i) {
    fVec w[kAcc];
    for (int p = 0; p < NP; ++p) {
      if (ahead != 0) prefetch_to_l2(tile + (p * k + i) * kPanel, ahead);
      for (int j = 0; j < kVecs; ++j)
        w[p * kVecs + j] = load_weights(tile + (p * k + i) * kPanel + j * fVec::size());
    }
    for (int m = 0; m < MR; ++m) {
      const fVec xm(x[m * k + i]);
      for (int j = 0; j < kAcc; ++j) acc[m][j] = at::vec::fmadd(w[j], xm, acc[m][j]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < kAcc; ++j) acc[m][j].store(out + m * ldo + j * fVec::size());
}

// The pair layout in float32 math: a vector of 16 pairs (32 bf16) splits into the weights of k
// (low halves) and of k + 1 (high halves), each as exact float32.
template <int NP, int MR>
void multiply_pair_rows(const float* x, int64_t k, const at::BFloat16* tile, float* out,
                        int64_t ldo, int64_t ahead) {
  constexpr int kAcc = NP * kVecs;
  fVec acc[MR][kAcc];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < kAcc; ++j) acc[m][j] = fVec(0.0f);
  for (int64_t i = 0; i < k; i += 2) {
    fVec lo[kAcc], hi[kAcc];
    for (int p = 0; p < NP; ++p) {
      if (ahead != 0) prefetch_to_l2(tile + (p * k + i) * kPanel, ahead);
      for (int j = 0; j < kVecs; ++j) {
        // fVec::size() pairs: 32-bit lanes holding (W[., i], W[., i + 1])
        const auto* q =
            reinterpret_cast<const uint32_t*>(tile + (p * k + i) * kPanel) + j * fVec::size();
        std::tie(lo[p * kVecs + j], hi[p * kVecs + j]) = split_pairs(q);
      }
    }
    for (int m = 0; m < MR; ++m) {
      const fVec x0(x[m * k + i]), x1(x[m * k + i + 1]);
      for (int j = 0; j < kAcc; ++j) {
        acc[m][j] = at::vec::fmadd(hi[j], x1, acc[m][j]);
        acc[m][j] = at::vec::fmadd(lo[j], x0, acc[m][j]);
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < kAcc; ++j) acc[m][j].store(out + m * ldo + j * fVec::size());
}

#if defined(CPU_CAPABILITY_AVX512)
// The pair layout through VDPBF16PS: x in bfloat16, each 32-bit pair (x[i], x[i + 1])
// broadcast to all lanes.
template <int NP, int MR>
__attribute__((target("avx512bf16"))) void dot_pair_rows(const at::BFloat16* x, int64_t k,
                                                         const at::BFloat16* tile, float* out,
                                                         int64_t ldo, int64_t ahead) {
  __m512 acc[MR][NP];
  for (int m = 0; m < MR; ++m)
    for (int p = 0; p < NP; ++p) acc[m][p] = _mm512_setzero_ps();
  for (int64_t i = 0; i < k; i += 2) {
    __m512bh w[NP];
    for (int p = 0; p < NP; ++p) {
      if (ahead != 0) prefetch_to_l2(tile + (p * k + i) * kPanel, ahead);
      w[p] = (__m512bh)_mm512_loadu_si512(tile + (p * k + i) * kPanel);
    }
    for (int m = 0; m < MR; ++m) {
      int32_t pair;
      std::memcpy(&pair, x + m * k + i, sizeof(pair));
      const __m512bh xm = (__m512bh)_mm512_set1_epi32(pair);
      for (int p = 0; p < NP; ++p) acc[m][p] = _mm512_dpbf16_ps(acc[m][p], w[p], xm);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int p = 0; p < NP; ++p) _mm512_storeu_ps(out + m * ldo + p * kPanel, acc[m][p]);
}
#endif

// How MR rows of x (X: float32, or raw bfloat16 for the dot path) multiply NP panels of a tile.
enum class Path { kColumns, kPairs, kPairDots };

template <Path P, int NP, int MR, typename X, typename T>
void multiply_block(const X* x, int64_t k, const T* tile, float* out, int64_t ldo, int64_t ahead) {
  if constexpr (P == Path::kColumns) {
    multiply_rows<NP, MR>(x, k, tile, out, ldo, ahead);
  } else if constexpr (P == Path::kPairs) {
    multiply_pair_rows<NP, MR>(x, k, tile, out, ldo, ahead);
  } else {
#if defined(CPU_CAPABILITY_AVX512)
    dot_pair_rows<NP, MR>(x, k, tile, out, ldo, ahead);
#endif
  }
}

// multiply_rows for the last `rest` (< the block's) rows, the row count fixed at compile time.
template <Path P, int NP, int MR, typename X, typename T>
void multiply_rest(int64_t rest, const X* x, int64_t k, const T* tile, float* out, int64_t ldo,
                   int64_t ahead) {
  if constexpr (MR > 0) {
    if (rest == MR) {
      multiply_block<P, NP, MR>(x, k, tile, out, ldo, ahead);
    } else {
      multiply_rest<P, NP, MR - 1>(rest, x, k, tile, out, ldo, ahead);
    }
  }
}

// multiply_rows for all `rows` rows of x, MR at a time, then the remainder.
template <Path P, int NP, int MR, typename X, typename T>
void multiply_tile(const X* x, int64_t rows, int64_t k, const T* tile, float* out, int64_t ldo,
                   int64_t ahead) {
  int64_t m = 0;
  for (; m + MR <= rows; m += MR)
    multiply_block<P, NP, MR>(x + m * k, k, tile, out + m * ldo, ldo, ahead);
  multiply_rest<P, NP, MR - 1>(rows - m, x + m * k, k, tile, out + m * ldo, ldo, ahead);
}

// multiply_tile for a last tile of np (< NP) panels, np fixed at compile time.
template <Path P, int NP, int MR, typename X, typename T>
void multiply_partial_tile(int64_t np, const X* x, int64_t rows, int64_t k, const T* tile,
                           float* out, int64_t ldo, int64_t ahead) {
  if constexpr (NP > 0) {
    if (np == NP) {
      multiply_tile<P, NP, MR>(x, rows, k, tile, out, ldo, ahead);
    } else {
      multiply_partial_tile<P, NP - 1, MR>(np, x, rows, k, tile, out, ldo, ahead);
    }
  }
}

// multiply_tile for np (<= NP) panels.
template <Path P, int NP, int MR, typename X, typename T>
void multiply_panels(int64_t np, const X* x, int64_t rows, int64_t k, const T* tile, float* out,
                     int64_t ldo, int64_t ahead) {
  if (np == NP) {
    multiply_tile<P, NP, MR>(x, rows, k, tile, out, ldo, ahead);
  } else {
    multiply_partial_tile<P, NP - 1, MR>(np, x, rows, k, tile, out, ldo, ahead);
  }
}

// out [rows, panels * kPanel] = x ([rows, k]) @ W.T + bias for W in `panels` panels.
template <Path P, int NP, int MR, typename X, typename T>
void multiply(const X* x, int64_t rows, int64_t k, const T* weight, int64_t panels,
              const std::vector<float>& bias, T* out) {
  constexpr int64_t kCols = NP * kPanel;
  const int64_t n = panels * kPanel;
  const int64_t grain = std::max<int64_t>(1, kMinWorkPerThread / (kPanel * k));
  // A call of several rows asks for the next tile while it multiplies this one (prefetch_to_l2);
  // at 1-2 rows, which stream the weight once, bf16 measured about 25% slower with it.
  const int64_t ahead = rows > 2 ? NP * k * kPanel * static_cast<int64_t>(sizeof(T)) : 0;
  // threads split the panels evenly (a split by whole tiles would leave one thread a tile more
  // of the model's narrower weights); each walks its share NP panels at a time
  at::parallel_for(0, panels, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> result(rows * kCols);
    for (int64_t first = begin; first < end; first += NP) {
      const int64_t np = std::min<int64_t>(NP, end - first);
      const T* tile = weight + first * kPanel * k;
      multiply_panels<P, NP, MR>(np, x, rows, k, tile, result.data(), kCols, ahead);
      store_columns(result.data(), rows, kCols, np * kPanel, bias, first * kPanel, out, n);
    }
  });
}

// multiply with the tile shape for the row count.
template <Path P, typename X, typename T>
void multiply_any(const X* x, int64_t rows, int64_t k, const T* weight, int64_t panels,
                  const std::vector<float>& bias, T* out) {
  if (rows <= kFewRows) {
    multiply<P, kFewNP, kFewMR>(x, rows, k, weight, panels, bias, out);
  } else if constexpr (P == Path::kPairDots) {
#if defined(CPU_CAPABILITY_AVX512)
    multiply<P, kDotNP, kDotMR>(x, rows, k, weight, panels, bias, out);
#endif
  } else {
    multiply<P, kManyNP, kManyMR>(x, rows, k, weight, panels, bias, out);
  }
}

at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& weight,
                        const std::optional<at::Tensor>& bias) {
  checks::panel_linear_meta(x, weight, bias);
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  const int64_t k = xc.size(-1), rows = xc.numel() / k, panels = wc.size(0);
  std::vector<int64_t> shape = xc.sizes().vec();
  shape.back() = panels * kPanel;
  at::Tensor out = at::empty(shape, xc.options());
  const std::vector<float> b = bias ? float_values(*bias) : std::vector<float>();
  if (wc.dim() == 4) {  // pair panels: bfloat16 (checked)
    const auto* xb = xc.const_data_ptr<at::BFloat16>();
    const auto* wp = wc.const_data_ptr<at::BFloat16>();
    auto* op = out.mutable_data_ptr<at::BFloat16>();
    if (has_bf16_dot_products()) {
      multiply_any<Path::kPairDots>(xb, rows, k, wp, panels, b, op);
    } else {
      std::vector<float> xf(rows * k);
      load_row(xb, xf.data(), rows * k);
      multiply_any<Path::kPairs>(xf.data(), rows, k, wp, panels, b, op);
    }
    return out;
  }
  DFLASH_DISPATCH_FLOATS(x.scalar_type(), "panel_linear", [&] {
    constexpr bool kIsFloat = std::is_same_v<scalar_t, float>;
    std::vector<float> x_scratch(kIsFloat ? 0 : rows * k);
    const float* xf = as_float(xc.const_data_ptr<scalar_t>(), x_scratch.data(), rows * k);
    multiply_any<Path::kColumns>(xf, rows, k, wc.const_data_ptr<scalar_t>(), panels, b,
                                 out.mutable_data_ptr<scalar_t>());
  });
  return out;
}

}  // namespace
}  // namespace dflash::cpu::panel_linear

TORCH_LIBRARY_IMPL(dflash, CPU, m) {
  m.impl("panel_linear", &dflash::cpu::panel_linear::panel_linear);
}
