// CPU kernel for dflash::paged_attention (docs/design.md 3.2): flash-style attention of each sequence's new
// tokens over its paged context plus the new tokens, causal or not, from one code path.
//
// Work item = (sequence, kv head, tile of query rows), its keys cut into chunks of kKeyChunk when
// there are more (Split: a sequence alone keeps every thread busy). All query heads of the kv
// head's GQA group are processed together as the rows of one [m = rows * group, D] float32
// matrix, so every K/V row is read (and converted to float32) once per item. Keys stream through
// in tiles of kKeyTile, and each block of rows of that matrix goes through
//   scores S = Q K^T (register-blocked micro-kernel over a transposed float32 K tile; for bf16
//     inputs on a CPU with AVX512-BF16, over a tile of bf16 dim pairs, see score_pairs),
//   online softmax in float32 (a per-row reference point and partial sums, see softmax_row),
//   O += P V (register-blocked micro-kernel over the float32 V tile).
// Inputs are converted to float32 on load (the pair path multiplies bf16 pairs exactly instead),
// everything accumulates in float32, and the output is rounded once to the input dtype.
// bf16 / fp16 draft blocks and long prompts (see uses_matrix_engine) run both products on the
// CPU's matrix engine instead (AMX on Sapphire Rapids, through ATen's brgemm; see
// run_item_matrix).
// Causal items stop at the last key their last row can see; only the tiles that cross the
// diagonal are masked. Items are handed out dynamically, largest first, so ragged batches and
// causal prefill tiles balance over the threads.
#include "cpu/common.h"
#include "out_variants.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstring>
#include <deque>
#include <string>
#include <limits>
#include <type_traits>
#include <vector>

#include <ATen/cpu/vec/functional.h>
#include <ATen/native/CPUBlas.h>

namespace dflash::cpu::paged_attention {
namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kV = Vec::size();
// Vector registers: 32 with AVX-512, 16 with AVX2 (and the scalar build, where it hardly matters).
constexpr int kRegisters = kV == 16 ? 32 : 16;
constexpr int kAcc = kRegisters * 3 / 4;  // accumulators a micro-kernel may hold
// Score micro-kernel: kScoreRows query rows x kScoreVecs vectors of keys.
constexpr int kScoreVecs = 2;
constexpr int kScoreRows = kAcc / kScoreVecs;
// Keys per tile: the float32 K and V tiles (2 x 16 KiB at D = 128) stay in L1 next to the Q, S
// and O rows of one row block (64 measured no faster).
constexpr int64_t kKeyTile = 32;
static_assert(kKeyTile % (kScoreVecs * kV) == 0);
// Query vectors per work item: enough rows to amortize converting each K/V tile to float32 (long
// prompts: 128 measured 15% faster than 64; the draft's 16 x group rows fit in one item anyway).
constexpr int64_t kQueryVectors = 128;
// Matrix rows (query tokens x GQA group) a non-causal item needs to take the matrix path: from 16
// rows (one AMX tile) on, a DFlash block runs about 2x faster there (one thread, bf16, 2048 keys),
// while items of 1-3 rows measured 10-60% slower.
constexpr int64_t kMatrixRows = 16;
// Causal items need this many query tokens instead (prefill). The vector path computes each row
// the same way however many rows share its item, so a 16-token verification reproduces 1-token
// decoding bit for bit and DFlash output equals target-only output in bf16 as in float32; the
// matrix path's rounding depends on the item's shape.
constexpr int64_t kMatrixCausalTokens = 32;
// Keys per matrix-path tile: large, so each brgemm call (a kernel lookup and a tile configuration)
// does enough work.
constexpr int64_t kMatrixKeys = 256;
// Multiply-adds of QK^T (context x query rows x head_dim) below which a call runs on the calling
// thread (one kv head of a decode step over ~100 cached tokens).
constexpr int64_t kMinAttentionWork = 1 << 16;
// Keys per chunk of a split item (Split): a multiple of kKeyTile, so chunks keep the tiles an
// unsplit item would have.
constexpr int64_t kKeyChunk = 256;
static_assert(kKeyChunk % kKeyTile == 0);
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kRescale = 8.f;  // see softmax_row
constexpr int kAllLanes = (1 << kV) - 1;

int64_t round_up(int64_t x, int64_t to) {
  return (x + to - 1) / to * to;
}

template <int N>
using Int = std::integral_constant<int, N>;

// f(Int<R>{}, first_row) over rows [0, rows) in blocks of R; the remainder with smaller blocks, so
// every block size is a compile-time constant and its accumulators stay in registers.
template <int R, typename F>
void for_row_blocks(int64_t rows, F&& f, int64_t first = 0) {
  for (; first + R <= rows; first += R) f(Int<R>{}, first);
  if constexpr (R > 1) {
    if (first < rows) for_row_blocks<R - 1>(rows, f, first);
  }
}

// Asks for row[0:n] in L2 (common.h). A decode step's K/V come from memory (the layers' weights
// stream through the caches between two attention calls), and a key tile is 128 lines at D = 64:
// into L1, whose few miss buffers they fill, the prefetches of the next tile stalled the loads of
// this one (the attention of a SmolLM2 Q8_0 decode step at 256 cached tokens measured 1.14 ms
// with them, 0.65 ms with L2's).
template <typename T>
void prefetch_row(const T* row, int64_t n) {
  for (int64_t off = 0; off < n * static_cast<int64_t>(sizeof(T)); off += 64)
    prefetch_to_l2(row, off);
}

template <typename T>
void to_float(const T* src, float* dst, int64_t n, float scale = 1.f) {
  int64_t i = 0;
  if constexpr (std::is_same_v<T, float>) {
    for (; i + kV <= n; i += kV) (Vec::loadu(src + i) * Vec(scale)).store(dst + i);
  } else {
    for (; i + kV <= n; i += kV) {
      Vec x;
      at::vec::load_to_float(src + i, x);
      (x * Vec(scale)).store(dst + i);
    }
  }
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]) * scale;
}

