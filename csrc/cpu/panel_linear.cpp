// panel_linear on CPU: y = x @ W^T + bias for a weight stored in column panels.
//
// Why it exists: a decode step multiplies a few rows (1 per sequence, 16 per DFlash block) by
// every weight of the model, so its GEMMs stream weights from memory. torch's float32 GEMM
// (MKL) takes 2.3x as long for 16 rows as for one on this model's shapes, although the weights
// it streams are the same; here each weight element is read once per call and the rows ride
// along. The panel layout (dflash.ops.to_panels: panels[p, k, j] = W[16 p + j, k]) makes the
// inner loop one contiguous 16-float load per k per panel, shared by a block of rows of x.
//
// Precision: float32 math (x converted once, bf16 / fp16 weights widened as they are loaded, so
// they stream at half the bytes), each output one fused multiply-add chain over k in order, plus
// the bias, rounded once to the dtype. A row's result does not depend on the other rows of the
// call nor on the thread split, so the rows of a 16-token verification equal the 1-token decodes
// of the same tokens bit for bit.
#include "cpu/common.h"

namespace dflash::panel_linear {
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

// Threads split the panels; each walks its share in tiles of NP panels and, inside a tile, blocks
// of MR rows of x that share each weight load (NP * MR * kVecs accumulators in registers). Few
// rows want more panels (independent FMA chains), more rows want more rows per weight load.
#if defined(CPU_CAPABILITY_AVX512)
constexpr int kFewRows = 2;  // up to this many rows: 8 panels x 2 rows, else 4 x 4 (16 of 32)
constexpr int kFewNP = 8, kFewMR = 2, kManyNP = 4, kManyMR = 4;
#else
constexpr int kFewRows = 0;  // 2 panels x 2 rows x 2 vectors: 8 of the 16 registers
constexpr int kFewNP = 2, kFewMR = 2, kManyNP = 2, kManyMR = 2;
#endif

// out[m * ldo + c] = sum_k x[m, k] * tile[k, c] for MR rows of x and the NP * kPanel columns of
// the NP panels at `tile` ([k, kPanel] floats each, consecutive).
template <int NP, int MR, typename T>
void multiply_rows(const float* x, int64_t k, const T* tile, float* out, int64_t ldo) {
  constexpr int kAcc = NP * kVecs;
  fVec acc[MR][kAcc];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < kAcc; ++j) acc[m][j] = fVec(0.0f);
  for (int64_t i = 0; i < k; ++i) {
    fVec w[kAcc];
    for (int p = 0; p < NP; ++p)
      for (int j = 0; j < kVecs; ++j)
        w[p * kVecs + j] = load_weights(tile + (p * k + i) * kPanel + j * fVec::size());
    for (int m = 0; m < MR; ++m) {
      const fVec xm(x[m * k + i]);
      for (int j = 0; j < kAcc; ++j) acc[m][j] = at::vec::fmadd(w[j], xm, acc[m][j]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < kAcc; ++j) acc[m][j].store(out + m * ldo + j * fVec::size());
}

// multiply_rows for the last `rest` (< the block's) rows, the row count fixed at compile time.
template <int NP, int MR, typename T>
void multiply_rest(int64_t rest, const float* x, int64_t k, const T* tile, float* out,
                   int64_t ldo) {
  if constexpr (MR > 0) {
    if (rest == MR) {
      multiply_rows<NP, MR>(x, k, tile, out, ldo);
    } else {
      multiply_rest<NP, MR - 1>(rest, x, k, tile, out, ldo);
    }
  }
}

// multiply_rows for all `rows` rows of x, MR at a time, then the remainder.
template <int NP, int MR, typename T>
void multiply_tile(const float* x, int64_t rows, int64_t k, const T* tile, float* out,
                   int64_t ldo) {
  int64_t m = 0;
  for (; m + MR <= rows; m += MR) multiply_rows<NP, MR>(x + m * k, k, tile, out + m * ldo, ldo);
  multiply_rest<NP, MR - 1>(rows - m, x + m * k, k, tile, out + m * ldo, ldo);
}

// multiply_tile for a last tile of np (< NP) panels, np fixed at compile time.
template <int NP, int MR, typename T>
void multiply_partial_tile(int64_t np, const float* x, int64_t rows, int64_t k, const T* tile,
                           float* out, int64_t ldo) {
  if constexpr (NP > 0) {
    if (np == NP) {
      multiply_tile<NP, MR>(x, rows, k, tile, out, ldo);
    } else {
      multiply_partial_tile<NP - 1, MR>(np, x, rows, k, tile, out, ldo);
    }
  }
}

// multiply_tile for np (<= NP) panels.
template <int NP, int MR, typename T>
void multiply_panels(int64_t np, const float* x, int64_t rows, int64_t k, const T* tile,
                     float* out, int64_t ldo) {
  if (np == NP) {
    multiply_tile<NP, MR>(x, rows, k, tile, out, ldo);
  } else {
    multiply_partial_tile<NP - 1, MR>(np, x, rows, k, tile, out, ldo);
  }
}

// out [rows, panels * kPanel] = x (float32 [rows, k]) @ W.T + bias for W in `panels` panels.
template <int NP, int MR, typename T>
void multiply(const float* x, int64_t rows, int64_t k, const T* weight, int64_t panels,
              const std::vector<float>& bias, T* out) {
  constexpr int64_t kCols = NP * kPanel;
  const int64_t n = panels * kPanel;
  const int64_t grain = std::max<int64_t>(1, kMinWorkPerThread / (kPanel * k));
  // threads split the panels evenly (a split by whole tiles would leave one thread a tile more
  // of the model's narrower weights); each walks its share NP panels at a time
  at::parallel_for(0, panels, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> result(rows * kCols);
    for (int64_t first = begin; first < end; first += NP) {
      const int64_t np = std::min<int64_t>(NP, end - first);
      const T* tile = weight + first * kPanel * k;
      multiply_panels<NP, MR>(np, x, rows, k, tile, result.data(), kCols);
      const int64_t cols = np * kPanel, col0 = first * kPanel;
      for (int64_t m = 0; m < rows; ++m) {
        float* r = result.data() + m * kCols;
        if (!bias.empty())
          at::vec::map2([](fVec a, fVec c) { return a + c; }, r, r, bias.data() + col0, cols);
        at::vec::convert(r, out + m * n + col0, cols);
      }
    }
  });
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
  DFLASH_DISPATCH_FLOATS(x.scalar_type(), "panel_linear", [&] {
    constexpr bool kIsFloat = std::is_same_v<scalar_t, float>;
    std::vector<float> x_scratch(kIsFloat ? 0 : rows * k);
    const float* xf = as_float(xc.const_data_ptr<scalar_t>(), x_scratch.data(), rows * k);
    const scalar_t* wp = wc.const_data_ptr<scalar_t>();
    scalar_t* op = out.mutable_data_ptr<scalar_t>();
    if (rows <= kFewRows) {
      multiply<kFewNP, kFewMR>(xf, rows, k, wp, panels, b, op);
    } else {
      multiply<kManyNP, kManyMR>(xf, rows, k, wp, panels, b, op);
    }
  });
  return out;
}

}  // namespace
}  // namespace dflash::panel_linear

TORCH_LIBRARY_IMPL(dflash, CPU, m) {
  m.impl("panel_linear", &dflash::panel_linear::panel_linear);
}
