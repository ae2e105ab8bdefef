// panel_linear on CPU: y = x @ W^T + bias for a weight stored in column panels.
//
// Why it exists: a decode step multiplies a few rows (1 per sequence, 16 per DFlash block) by
// every weight of the model, so its GEMMs stream weights from memory. torch's float32 GEMM
// (MKL) takes 2.4x as long for 16 rows as for one on this model's shapes, although the weights
// it streams are the same; here each weight element is read once per call and the rows ride
// along. The panel layout (dflash.ops.to_panels: panels[p, k, j] = W[16 p + j, k]) makes the
// inner loop one contiguous 16-float load per k, shared by up to kRows rows of x.
//
// Precision: float32 math (x and W converted once), each output one fused multiply-add chain
// over k in order, plus the bias, rounded once to the dtype. A row's result does not depend on
// the other rows of the call nor on the thread split, so the rows of a 16-token verification
// equal the 1-token decodes of the same tokens bit for bit.
#include "cpu/common.h"

namespace dflash::panel_linear {
namespace {

using fVec = at::vec::Vectorized<float>;
constexpr int64_t kPanel = 16;                // output columns per panel (the layout's width)
constexpr int kVecs = kPanel / fVec::size();  // vectors per panel row
constexpr int kPanelsPerTile = 2;             // two panels: independent FMA chains at one row
constexpr int64_t kTileCols = kPanelsPerTile * kPanel;
#if defined(CPU_CAPABILITY_AVX512)
constexpr int kRows = 8;  // 8 rows x 2 panels: 16 accumulators of the 32 vector registers
#else
constexpr int kRows = 2;  // 2 rows x 2 panels x 2 vectors: 8 of the 16
#endif

// out[m * kTileCols + c] = sum_k x[m, k] * tile[k, c] for MR rows of x and the tile's
// NP * kPanel columns; `tile` holds NP panels of [k, kPanel] floats, `panel_stride` apart.
template <int MR, int NP>
void multiply_rows(const float* x, int64_t k, const float* tile, int64_t panel_stride,
                   float* out) {
  constexpr int kAcc = NP * kVecs;
  fVec acc[MR][kAcc];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < kAcc; ++j) acc[m][j] = fVec(0.0f);
  for (int64_t i = 0; i < k; ++i) {
    fVec w[kAcc];
    for (int p = 0; p < NP; ++p)
      for (int j = 0; j < kVecs; ++j)
        w[p * kVecs + j] = fVec::loadu(tile + p * panel_stride + i * kPanel + j * fVec::size());
    for (int m = 0; m < MR; ++m) {
      const fVec xm(x[m * k + i]);
      for (int j = 0; j < kAcc; ++j) acc[m][j] = at::vec::fmadd(w[j], xm, acc[m][j]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < kAcc; ++j) acc[m][j].store(out + m * kTileCols + j * fVec::size());
}

// multiply_rows for the last `rest` (< kRows) rows, with the row count fixed at compile time.
template <int MR, int NP>
void multiply_rest(int64_t rest, const float* x, int64_t k, const float* tile,
                   int64_t panel_stride, float* out) {
  if constexpr (MR > 0) {
    if (rest == MR) {
      multiply_rows<MR, NP>(x, k, tile, panel_stride, out);
    } else {
      multiply_rest<MR - 1, NP>(rest, x, k, tile, panel_stride, out);
    }
  }
}

// multiply_rows for all `rows` rows of x, kRows at a time, then the remainder.
template <int NP>
void multiply_tile(const float* x, int64_t rows, int64_t k, const float* tile,
                   int64_t panel_stride, float* out) {
  int64_t m = 0;
  for (; m + kRows <= rows; m += kRows)
    multiply_rows<kRows, NP>(x + m * k, k, tile, panel_stride, out + m * kTileCols);
  multiply_rest<kRows - 1, NP>(rows - m, x + m * k, k, tile, panel_stride, out + m * kTileCols);
}

at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& weight,
                        const std::optional<at::Tensor>& bias) {
  checks::panel_linear_meta(x, weight, bias);
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  const int64_t k = xc.size(-1), rows = xc.numel() / k, panels = wc.size(0);
  const int64_t n = panels * kPanel;
  std::vector<int64_t> shape = xc.sizes().vec();
  shape.back() = n;
  at::Tensor out = at::empty(shape, xc.options());
  const std::vector<float> b = bias ? float_values(*bias) : std::vector<float>();
  const int64_t tiles = (panels + kPanelsPerTile - 1) / kPanelsPerTile;
  DFLASH_DISPATCH_FLOATS(x.scalar_type(), "panel_linear", [&] {
    // float32 copies of x and of each weight tile (none for float32 itself)
    constexpr bool kIsFloat = std::is_same_v<scalar_t, float>;
    const scalar_t* wp = wc.const_data_ptr<scalar_t>();
    scalar_t* op = out.mutable_data_ptr<scalar_t>();
    std::vector<float> x_scratch(kIsFloat ? 0 : rows * k);
    const float* xf = as_float(xc.const_data_ptr<scalar_t>(), x_scratch.data(), rows * k);
    const int64_t tile_elems = kTileCols * k;
    const int64_t grain = std::max<int64_t>(1, kMinWorkPerThread / tile_elems);
    at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
      std::vector<float> result(rows * kTileCols);
      std::vector<float> tile_scratch(kIsFloat ? 0 : tile_elems);
      for (int64_t t = begin; t < end; ++t) {
        const int64_t first = t * kPanelsPerTile;
        const int64_t np = std::min<int64_t>(kPanelsPerTile, panels - first);
        const float* tf = as_float(wp + first * kPanel * k, tile_scratch.data(), np * kPanel * k);
        if (np == kPanelsPerTile) {
          multiply_tile<kPanelsPerTile>(xf, rows, k, tf, kPanel * k, result.data());
        } else {
          multiply_tile<1>(xf, rows, k, tf, kPanel * k, result.data());
        }
        const int64_t cols = np * kPanel, col0 = first * kPanel;
        for (int64_t m = 0; m < rows; ++m) {
          float* r = result.data() + m * kTileCols;
          if (!b.empty())
            at::vec::map2([](fVec a, fVec c) { return a + c; }, r, r, b.data() + col0, cols);
          at::vec::convert(r, op + m * n + col0, cols);
        }
      }
    });
  });
  return out;
}

}  // namespace
}  // namespace dflash::panel_linear

TORCH_LIBRARY_IMPL(dflash, CPU, m) {
  m.impl("panel_linear", &dflash::panel_linear::panel_linear);
}