// s[R][kKeyTile] = q[R][d] . kt[d][kKeyTile] for the columns [0, cols).
template <int R>
void score_block(const float* q, int64_t ldq, const float* kt, int64_t d, int64_t cols, float* s) {
  for (int64_t c = 0; c < cols; c += kScoreVecs * kV) {
    Vec acc[R][kScoreVecs];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < kScoreVecs; ++v) acc[r][v] = Vec(0.f);
    for (int64_t i = 0; i < d; ++i) {
      Vec k[kScoreVecs];
      for (int v = 0; v < kScoreVecs; ++v) k[v] = Vec::loadu(kt + i * kKeyTile + c + v * kV);
      for (int r = 0; r < R; ++r) {
        const Vec qb(q[r * ldq + i]);
        for (int v = 0; v < kScoreVecs; ++v) acc[r][v] = at::vec::fmadd(qb, k[v], acc[r][v]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < kScoreVecs; ++v) acc[r][v].store(s + r * kKeyTile + c + v * kV);
  }
}

// o[R][W vectors] += p[R][keys] . v[keys][W vectors].
template <int R, int W>
void pv_block(const float* p, const float* v, int64_t ldv, int64_t keys, float* o, int64_t ldo) {
  Vec acc[R][W];
  for (int r = 0; r < R; ++r)
    for (int w = 0; w < W; ++w) acc[r][w] = Vec::loadu(o + r * ldo + w * kV);
  for (int64_t k = 0; k < keys; ++k) {
    Vec pb[R];
    for (int r = 0; r < R; ++r) pb[r] = Vec(p[r * kKeyTile + k]);
    for (int w = 0; w < W; ++w) {
      const Vec x = Vec::loadu(v + k * ldv + w * kV);
      for (int r = 0; r < R; ++r) acc[r][w] = at::vec::fmadd(pb[r], x, acc[r][w]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int w = 0; w < W; ++w) acc[r][w].store(o + r * ldo + w * kV);
}

// Rows per P.V block of W vectors: R * W accumulators, R broadcasts of P and one V vector must
// fit the registers. (W = 8 with 3 rows fits too but measured at half the speed of W = 4.)
constexpr int pv_rows(int w) {
  return std::min(8, (kRegisters - 1) / (w + 1));
}

// o[rows][ldo] += p[rows][keys] . v[keys][ldo]; ldo is a multiple of kV.
void pv(const float* p, const float* v, int64_t keys, float* o, int64_t rows, int64_t ldo) {
  int64_t col = 0;
  auto columns = [&](auto width) {
    constexpr int W = decltype(width)::value;
    for (; col + W * kV <= ldo; col += W * kV) {
      for_row_blocks<pv_rows(W)>(rows, [&](auto r, int64_t row) {
        pv_block<decltype(r)::value, W>(p + row * kKeyTile, v + col, ldo, keys, o + row * ldo + col,
                                        ldo);
      });
    }
  };
  columns(Int<4>{});
  columns(Int<2>{});
  columns(Int<1>{});
}

// Online softmax of one row of a key tile: s[0, visible) holds scores and becomes P = exp(s - ref)
// (zero beyond `visible`, up to `cols`). The reference point `ref` only moves, rescaling the row's
// output `o` and its kV partial sums, when a score exceeds it by kRescale: softmax is
// shift-invariant, P stays below e^kRescale, and most tiles need no horizontal reduction.
void softmax_row(float* s, int64_t visible, int64_t cols, float& ref, float* sum, float* o,
                 int64_t ldo) {
  if (visible <= 0) {  // a causal row that sees none of this tile
    std::fill(s, s + cols, 0.f);
    return;
  }
  std::fill(s + visible, s + cols, kNegInf);
  Vec vmax(kNegInf);
  for (int64_t k = 0; k < cols; k += kV) vmax = at::vec::maximum(vmax, Vec::loadu(s + k));
  if ((vmax > Vec(ref + kRescale)).zero_mask() != kAllLanes) {  // ref is -inf on the first tile
    const float new_ref =
        at::vec::vec_reduce_all<float>([](Vec x, Vec y) { return at::vec::maximum(x, y); }, vmax);
    const Vec alpha(std::exp(ref - new_ref));
    for (int64_t c = 0; c < ldo; c += kV) (Vec::loadu(o + c) * alpha).store(o + c);
    (Vec::loadu(sum) * alpha).store(sum);
    ref = new_ref;
  }
  Vec vsum = Vec::loadu(sum);
  for (int64_t k = 0; k < cols; k += kV) {
    const Vec e = (Vec::loadu(s + k) - Vec(ref)).exp_u20();
    e.store(s + k);
    vsum = vsum + e;
  }
  vsum.store(sum);
}

template <typename T>
struct Args {
  const T *query, *key, *value, *key_cache, *value_cache;
  T* out;
  const int32_t *block_table, *context_lens, *cu;
  const uint8_t* tree_mask;  // [Tq, mask_width] bits, or null (docs/design.md 3.2)
  const uint8_t* chain;      // per sequence with a tree mask: whether its tree is a chain
  int64_t mask_width;
  int64_t head_dim, padded_dim, group, hkv, max_blocks, block_size;
  int64_t kc_stride[3], vc_stride[3];  // block, slot, head (the last dim is contiguous)
  float scale;
  bool causal;
  bool pair_dots;  // Q.K through VDPBF16PS (bf16 inputs, even head_dim; score_pairs)
};

struct Split;

struct Item {
  int64_t seq, head, row_begin, row_end, cost;
  // The keys the item covers, [key_begin, key_end) clipped to the ones its rows can see. An item
  // of a split (below) covers one chunk of them and leaves its accumulators in the split's parts.
  int64_t key_begin = 0, key_end = std::numeric_limits<int64_t>::max();
  Split* split = nullptr;
  int64_t part = 0;  // which chunk of its split
};

// The rows of a (sequence, kv head, tile of query rows) whose keys are cut into chunks of
// kKeyChunk, one item each, so that a call with fewer items than threads (one sequence: as many
// items as kv heads) keeps every thread busy. Each chunk's online softmax runs on its own; the
// item that finishes last merges the chunks' accumulators in chunk order. Chunks start at fixed
// key indices whatever the call's shape, so a row is computed the same way whatever rows,
// sequences or threads share the call (a verification's rows still equal one-token decodes bit
// for bit).
struct Split {
  Item whole;
  std::vector<float> parts;  // per chunk: o [m, dp], row_ref [m], row_sum [m, kV]
  std::atomic<int64_t> left;
};

// Whether transpose_keys goes through converted key rows (k) rather than registers.
#if defined(CPU_CAPABILITY_AVX512)
constexpr bool kConvertedKeyRows = false;
#else
constexpr bool kConvertedKeyRows = true;
#endif

// Per-thread scratch for one work item: float32 for the vector path, and for the matrix path the
// query rows, P and the K / V tiles in the input dtype (the tiles in brgemm's VNNI layout, as
// 32-bit pairs of 16-bit values).
struct Scratch {
  std::vector<float> q, o, s, k, kt, v, row_ref, row_sum;  // row_sum: kV partial sums per row
  std::vector<uint32_t> q_pairs;  // the pair path's query rows: [m][d / 2] pairs of bf16
  // The matrix path's buffers, allocated only when an item of the call takes that path.
  std::vector<uint16_t> q16, p16;
  std::vector<uint32_t> kt_pairs, v_pairs;  // kt_pairs: the pair path's K tile too
  std::vector<uint16_t> stage;              // K or V rows of one matrix-path tile, gathered
  bool used_matrix_engine = false;
  // m: the most rows (query tokens x group) an item of the call has. A decode call gets buffers
  // of a few KB: zero-filling buffers for the largest possible item cost more than its attention.
  Scratch(int64_t m, int64_t d, int64_t dp, bool matrix, bool pairs)
      : q(m * d),
        o(m * dp),
        s(m * (matrix ? kMatrixKeys : kKeyTile)),
        k(kConvertedKeyRows ? kKeyTile * dp : 0),
        kt(d * kKeyTile),
        v(kKeyTile * dp),
        row_ref(m),
        row_sum(m * kV),
        q_pairs(pairs ? m * d / 2 : 0),
        kt_pairs(pairs ? d / 2 * kKeyTile : 0) {
    if (matrix) {
      q16.resize(m * d);
      p16.resize(2 * m * kMatrixKeys);
      kt_pairs.resize(d / 2 * kMatrixKeys);
      v_pairs.resize(kMatrixKeys / 2 * d);
      stage.resize(kMatrixKeys * d);
    }
  }
};

// The item's sequence: where its new tokens start, how many there are, its context and table.
template <typename T>
struct ItemView {
  int64_t start, n, ctx, rows, m;
  const int32_t* table;
  ItemView(const Args<T>& a, const Item& it)
      : start(a.cu[it.seq]),
        n(a.cu[it.seq + 1] - a.cu[it.seq]),
        ctx(a.context_lens[it.seq]),
        rows(it.row_end - it.row_begin),
        m((it.row_end - it.row_begin) * a.group),
        table(a.block_table + it.seq * a.max_blocks),
        tree(a.tree_mask != nullptr && !a.chain[it.seq]) {}
  // Whether the rows take the tree path (run_item). A chain's mask is the causal mask, and the
  // causal path computes each of its rows as the tree path would (the same keys in the same
  // tiles; keys a row does not see get probability 0), with one pass over the keys for all rows
  // instead of one pass per row over the keys past the shared context tiles.
  bool tree;
  // A tree's row sees its context, then its path: its ancestors and itself, the set bits of its
  // mask row in order (`row`: the row's index among its sequence's new tokens). Its keys are read
  // in that order, so the row computes exactly what the last row of a causal chain of its path
  // would.
  std::vector<int32_t> path;
  void trace_path(const Args<T>& a, int64_t row) {
    const uint8_t* bits = a.tree_mask + (start + row) * a.mask_width;
    path.clear();
    for (int32_t j = 0; j <= row; ++j)
      if (bits[j / 8] >> (j % 8) & 1) path.push_back(j);
  }
  // Keys [0, total) are visible to at least one row of a chain or block; row i sees keys
  // [0, visible(i)).
  int64_t total(const Args<T>& a, const Item& it) const {
    return ctx + (a.causal ? it.row_end : n);
  }
  // How many of the tile's keys [j0, j0 + keys) item row `row` sees.
  int64_t visible(const Args<T>& a, const Item& it, int64_t row, int64_t j0, int64_t keys) const {
    if (!a.causal || tree) return keys;
    return std::min(keys, ctx + it.row_begin + row + 1 - j0);
  }
  // The new token whose K/V is key j >= ctx.
  int64_t new_token(int64_t j) const { return path.empty() ? j - ctx : path[j - ctx]; }
};

// Addresses of the K/V rows of keys [j0, j0 + count) of head h: the context through the block
// table, then the new tokens.
template <typename T>
void kv_rows(const Args<T>& a, const ItemView<T>& v, int64_t h, int64_t j0, int64_t count,
             const T** krows, const T** vrows) {
  int64_t t = 0;
  // the context's keys, a run of consecutive slots of one block at a time
  for (int64_t j = j0; t < count && j < v.ctx;) {
    const int64_t blk = v.table[j / a.block_size], slot = j % a.block_size;
    const int64_t run = std::min({count - t, a.block_size - slot, v.ctx - j});
    const T* k = a.key_cache + blk * a.kc_stride[0] + slot * a.kc_stride[1] + h * a.kc_stride[2];
    const T* val =
        a.value_cache + blk * a.vc_stride[0] + slot * a.vc_stride[1] + h * a.vc_stride[2];
    for (int64_t i = 0; i < run; ++i, ++t) {
      krows[t] = k + i * a.kc_stride[1];
      vrows[t] = val + i * a.vc_stride[1];
    }
    j += run;
  }
  for (; t < count; ++t) {
    const int64_t row = (v.start + v.new_token(j0 + t)) * a.hkv + h;
    krows[t] = a.key + row * a.head_dim;
    vrows[t] = a.value + row * a.head_dim;
  }
}

#if defined(CPU_CAPABILITY_AVX512)
// Elements [0, n) of a row of 16 (n <= 16) as float32, exactly (the rest zero).
inline __m512 load_16(const float* p, int64_t n) {
  return n == 16 ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps((1u << n) - 1, p);
}
inline __m256i load_16_halves(const void* p, int64_t n) {
  return n == 16 ? _mm256_loadu_si256(static_cast<const __m256i*>(p))
                 : _mm256_maskz_loadu_epi16((1u << n) - 1, p);
}
inline __m512 load_16(const c10::BFloat16* p, int64_t n) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(load_16_halves(p, n)), 16));
}
inline __m512 load_16(const c10::Half* p, int64_t n) {
  return _mm512_cvtph_ps(load_16_halves(p, n));
}

// v[i][j] = v[j][i], in registers: 32-bit, 64-bit and 128-bit interleaves, then 256-bit halves.
inline void transpose_16x16(__m512 v[16]) {
  __m512 t[16];
#pragma GCC unroll 8
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(v[i], v[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(v[i], v[i + 1]);
  }
#pragma GCC unroll 4
  for (int i = 0; i < 16; i += 4) {
    const __m512d a = _mm512_castps_pd(t[i]), b = _mm512_castps_pd(t[i + 1]),
                  c = _mm512_castps_pd(t[i + 2]), e = _mm512_castps_pd(t[i + 3]);
    v[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
    v[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
    v[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, e));
    v[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, e));
  }
#pragma GCC unroll 2
  for (int i = 0; i < 16; i += 8) {
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      t[i + j] = _mm512_shuffle_f32x4(v[i + j], v[i + j + 4], 0x88);
      t[i + j + 4] = _mm512_shuffle_f32x4(v[i + j], v[i + j + 4], 0xdd);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) {
    v[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    v[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
  }
}

// dst[i][t] = float(rows[t][i]) for t < keys, i < cols (rows of kKeyTile), converted and
// transposed 16 x 16 in registers. A part block repeats its first row: its columns past `keys`
// are never read as scores (softmax_row masks them), only kept finite.
template <typename E>
void transpose_tile(const E* const* rows, int64_t keys, int64_t cols, float* dst) {
  for (int64_t t0 = 0; t0 < keys; t0 += 16) {
    const E* r[16];
    for (int64_t t = 0; t < 16; ++t) r[t] = rows[t0 + t < keys ? t0 + t : t0];
    for (int64_t c = 0; c < cols; c += 16) {
      const int64_t n = std::min<int64_t>(16, cols - c);
      __m512 v[16];
#pragma GCC unroll 16
      for (int t = 0; t < 16; ++t) v[t] = load_16(r[t] + c, n);
      transpose_16x16(v);
      for (int64_t i = 0; i < n; ++i) _mm512_storeu_ps(dst + (c + i) * kKeyTile + t0, v[i]);
    }
  }
}
#endif

// kt[i][t] = float(key t's dim i) for the tile's `keys` keys. The AVX-512 build converts and
// transposes in registers (transpose_tile): converting the tile to float32 rows and transposing
// those with ATen's runtime-sized transpose_mxn (whose blocks go through memory) made calls of
// decode and tree-verify shapes 6-19% slower. Elsewhere the converted rows are transposed. The
// values are the same either way.
template <typename T>
void transpose_keys(const T* const* rows, int64_t keys, int64_t d, [[maybe_unused]] int64_t dp,
                    Scratch& w) {
#if defined(CPU_CAPABILITY_AVX512)
  transpose_tile(rows, keys, d, w.kt.data());
#else
  for (int64_t t = 0; t < keys; ++t) to_float(rows[t], w.k.data() + t * dp, d);
  at::vec::transpose_mxn<float>(w.k.data(), dp, w.kt.data(), kKeyTile, keys, d);
#endif
}

#if defined(CPU_CAPABILITY_AVX512)
// The pair path's K tile: kt[i][t] = dims 2i, 2i + 1 of key t as one 32-bit word, a transpose of
// the keys' [keys][d / 2] words (bit moves, done as float32): half the transposes of
// transpose_keys, and no conversion.
void transpose_key_pairs(const c10::BFloat16* const* rows, int64_t keys, int64_t d, uint32_t* kt) {
  std::array<const float*, kKeyTile> words;
  for (int64_t t = 0; t < keys; ++t) words[t] = reinterpret_cast<const float*>(rows[t]);
  transpose_tile(words.data(), keys, d / 2, reinterpret_cast<float*>(kt));
}

// s[R][kKeyTile] = scale * (q[R] . k) for the columns [0, cols): q's rows as [words] bf16 pairs
// (unscaled), kt as transpose_key_pairs writes it. VDPBF16PS multiplies both pairs' bf16 values
// exactly and adds them to float32 sums: half the instructions of score_block, which multiplies
// the same values widened to float32 (the sums differ in their order of additions only, and the
// scale comes after them instead of before). Every row is computed this way whatever the rows of
// its call, so decoding and verifying rows still agree bit for bit.
template <int R>
__attribute__((target("avx512bf16"))) void score_pairs(const uint32_t* q, int64_t ldq,
                                                       const uint32_t* kt, int64_t words,
                                                       int64_t cols, float scale, float* s) {
  for (int64_t c = 0; c < cols; c += kScoreVecs * kV) {
    __m512 acc[R][kScoreVecs];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < kScoreVecs; ++v) acc[r][v] = _mm512_setzero_ps();
    for (int64_t i = 0; i < words; ++i) {
      __m512bh k[kScoreVecs];
      for (int v = 0; v < kScoreVecs; ++v)
        k[v] = (__m512bh)_mm512_loadu_si512(kt + i * kKeyTile + c + v * kV);
      for (int r = 0; r < R; ++r) {
        const __m512bh qb = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(q[r * ldq + i]));
        for (int v = 0; v < kScoreVecs; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], qb, k[v]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < kScoreVecs; ++v)
        _mm512_storeu_ps(s + r * kKeyTile + c + v * kV,
                         _mm512_mul_ps(acc[r][v], _mm512_set1_ps(scale)));
  }
}
#endif

// The item's query rows in scratch: float32 and scaled, or for the pair path the bf16 values.
template <typename T>
void load_queries(const Args<T>& a, const Item& it, const ItemView<T>& v, Scratch& w) {
  const int64_t d = a.head_dim, g = a.group;
  // Query row i of the item, head j of the group, is scratch row i * g + j: the group's heads are
  // adjacent in memory, so each query row contributes one contiguous [g * d] run.
  for (int64_t i = 0; i < v.rows; ++i) {
    const T* q = a.query + ((v.start + it.row_begin + i) * a.hkv + it.head) * g * d;
    if (a.pair_dots) {
      std::memcpy(w.q_pairs.data() + i * g * d / 2, q, g * d * sizeof(T));
    } else {
      to_float(q, w.q.data() + i * g * d, g * d, a.scale);
    }
  }
}

// The key tile in scratch: transposed to float32 (transpose_keys), or to pairs for the pair path.
template <typename T>
void load_keys(const Args<T>& a, const T* const* rows, int64_t keys, Scratch& w) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (a.pair_dots) return transpose_key_pairs(rows, keys, a.head_dim, w.kt_pairs.data());
  }
#endif
  transpose_keys(rows, keys, a.head_dim, a.padded_dim, w);
}

// Scores of scratch rows [row, row + R) against the key tile (load_keys), scaled.
template <int R, typename T>
void scores(const Args<T>& a, Scratch& w, int64_t row, int64_t cols) {
  const int64_t d = a.head_dim;
#if defined(CPU_CAPABILITY_AVX512)
  if (a.pair_dots) {
    return score_pairs<R>(w.q_pairs.data() + row * d / 2, d / 2, w.kt_pairs.data(), d / 2, cols,
                          a.scale, w.s.data() + row * kKeyTile);
  }
#endif
  score_block<R>(w.q.data() + row * d, d, w.kt.data(), d, cols, w.s.data() + row * kKeyTile);
}

// Fresh accumulators and softmax state for m rows.
void reset_rows(Scratch& w, int64_t m, int64_t dp) {
  std::fill(w.o.begin(), w.o.begin() + m * dp, 0.f);
  std::fill(w.row_ref.begin(), w.row_ref.begin() + m, kNegInf);
  std::fill(w.row_sum.begin(), w.row_sum.begin() + m * kV, 0.f);
}

// Every row sees at least key 0, so row_sum > 0: O / sum, rounded once to T (nearest-even).
template <typename T>
void store_rows(const Args<T>& a, const Item& it, const ItemView<T>& v, const Scratch& w) {
  const int64_t d = a.head_dim, g = a.group;
  for (int64_t r = 0; r < v.m; ++r) {
    const int64_t token = v.start + it.row_begin + r / g;
    T* out = a.out + (token * a.hkv + it.head) * g * d + (r % g) * d;
    const float inv = 1.f / at::vec::vec_reduce_all<float>([](Vec x, Vec y) { return x + y; },
                                                           Vec::loadu(w.row_sum.data() + r * kV));
    const float* o = w.o.data() + r * a.padded_dim;
    for (int64_t c = 0; c < d; ++c) out[c] = static_cast<T>(o[c] * inv);
  }
}

// Keys [j_begin, j_end) (j_begin a multiple of kKeyTile) through scratch rows [r_begin, r_end):
// scores, online softmax and P.V, one key tile at a time.
template <typename T>
void attend(const Args<T>& a, const Item& it, const ItemView<T>& v, Scratch& w, int64_t j_begin,
            int64_t j_end, int64_t r_begin, int64_t r_end) {
  const int64_t d = a.head_dim, dp = a.padded_dim, g = a.group, h = it.head;
  using Rows = std::array<const T*, kKeyTile>;
  auto tile_rows = [&](int64_t j0, int64_t count, Rows& krows, Rows& vrows) {
    kv_rows(a, v, h, j0, count, krows.data(), vrows.data());
  };
  Rows krows, vrows, next_krows, next_vrows;
  tile_rows(j_begin, std::min(kKeyTile, j_end - j_begin), krows, vrows);
  for (int64_t j0 = j_begin; j0 < j_end; j0 += kKeyTile) {
    const int64_t keys = std::min(kKeyTile, j_end - j0);
    // One head's context rows are scattered (a row every Hkv * D elements, blocks in table order),
    // which the hardware prefetcher does not follow: ask for the next tile while this one runs.
    const int64_t next = std::min(kKeyTile, j_end - j0 - keys);
    tile_rows(j0 + keys, next, next_krows, next_vrows);
    for (int64_t t = 0; t < next; ++t) {
      prefetch_row(next_krows[t], d);
      prefetch_row(next_vrows[t], d);
    }
    for (int64_t t = 0; t < keys; ++t) to_float(vrows[t], w.v.data() + t * dp, d);
    load_keys(a, krows.data(), keys, w);
    std::swap(krows, next_krows);
    std::swap(vrows, next_vrows);
    const int64_t cols = round_up(keys, kScoreVecs * kV);
    // Row blocks go through scores, softmax and P.V in turn, so the K and V tiles stay in L1 and
    // each block's rows of Q, S and O are touched while hot.
    const int64_t vcols = round_up(keys, kV);
    for_row_blocks<kScoreRows>(
        r_end,
        [&](auto block, int64_t row) {
          constexpr int R = decltype(block)::value;
          scores<R>(a, w, row, cols);
          for (int64_t r = row; r < row + R; ++r) {
            const int64_t visible = v.visible(a, it, r / g, j0, keys);
            softmax_row(w.s.data() + r * kKeyTile, visible, vcols, w.row_ref[r],
                        w.row_sum.data() + r * kV, w.o.data() + r * dp, dp);
          }
          pv(w.s.data() + row * kKeyTile, w.v.data(), keys, w.o.data() + row * dp, R, dp);
        },
        r_begin);
  }
}

// Floats a split keeps per chunk for m rows: o, row_ref and row_sum (Scratch).
int64_t part_floats(int64_t m, int64_t dp) {
  return m * (dp + 1 + kV);
}

// Chunk `part` of a split: w's accumulators for its m rows, saved into the split's parts.
void save_part(const Scratch& w, Split& s, int64_t part, int64_t m, int64_t dp) {
  float* p = s.parts.data() + part * part_floats(m, dp);
  p = std::copy_n(w.o.data(), m * dp, p);
  p = std::copy_n(w.row_ref.data(), m, p);
  std::copy_n(w.row_sum.data(), m * kV, p);
}

// The chunks' accumulators as one online softmax over all their keys would leave them (up to
// rounding): each chunk's O and partial sums rescaled from its reference point to the largest
// one and added in chunk order. A chunk a row sees none of (reference -inf) adds nothing.
void merge_parts(Scratch& w, const Split& s, int64_t chunks, int64_t m, int64_t dp) {
  reset_rows(w, m, dp);
  for (int64_t r = 0; r < m; ++r) {
    float ref = kNegInf;
    for (int64_t c = 0; c < chunks; ++c)
      ref = std::max(ref, s.parts[c * part_floats(m, dp) + m * dp + r]);
    w.row_ref[r] = ref;
    for (int64_t c = 0; c < chunks; ++c) {
      const float* p = s.parts.data() + c * part_floats(m, dp);
      const float part_ref = p[m * dp + r];
      if (part_ref == kNegInf) continue;
      const Vec alpha(std::exp(part_ref - ref));
      float* o = w.o.data() + r * dp;
      for (int64_t j = 0; j < dp; j += kV)
        at::vec::fmadd(Vec::loadu(p + r * dp + j), alpha, Vec::loadu(o + j)).store(o + j);
      float* sum = w.row_sum.data() + r * kV;
      at::vec::fmadd(Vec::loadu(p + m * dp + m + r * kV), alpha, Vec::loadu(sum)).store(sum);
    }
  }
}

// The item's keys [key_begin, key_end) (within those its rows see) through its rows, then its
// output rows, or for a chunk of a split its accumulators (the last chunk to finish writes the
// split's output).
template <typename T>
void run_item(const Args<T>& a, const Item& it, Scratch& w) {
  const int64_t g = a.group;
  ItemView<T> v(a, it);
  load_queries(a, it, v, w);
  reset_rows(w, v.m, a.padded_dim);
  const int64_t begin = it.key_begin, end = std::min(it.key_end, v.total(a, it));
  if (!v.tree) {
    attend(a, it, v, w, begin, end, 0, v.m);
  } else {
    // The rows of a tree share their context: its whole key tiles go through every row at once.
    // The rest (the context's last part tile and the row's path) goes through each row alone,
    // with the tile boundaries a causal chain of its path would have.
    const int64_t shared = v.ctx / kKeyTile * kKeyTile;
    if (begin < shared) attend(a, it, v, w, begin, std::min(shared, end), 0, v.m);
    for (int64_t i = 0; i < v.rows; ++i) {
      v.trace_path(a, it.row_begin + i);
      const int64_t from = std::max(shared, begin);
      const int64_t to = std::min(end, v.ctx + static_cast<int64_t>(v.path.size()));
      if (from < to) attend(a, it, v, w, from, to, i * g, (i + 1) * g);
    }
  }
  if (it.split == nullptr) return store_rows(a, it, v, w);
  Split& s = *it.split;
  const int64_t chunks = static_cast<int64_t>(s.parts.size()) / part_floats(v.m, a.padded_dim);
  save_part(w, s, it.part, v.m, a.padded_dim);
  if (s.left.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
  merge_parts(w, s, chunks, v.m, a.padded_dim);
  store_rows(a, s.whole, v, w);
}

// hi = T(s), lo = T(s - hi) for n values (n a multiple of 2 * kV).
template <typename T>
void split_hi_lo(const float* s, T* hi, T* lo, int64_t n) {
  for (int64_t i = 0; i < n; i += 2 * kV) {
    const Vec a = Vec::loadu(s + i), b = Vec::loadu(s + i + kV);
    const auto h = at::vec::convert_from_float<T>(a, b);
    h.store(hi + i);
    const auto [ha, hb] = at::vec::convert_to_float<T>(h);
    at::vec::convert_from_float<T>(a - ha, b - hb).store(lo + i);
  }
}

template <typename T>
bool matrix_engine_available() {
  if constexpr (std::is_same_v<T, float>) {
    return false;
  } else {
    static const bool ok = isa_limit_allows_amx() &&
                           at::native::cpublas::could_pack(c10::CppTypeToScalarType<T>::value);
    return ok;
  }
}

// The `keys` rows (head_dim d, T = bf16 / fp16) copied to `stage` [keys][d], row after row.
template <typename T>
void gather_rows(const T* const* rows, int64_t keys, int64_t d, T* stage) {
  for (int64_t t = 0; t < keys; ++t) std::memcpy(stage + t * d, rows[t], d * sizeof(T));
}

// K^T in brgemm's VNNI layout: dst[i][t] (row stride ld_dst) is dims 2i, 2i+1 of key t as one
// 32-bit word, i.e. a transpose of the keys' [keys][d/2] words (bit moves, done as float32).
template <typename T>
void pack_keys(const T* const* rows, int64_t keys, int64_t d, T* stage, uint32_t* dst,
               int64_t ld_dst) {
  gather_rows(rows, keys, d, stage);
  at::vec::transpose_mxn<float>(reinterpret_cast<const float*>(stage), d / 2,
                                reinterpret_cast<float*>(dst), ld_dst, keys, d / 2);
}

// V in brgemm's VNNI layout: dst[t / 2][c][t % 2] = v[t][c], an odd last key paired with zeros.
template <typename T>
void pack_values(const T* const* rows, int64_t keys, int64_t d, T* stage, T* dst) {
  gather_rows(rows, keys, d, stage);
#if defined(CPU_CAPABILITY_AVX512)
  at::vec::pack_vnni2(stage, dst, d, keys, d);
#else
  for (int64_t t = 0; t < round_up(keys, 2); ++t) {
    for (int64_t c = 0; c < d; ++c)
      dst[(t / 2) * 2 * d + 2 * c + t % 2] = t < keys ? stage[t * d + c] : T(0);
  }
#endif
}

// run_item on the matrix engine (T = bf16 / fp16, even head_dim): S = Q K^T and O += P V are
// brgemm calls with T operands and float32 accumulation. P is split into P_hi = T(P) and
// P_lo = T(P - P_hi) and both are multiplied by V, so P keeps ~16 significant bits and the output
// is still rounded (in effect) once, as on the vector path, instead of carrying the rounding of P
// to T that flash attention kernels usually accept. The online softmax and the output are the
// vector path's.
template <typename T>
void run_item_matrix(const Args<T>& a, const Item& it, Scratch& w) {
  const int64_t d = a.head_dim, dp = a.padded_dim, g = a.group, h = it.head;
  ItemView<T> v(a, it);
  const int64_t m = v.m;
  auto* q16 = reinterpret_cast<T*>(w.q16.data());
  constexpr int64_t kTile = kMatrixKeys;
  auto* p_hi = reinterpret_cast<T*>(w.p16.data());
  auto* p_lo = p_hi + m * kTile;
  for (int64_t i = 0; i < v.rows; ++i) {
    const int64_t token = v.start + it.row_begin + i;
    std::copy_n(a.query + (token * a.hkv + h) * g * d, g * d, q16 + i * g * d);
  }
  reset_rows(w, m, dp);
  const int64_t total = v.total(a, it);
  std::array<const T*, kTile> krows, vrows;
  auto* stage = reinterpret_cast<T*>(w.stage.data());
  for (int64_t j0 = 0; j0 < total; j0 += kTile) {
    const int64_t keys = std::min(kTile, total - j0), keys_even = round_up(keys, 2);
    kv_rows(a, v, h, j0, keys, krows.data(), vrows.data());
    pack_keys(krows.data(), keys, d, stage, w.kt_pairs.data(), kTile);
    pack_values(vrows.data(), keys, d, stage, reinterpret_cast<T*>(w.v_pairs.data()));
    at::native::cpublas::brgemm(m, keys, d, d, kTile, kTile, false, q16,
                                reinterpret_cast<const T*>(w.kt_pairs.data()), w.s.data());
    const int64_t vcols = round_up(keys, kV);
    for (int64_t r = 0; r < m; ++r) {
      float* srow = w.s.data() + r * kTile;
      for (int64_t c = 0; c < vcols; c += kV) (Vec::loadu(srow + c) * Vec(a.scale)).store(srow + c);
      const int64_t visible = v.visible(a, it, r / g, j0, keys);
      softmax_row(srow, visible, vcols, w.row_ref[r], w.row_sum.data() + r * kV,
                  w.o.data() + r * dp, dp);
      split_hi_lo(srow, p_hi + r * kTile, p_lo + r * kTile, round_up(keys, 2 * kV));
    }
    for (const T* p : {p_hi, p_lo})
      at::native::cpublas::brgemm(m, d, keys_even, kTile, d, dp, true, p,
                                  reinterpret_cast<const T*>(w.v_pairs.data()), w.o.data());
  }
  w.used_matrix_engine = true;
  store_rows(a, it, v, w);
}

template <typename T>
bool uses_matrix_engine(const Args<T>& a, const Item& it) {
  if (a.tree_mask) return false;  // a tree's rows see different keys (run_item)
  const int64_t tokens = it.row_end - it.row_begin;
  return a.causal ? tokens >= kMatrixCausalTokens : tokens * a.group >= kMatrixRows;
}

// Whether rows [begin, end) of a tree mask (one sequence's) are the causal mask: row j sees new
// tokens 0..j (bits past j are not read).
bool is_chain(const uint8_t* mask, int64_t width, int64_t begin, int64_t end) {
  for (int64_t r = begin; r < end; ++r) {
    const uint8_t* bits = mask + r * width;
    for (int64_t j = 0; j <= r - begin; ++j)
      if (!(bits[j / 8] >> (j % 8) & 1)) return false;
  }
  return true;
}

template <typename T>
void run(const Args<T>& a, int64_t batch) {
  const int64_t rows_per_item = std::max<int64_t>(1, kQueryVectors / a.group);
  std::vector<Item> items;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t n = a.cu[b + 1] - a.cu[b], ctx = a.context_lens[b];
    for (int64_t r0 = 0; r0 < n; r0 += rows_per_item) {
      const int64_t r1 = std::min(n, r0 + rows_per_item);
      const int64_t cost = (r1 - r0) * (ctx + (a.causal ? r1 : n));
      for (int64_t h = 0; h < a.hkv; ++h) items.push_back({b, h, r0, r1, cost});
    }
  }
  if (items.empty()) return;
  // Vector-path items over more than kKeyChunk keys go in chunks (Split), whatever the thread
  // count, so that a row's result does not depend on it either (one thread pays a few percent for
  // the merges). A split's address is what its chunks hold, so splits live in a deque, which
  // never moves them.
  const bool matrix = matrix_engine_available<T>() && a.head_dim % 2 == 0;
  std::deque<Split> splits;
  for (size_t i = 0, whole = items.size(); i < whole; ++i) {
    const Item it = items[i];
    const int64_t total = ItemView<T>(a, it).total(a, it);
    if (total <= kKeyChunk || (matrix && uses_matrix_engine(a, it))) continue;
    const int64_t chunks = (total + kKeyChunk - 1) / kKeyChunk;
    Split& s = splits.emplace_back();
    s.whole = it;
    s.parts.resize(chunks * part_floats((it.row_end - it.row_begin) * a.group, a.padded_dim));
    s.left.store(chunks, std::memory_order_relaxed);
    for (int64_t c = 0; c < chunks; ++c) {
      Item& chunk = c == 0 ? items[i] : items.emplace_back(it);
      chunk.key_begin = c * kKeyChunk;
      chunk.key_end = std::min(total, (c + 1) * kKeyChunk);
      chunk.cost = (it.row_end - it.row_begin) * (chunk.key_end - chunk.key_begin);
      chunk.split = &s;
      chunk.part = c;
    }
  }
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& x, const Item& y) { return x.cost > y.cost; });
  // A decode step over a short context is a few microseconds of work: waking a pool thread for it
  // costs more (tens of microseconds in a VM), so small calls run on the calling thread.
  int64_t work = 0, max_rows = 0;
  bool any_matrix = false;
  for (const Item& it : items) {
    work += it.cost;
    max_rows = std::max(max_rows, it.row_end - it.row_begin);
    any_matrix = any_matrix || (matrix && uses_matrix_engine(a, it));
  }
  const int64_t workers = work * a.group * a.head_dim < kMinAttentionWork
                              ? 1
                              : std::min<int64_t>(at::get_num_threads(), items.size());
  std::atomic<int64_t> next{0};
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    Scratch scratch(max_rows * a.group, a.head_dim, a.padded_dim, any_matrix, a.pair_dots);
    for (int64_t i = next++; i < static_cast<int64_t>(items.size()); i = next++) {
      const Item& it = items[i];
      if constexpr (!std::is_same_v<T, float>) {
        if (matrix && uses_matrix_engine(a, it)) {
          run_item_matrix(a, it, scratch);
          continue;
        }
      }
      run_item(a, it, scratch);
    }
    if (scratch.used_matrix_engine) at::native::cpublas::brgemm_release();
  });
}

// Attention into `into` (paged_attention.out), or into a new tensor when it is absent.
at::Tensor paged_attention_into(const at::Tensor& query, const at::Tensor& key,
                                const at::Tensor& value, const at::Tensor& key_cache,
                                const at::Tensor& value_cache, const at::Tensor& block_table,
                                const at::Tensor& context_lens, const at::Tensor& cu_query_lens,
                                double scale, bool causal, bool /*check*/,
                                const std::optional<at::Tensor>& tree_mask,
                                const std::optional<at::Tensor>& into) {
  // As in context_kv: the index checks cost no copy on the CPU, so they always run.
  checks::paged_attention_meta(query, key, value, key_cache, value_cache, block_table, context_lens,
                               cu_query_lens, scale, causal, tree_mask);
  const auto table = block_table.contiguous();
  const auto ctx = context_lens.contiguous();
  const auto cu = cu_query_lens.contiguous();
  checks::paged_attention_values(query.size(0), key_cache.size(0), key_cache.size(1),
                                 table.data_ptr<int32_t>(), table.size(0), table.size(1),
                                 ctx.data_ptr<int32_t>(), cu.data_ptr<int32_t>());
  const auto mask = tree_mask ? tree_mask->contiguous() : at::Tensor();
  std::vector<uint8_t> chains;
  if (tree_mask) {
    checks::tree_mask_values(mask.data_ptr<uint8_t>(), mask.size(1), cu.data_ptr<int32_t>(),
                             table.size(0));
    const int32_t* starts = cu.data_ptr<int32_t>();
    for (int64_t b = 0; b < table.size(0); ++b)
      chains.push_back(is_chain(mask.data_ptr<uint8_t>(), mask.size(1), starts[b], starts[b + 1]));
  }

  if (into) checks::paged_attention_out(query, *into);
  auto out = into ? *into : at::empty_like(query, at::MemoryFormat::Contiguous);
  if (out.numel() == 0) return out;
  // The caches are read in place through their strides (per-layer views of a stacked cache need
  // no copy); only their last dim must be contiguous.
  const auto kc = key_cache.stride(3) == 1 ? key_cache : key_cache.contiguous();
  const auto vc = value_cache.stride(3) == 1 ? value_cache : value_cache.contiguous();
  const auto q = query.contiguous(), k = key.contiguous(), v = value.contiguous();
  const auto launch = [&](auto zero) {
    using scalar_t = decltype(zero);
    Args<scalar_t> a{};
    a.query = q.data_ptr<scalar_t>();
    a.key = k.data_ptr<scalar_t>();
    a.value = v.data_ptr<scalar_t>();
    a.key_cache = kc.data_ptr<scalar_t>();
    a.value_cache = vc.data_ptr<scalar_t>();
    a.out = out.data_ptr<scalar_t>();
    a.block_table = table.data_ptr<int32_t>();
    a.context_lens = ctx.data_ptr<int32_t>();
    a.cu = cu.data_ptr<int32_t>();
    a.tree_mask = tree_mask ? mask.data_ptr<uint8_t>() : nullptr;
    a.mask_width = tree_mask ? mask.size(1) : 0;
    a.chain = chains.data();
    a.head_dim = query.size(2);
    a.padded_dim = round_up(a.head_dim, kV);
    a.hkv = key.size(1);
    a.group = query.size(1) / a.hkv;
    a.max_blocks = table.size(1);
    a.block_size = kc.size(1);
    for (int i = 0; i < 3; ++i) {
      a.kc_stride[i] = kc.stride(i);
      a.vc_stride[i] = vc.stride(i);
    }
    a.scale = static_cast<float>(scale);
    a.causal = causal;
    a.pair_dots =
        std::is_same_v<scalar_t, c10::BFloat16> && has_bf16_dot_products() && a.head_dim % 2 == 0;
    run(a, table.size(0));
  };
  switch (query.scalar_type()) {  // paged_attention_meta admitted only these
    case at::kFloat:
      launch(float{});
      break;
    case at::kBFloat16:
      launch(c10::BFloat16{});
      break;
    default:
      launch(c10::Half{});
      break;
  }
  return out;
}

}  // namespace
}  // namespace dflash::cpu::paged_attention

TORCH_LIBRARY_IMPL(dflash, CPU, m) {
  using dflash::cpu::paged_attention::paged_attention_into;
  m.impl("paged_attention", &dflash::variants::paged_attention<paged_attention_into>);
  m.impl("paged_attention.out", &dflash::variants::paged_attention_out<paged_attention_into>);
}
