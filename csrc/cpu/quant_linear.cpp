// quant_linear on CPU: y = x @ W^T + bias for an 8- or 4-bit weight in quad panels with one
// float16 scale per output column and group of 32 inputs, for 4 bits with a float16 minimum
// (llama.cpp's Q8_0 and Q4_1 blocks) (dflash.ops.quantize_int8 / quantize_int4; docs/design.md
// 3.4).
//
// Decoding streams every weight once per step, so a weight of 1 byte (plus 2 bytes of scale per
// 32) takes 17/32 of the bytes of bf16, and one of half a byte (plus 4 bytes per 32) 5/16.
// The activations are quantized too, per row and group of 32, as llama.cpp quantizes the input of
// a Q8_0 matmul (quantize_group below): a group's dot product is then an exact integer, computed
// by AVX512-VNNI's VPDPBUSD (64 byte products per instruction) where the CPU has it, by
// VPMADDUBSW and VPMADDWD in the AVX2 build and on AVX-512 CPUs without VNNI, and in the scalar
// build in float32 from bytes widened as they load (every product and partial sum is an integer
// below 2^24, so exact as well). All give the same integer, and it enters the row's float32 sum
// the same way: acc = fma(sum, w_scale * x_scale, acc), group by group in order. A row's result
// therefore does not depend on the other rows of the call, the thread split or the path, so the
// rows of a verification equal the one-token decodes of the same tokens bit for bit.
//
// 8-bit layout (dflash.ops.to_quad_panels): weight[p, i, j, t] = q[16 p + j, 4 i + t] + 128, uint8
// (the int8 value q offset by 128): one 64-byte vector holds 4 consecutive inputs of 16 columns in
// VPDPBUSD's operand order, and as its unsigned operand as stored. The integer of a group is then
// sum((q + 128) x), from which 128 * sum(x) (known per row) is taken out.
// 4-bit layout (dflash.ops.to_nibble_panels): codes c in 0..15 with W = c * scale + min; byte
// [p, i, j, t] holds c[16 p + j, 8 i + t] in its low and c[16 p + j, 8 i + 4 + t] in its high
// nibble, so a 64-byte vector masked and shifted gives two quads in the 8-bit layout's order. A
// group adds sum(c x) * w_scale * x_scale, then min * x_scale * sum(x).
#include "cpu/common.h"

namespace dflash::cpu::quant_linear {
namespace {

using fVec = at::vec::Vectorized<float>;
using iVec = at::vec::Vectorized<int32_t>;
constexpr int64_t kPanel = 16;  // output columns per panel
constexpr int64_t kQuad = 4;    // inputs per 32-bit lane
constexpr int64_t kGroup = 32;  // inputs per scale
constexpr int64_t kQuadsPerGroup = kGroup / kQuad;
// bytes of one panel's group of 32 inputs
template <int Bits>
constexpr int64_t kGroupBytes = kQuadsPerGroup * kPanel * kQuad * Bits / 8;
constexpr int kVecs = kPanel / fVec::size();
static_assert(kPanel % fVec::size() == 0 && iVec::size() == fVec::size(), "whole vectors");

// The weight's scales (and 4-bit minimums), float16 as llama.cpp's blocks store them: in float32
// they would be a ninth of the bytes an 8-bit pass streams, and a third of a 4-bit one's.
using Scale = c10::Half;

// One vector of scales (or minimums), widened to float32.
inline fVec load_scales(const Scale* p) {
#if defined(CPU_CAPABILITY_AVX512)
  return fVec(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
#elif defined(CPU_CAPABILITY_AVX2)
  return fVec(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#else
  float wide[fVec::size()];
  for (int i = 0; i < fVec::size(); ++i) wide[i] = static_cast<float>(p[i]);
  return fVec::loadu(wide);
#endif
}

// x quantized per row and group: q [rows, k], scale and sum(q) [rows, k / 32].
struct QuantizedRows {
  std::vector<int8_t> q;
  std::vector<float> scale;
  std::vector<int32_t> sum;
};

// One group of 32 floats as llama.cpp's x86 Q8_0 input quantizer computes it (so a GGUF target's
// matmuls follow its block semantics): q = round(x * (127 / max|x|)) (ties to even), scale
// d = max|x| / 127 rounded to float16, as its blocks store d (float32 where float16 overflows).
// A group holding inf or NaN gets scale NaN, so its rows' outputs are NaN, not silently finite.
void quantize_group(const float* x, int8_t* q, float* scale, int32_t* sum) {
  constexpr int kVecsPerGroup = kGroup / fVec::size();
  fVec v[kVecsPerGroup];
  fVec amax(0.0f);
  for (int i = 0; i < kVecsPerGroup; ++i) {
    v[i] = fVec::loadu(x + i * fVec::size());
    amax = at::vec::maximum(amax, v[i].abs());  // propagates NaN
  }
  const float m = at::vec::vec_reduce_all<float>(
      [](const fVec& a, const fVec& b) { return at::vec::maximum(a, b); }, amax);
  if (!std::isfinite(m)) {
    std::memset(q, 0, kGroup);
    *scale = std::numeric_limits<float>::quiet_NaN();
    *sum = 0;
    return;
  }
  const float d = m / 127.0f, inv = m != 0.0f ? 127.0f / m : 0.0f;
#if defined(CPU_CAPABILITY_AVX512)
  // cvtps rounds in the default mode, to nearest even, as round() does
  __m512i total = _mm512_setzero_si512();
  for (int i = 0; i < kVecsPerGroup; ++i) {
    const __m512i qi = _mm512_cvtps_epi32(_mm512_mul_ps(v[i], _mm512_set1_ps(inv)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i * fVec::size()), _mm512_cvtepi32_epi8(qi));
    total = _mm512_add_epi32(total, qi);
  }
  *sum = _mm512_reduce_add_epi32(total);
#else
  float rounded[kGroup];
  for (int i = 0; i < kVecsPerGroup; ++i)
    (v[i] * fVec(inv)).round().store(rounded + i * fVec::size());
  int32_t s = 0;
  for (int64_t i = 0; i < kGroup; ++i) {
    q[i] = static_cast<int8_t>(rounded[i]);  // |rounded| <= 127
    s += q[i];
  }
  *sum = s;
#endif
  const float half = static_cast<float>(c10::Half(d));
  *scale = std::isinf(half) ? d : half;
}

template <typename T>
QuantizedRows quantize_rows(const T* x, int64_t rows, int64_t k) {
  const int64_t groups = k / kGroup;
  QuantizedRows out{std::vector<int8_t>(rows * k), std::vector<float>(rows * groups),
                    std::vector<int32_t>(rows * groups)};
  float wide[kGroup];
  for (int64_t g = 0; g < rows * groups; ++g) {
    const float* xf = as_float(x + g * kGroup, wide, kGroup);
    quantize_group(xf, out.q.data() + g * kGroup, out.scale.data() + g, out.sum.data() + g);
  }
  return out;
}

// What one call of a block multiplies: MR rows of x starting at `row`, NP panels at `tile` (each
// `panel_bytes` long), over all groups; the float32 sums accumulate in out[r * ldo + column].
struct Block {
  const QuantizedRows& x;
  int64_t k, groups, row;
  const uint8_t* tile;
  int64_t panel_bytes;
  const Scale* scales;  // the tile's first panel's scales [groups, 16]
  const Scale* mins;    // 4 bits: its minimums [groups, 16]
  float* out;
  int64_t ldo;
};

// Where group g of a block starts: its first row's quantized inputs, sum(q) and scale (the next
// rows' follow at strides of k and of groups), its first panel's weight bytes and scales (the next
// panels' at strides of panel_bytes and of groups * 16).
struct Group {
  const int8_t* x;
  const int32_t* xsum;
  const float* xscale;
  const uint8_t* w;
  const Scale* wscale;
};

template <int Bits>
Group group_of(const Block& b, int64_t g) {
  return {b.x.q.data() + b.row * b.k + g * kGroup, b.x.sum.data() + b.row * b.groups + g,
          b.x.scale.data() + b.row * b.groups + g, b.tile + g * kGroupBytes<Bits>,
          b.scales + g * kPanel};
}

// 8 bits: q of input 4 quad + t of the columns whose 32-bit lanes start at `lanes`: the offset
// flipped away (q + 128 xor 128 = q as int8), byte t shifted to the top and back down
// (sign-extending). 4 bits: the code, nibble (quad % 2) of byte t.
template <int Bits>
inline iVec weights_of(const uint8_t* lanes, int64_t quad, int t) {
  const iVec v = iVec::loadu(lanes);
  if constexpr (Bits == 8) {
    return ((v ^ iVec(static_cast<int32_t>(0x80808080u))) << iVec(24 - 8 * t)) >> iVec(24);
  } else {
    return (v >> iVec(8 * t + 4 * static_cast<int>(quad % 2))) & iVec(0xf);
  }
}

// Group g's integer sums in float32 (each 32-bit lane of a panel vector holds a column's 4
// weights, widened as weights_of gives them), then acc += sum * (w_scale * x_scale) (+ min *
// (x_scale * sum(x)) for 4 bits).
template <int Bits, int NP, int MR>
void multiply_group(const Block& b, int64_t g) {
  fVec sums[MR][NP * kVecs];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NP * kVecs; ++j) sums[r][j] = fVec(0.0f);
  for (int64_t i = 0; i < kQuadsPerGroup; ++i) {
    const int64_t quad = g * kQuadsPerGroup + i;
    for (int t = 0; t < kQuad; ++t) {
      fVec w[NP * kVecs];
      for (int p = 0; p < NP; ++p)
        for (int j = 0; j < kVecs; ++j) {
          const int64_t vector = Bits == 8 ? quad : quad / 2;  // 64-byte vectors into the panel
          const uint8_t* lanes = b.tile + p * b.panel_bytes + vector * kPanel * kQuad +
                                 j * iVec::size() * sizeof(int32_t);
          w[p * kVecs + j] = at::vec::convert<float>(weights_of<Bits>(lanes, quad, t));
        }
      for (int r = 0; r < MR; ++r) {
        const fVec xv(static_cast<float>(b.x.q[(b.row + r) * b.k + quad * kQuad + t]));
        for (int j = 0; j < NP * kVecs; ++j) sums[r][j] = at::vec::fmadd(w[j], xv, sums[r][j]);
      }
    }
  }
  for (int r = 0; r < MR; ++r) {
    const int64_t rg = (b.row + r) * b.groups + g;
    const fVec xs(b.x.scale[rg]), xsum(b.x.scale[rg] * static_cast<float>(b.x.sum[rg]));
    float* o = b.out + r * b.ldo;
    for (int j = 0; j < NP * kVecs; ++j) {
      const int64_t c = j * fVec::size();  // panel j / kVecs, its vector j % kVecs
      const int64_t at = ((j / kVecs) * b.groups + g) * kPanel + (j % kVecs) * fVec::size();
      fVec acc = at::vec::fmadd(sums[r][j], load_scales(b.scales + at) * xs, fVec::loadu(o + c));
      if constexpr (Bits == 4) acc = at::vec::fmadd(load_scales(b.mins + at), xsum, acc);
      acc.store(o + c);
    }
  }
}

// Which instructions give a group's integers: VPDPBUSD (AVX512-VNNI), pairs of VPMADDUBSW and
// VPMADDWD (the AVX2 build, and the AVX-512 one on a CPU without VNNI), or float32 products
// (the scalar build). All give the same integers.
enum class Path { kVnni, kPairs, kFloat };

#if defined(CPU_CAPABILITY_AVX512)
// VNNI where the CPU has it and oneDNN's ISA limit admits it (common.h, isa_limit): the limits
// below AVX512_CORE_VNNI hide it, so `ONEDNN_MAX_CPU_ISA=AVX512_CORE` runs an AVX-512 host
// without VNNI (Skylake-SP) on one that has it.
bool has_vnni() {
  static const bool has = [] {
    const std::string isa = isa_limit();
    for (const char* below : {"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE"})
      if (isa == below) return false;
    return __builtin_cpu_supports("avx512vnni") != 0;
  }();
  return has;
}

// The same integers through VPDPBUSD: 8 bits: (q + 128) . x, less 128 * sum(x) from the start; 4
// bits: c . x, the nibbles masked out of each vector. All groups in one call (a call per group
// costs as much as a group's work at one row). The fields of `b` are read into locals first: the
// stores to b.out would otherwise make the compiler keep the accumulators in memory.
template <int Bits, int NP, int MR>
__attribute__((target("avx512vnni"))) void dot_groups_vnni(const Block& b) {
  static_assert(kVecs == 1, "an AVX-512 vector holds a panel");
  const int64_t k = b.k, groups = b.groups, panel_bytes = b.panel_bytes, ldo = b.ldo;
  float* out = b.out;
  for (int64_t g = 0; g < groups; ++g) {
    const Group in = group_of<Bits>(b, g);
    __m512i acc[MR][NP];
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m512i start = _mm512_set1_epi32(Bits == 8 ? -128 * in.xsum[r * groups] : 0);
#pragma GCC unroll 8
      for (int p = 0; p < NP; ++p) acc[r][p] = start;
    }
    // 8 bits: a vector per quad; 4 bits: a vector per two quads (low nibbles, then high ones)
    constexpr int kQuadsPerVector = 8 / Bits;
#pragma GCC unroll 8
    for (int64_t i = 0; i < kQuadsPerGroup / kQuadsPerVector; ++i) {
      __m512i wv[kQuadsPerVector][NP];
#pragma GCC unroll 8
      for (int p = 0; p < NP; ++p) {
        const uint8_t* at = in.w + p * panel_bytes + i * kPanel * kQuad;
        prefetch_to_l2(at, NP * panel_bytes);  // the next tile (common.h)
        const __m512i v = _mm512_loadu_si512(at);
        if constexpr (Bits == 8) {
          wv[0][p] = v;
        } else {
          const __m512i nibble = _mm512_set1_epi8(0x0f);
          wv[0][p] = _mm512_and_si512(v, nibble);
          wv[kQuadsPerVector - 1][p] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
        }
      }
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 2
        for (int h = 0; h < kQuadsPerVector; ++h) {
          int32_t quad_x;
          std::memcpy(&quad_x, in.x + r * k + (i * kQuadsPerVector + h) * kQuad, sizeof(quad_x));
          const __m512i xv = _mm512_set1_epi32(quad_x);
#pragma GCC unroll 8
          for (int p = 0; p < NP; ++p) acc[r][p] = _mm512_dpbusd_epi32(acc[r][p], wv[h][p], xv);
        }
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m512 xs = _mm512_set1_ps(in.xscale[r * groups]);
      const __m512 xsum_scaled =
          _mm512_set1_ps(in.xscale[r * groups] * static_cast<float>(in.xsum[r * groups]));
#pragma GCC unroll 8
      for (int p = 0; p < NP; ++p) {
        float* o = out + r * ldo + p * kPanel;
        const Scale* scale = in.wscale + p * groups * kPanel;
        if (r == 0) prefetch_to_l2(scale, NP * groups * kPanel * sizeof(*scale));
        const __m512 s = _mm512_mul_ps(load_scales(scale), xs);
        __m512 sum = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][p]), s, _mm512_loadu_ps(o));
        if constexpr (Bits == 4) {
          const Scale* low = b.mins + g * kPanel + p * groups * kPanel;
          if (r == 0) prefetch_to_l2(low, NP * groups * kPanel * sizeof(*low));
          sum = _mm512_fmadd_ps(load_scales(low), xsum_scaled, sum);
        }
        _mm512_storeu_ps(o, sum);
      }
    }
  }
}
#endif

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
// The pairs path's vector operations, 64 bytes wide in the AVX-512 build (AVX512BW) and 32 in
// the AVX2 one.
struct Pairs {
#if defined(CPU_CAPABILITY_AVX512)
  using I = __m512i;
  static I load(const uint8_t* p) { return _mm512_loadu_si512(p); }
  static I bytes(char v) { return _mm512_set1_epi8(v); }
  static I lanes(int32_t v) { return _mm512_set1_epi32(v); }
  static I zero() { return _mm512_setzero_si512(); }
  static I both(I a, I b) { return _mm512_and_si512(a, b); }
  static I flip(I a, I b) { return _mm512_xor_si512(a, b); }
  static I high_nibbles(I v) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), bytes(0x0f)); }
  static I magnitude(I q) { return _mm512_abs_epi8(q); }
  // x negated where q < 0 (VPSIGNB has no 64-byte form; where q = 0, |q| x is 0 anyway)
  static I signed_by(I x, I q) {
    return _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(q), _mm512_setzero_si512(), x);
  }
  static I pair_sums(I u, I s) { return _mm512_maddubs_epi16(u, s); }
  static I widen_pairs(I a) { return _mm512_madd_epi16(a, _mm512_set1_epi16(1)); }
  static I add(I a, I b) { return _mm512_add_epi32(a, b); }
  static I add_pairs(I a, I b) { return _mm512_add_epi16(a, b); }
  static fVec to_float(I a) { return fVec(_mm512_cvtepi32_ps(a)); }
#else
  using I = __m256i;
  static I load(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const I*>(p)); }
  static I bytes(char v) { return _mm256_set1_epi8(v); }
  static I lanes(int32_t v) { return _mm256_set1_epi32(v); }
  static I zero() { return _mm256_setzero_si256(); }
  static I both(I a, I b) { return _mm256_and_si256(a, b); }
  static I flip(I a, I b) { return _mm256_xor_si256(a, b); }
  static I high_nibbles(I v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), bytes(0x0f)); }
  static I magnitude(I q) { return _mm256_abs_epi8(q); }
  static I signed_by(I x, I q) { return _mm256_sign_epi8(x, q); }
  static I pair_sums(I u, I s) { return _mm256_maddubs_epi16(u, s); }
  static I widen_pairs(I a) { return _mm256_madd_epi16(a, _mm256_set1_epi16(1)); }
  static I add(I a, I b) { return _mm256_add_epi32(a, b); }
  static I add_pairs(I a, I b) { return _mm256_add_epi16(a, b); }
  static fVec to_float(I a) { return fVec(_mm256_cvtepi32_ps(a)); }
#endif
};
static_assert(sizeof(Pairs::I) == sizeof(fVec), "an integer vector per float vector of columns");

// The same integers from VPMADDUBSW (unsigned x signed bytes, pairs summed to int16) and
// VPMADDWD against ones (int16 pairs summed to int32), so each 32-bit lane again holds one
// column's sum of 4 products. VPMADDUBSW saturates its int16 sums, so no pair may exceed 32767:
// 8 bits multiply |q| (at most 128) by x with q's sign moved onto it (|x| <= 127, as
// quantize_group makes it): 2 * 128 * 127 fits. 4 bits multiply the codes (0..15) by x as they
// are. A group's integer is then what the VNNI and float paths compute, and it enters the row's
// sum the same way. A 4-bit pair is at most 2 * 15 * 127 = 3810, so the 8 pairs a lane gathers
// over a group (30480) fit its int16 lane: 4 bits add the pairs as they come and widen them to
// int32 once per group, which saves a VPMADDWD and an add per quad, half of what a row costs
// once several rows share each weight load.
template <int Bits, int NP, int MR>
void dot_groups_pairs(const Block& b) {
  using I = Pairs::I;
  constexpr int NV = NP * kVecs;                         // vectors of fVec::size() columns
  constexpr int kQuadsPerVector = 8 / Bits;              // as in the VNNI version
  constexpr int64_t kVecBytes = kPanel * kQuad / kVecs;  // one vector's columns' quads
  const int64_t k = b.k, groups = b.groups, panel_bytes = b.panel_bytes, ldo = b.ldo;
  float* out = b.out;
  for (int64_t g = 0; g < groups; ++g) {
    const Group in = group_of<Bits>(b, g);
    I acc[MR][NV];  // int32 sums; 4 bits: int16 sums of pairs until the group ends
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < NV; ++j) acc[r][j] = Pairs::zero();
    // Not unrolled: GCC then computes a whole group's products before adding them, and spills
    // them (4 bits, AVX2: 16 rows took 1.3x as long). 4 bits take one nibble of each byte at a
    // time, so only the codes being multiplied occupy registers beside the sums.
#pragma GCC unroll 1
    for (int64_t i = 0; i < kQuadsPerGroup / kQuadsPerVector; ++i) {
      for (int h = 0; h < kQuadsPerVector; ++h) {
        // 8 bits: q (signed) and |q|; 4 bits: the low (h = 0) or the high nibbles' codes
        I wv[2][NV];
        for (int j = 0; j < NV; ++j) {
          const uint8_t* at = in.w + (j / kVecs) * panel_bytes + i * kPanel * kQuad;
          if (h == 0 && j % kVecs == 0) prefetch_to_l2(at, NP * panel_bytes);  // the next tile
          const I v = Pairs::load(at + (j % kVecs) * kVecBytes);
          if constexpr (Bits == 8) {
            wv[0][j] = Pairs::flip(v, Pairs::bytes(static_cast<char>(0x80)));
            wv[1][j] = Pairs::magnitude(wv[0][j]);
          } else {
            wv[0][j] = h == 0 ? Pairs::both(v, Pairs::bytes(0x0f)) : Pairs::high_nibbles(v);
          }
        }
        for (int r = 0; r < MR; ++r) {
          int32_t quad_x;
          std::memcpy(&quad_x, in.x + r * k + (i * kQuadsPerVector + h) * kQuad, sizeof(quad_x));
          const I xv = Pairs::lanes(quad_x);
          for (int j = 0; j < NV; ++j) {
            if constexpr (Bits == 8) {
              const I pairs = Pairs::pair_sums(wv[1][j], Pairs::signed_by(xv, wv[0][j]));
              acc[r][j] = Pairs::add(acc[r][j], Pairs::widen_pairs(pairs));
            } else {
              acc[r][j] = Pairs::add_pairs(acc[r][j], Pairs::pair_sums(wv[0][j], xv));
            }
          }
        }
      }
    }
    // The scales once for all rows: stored through may_alias vectors, the outputs would
    // otherwise make the compiler load them again for every row.
    fVec scale[NV], low[NV];
    for (int j = 0; j < NV; ++j) {
      const int64_t at = (j / kVecs) * groups * kPanel + (j % kVecs) * fVec::size();
      const bool first = j % kVecs == 0;  // of a panel's vectors
      if (first) prefetch_to_l2(in.wscale + at, NP * groups * kPanel * sizeof(Scale));
      scale[j] = load_scales(in.wscale + at);
      if constexpr (Bits == 4) {
        const Scale* mins = b.mins + g * kPanel + at;
        if (first) prefetch_to_l2(mins, NP * groups * kPanel * sizeof(Scale));
        low[j] = load_scales(mins);
      }
    }
    for (int r = 0; r < MR; ++r) {
      const fVec xs(in.xscale[r * groups]);
      const fVec xsum_scaled(in.xscale[r * groups] * static_cast<float>(in.xsum[r * groups]));
      for (int j = 0; j < NV; ++j) {
        float* o = out + r * ldo + j * fVec::size();
        const I sums = Bits == 8 ? acc[r][j] : Pairs::widen_pairs(acc[r][j]);
        fVec sum = at::vec::fmadd(Pairs::to_float(sums), scale[j] * xs, fVec::loadu(o));
        if constexpr (Bits == 4) sum = at::vec::fmadd(low[j], xsum_scaled, sum);
        sum.store(o);
      }
    }
  }
}
#endif

template <Path P, int Bits, int NP, int MR>
void multiply_block(const Block& b) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (P == Path::kVnni) return dot_groups_vnni<Bits, NP, MR>(b);
#endif
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  if constexpr (P == Path::kPairs) return dot_groups_pairs<Bits, NP, MR>(b);
#endif
  if constexpr (P == Path::kFloat)
    for (int64_t g = 0; g < b.groups; ++g) multiply_group<Bits, NP, MR>(b, g);
}

// Blocks of NP panels x MR rows, down to 1 x 1: the row count and panel count of the last blocks
// fixed at compile time.
template <Path P, int Bits, int NP, int MR>
void multiply_rows(Block b, int64_t rows) {
  if constexpr (MR > 0) {
    for (; rows >= MR; rows -= MR, b.row += MR, b.out += MR * b.ldo)
      multiply_block<P, Bits, NP, MR>(b);
    if (rows > 0) multiply_rows<P, Bits, NP, MR - 1>(b, rows);
  }
}

// Threads split the panels (as panel_linear); each walks its share NP panels at a time, and each
// block of rows walks all of their groups (the tile's weights stay in L1 / L2 for the next block).
// Calls of at most few_rows rows take blocks of few_np panels x 1 row, others many_np x many_mr:
// the accumulators and the weight vectors of a block stay in the registers (32 with AVX-512, 16
// with AVX2).
struct Blocking {
  int few_rows, few_np, many_np, many_mr;
};
#if defined(CPU_CAPABILITY_AVX512)
// One row streams the weight: 8 panels of 8 bits, but 4 of 4 bits, whose scales and minimums are
// two more streams a panel (8 measured about 20% slower there). Many rows: VNNI's 8 bits fit 6
// rows of 4 panels, 4 bits (two vectors of weights a load) and the pairs path (q and |q|) 4.
constexpr Blocking blocking(Path p, int bits) {
  return {2, bits == 8 ? 8 : 4, 4, p == Path::kVnni && bits == 8 ? 6 : 4};
}
#elif defined(CPU_CAPABILITY_AVX2)
// One panel (2 vectors of weights, and |q| or the high nibbles) a block; a lm_head pass at 1 row
// measured about 1.5x faster than with 2 panels.
constexpr Blocking blocking(Path, int) {
  return {2, 1, 1, 4};
}
#else
constexpr Blocking blocking(Path, int) {
  return {0, 2, 2, 2};
}
#endif

// The weight's tensors as the kernel reads them.
struct Weight {
  const uint8_t* codes;
  const Scale* scales;
  const Scale* mins;  // 4 bits only
  int64_t panels;
};

template <Path P, int Bits, int NP, int MR, typename T>
void multiply(const QuantizedRows& x, int64_t rows, int64_t k, const Weight& w,
              const std::vector<float>& bias, T* out) {
  constexpr int64_t kCols = NP * kPanel;
  const int64_t n = w.panels * kPanel, groups = k / kGroup, panel_bytes = k * kPanel * Bits / 8;
  const int64_t grain = std::max<int64_t>(1, kMinWorkPerThread / (kPanel * k));
  at::parallel_for(0, w.panels, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> result(rows * kCols);
    for (int64_t first = begin; first < end; first += NP) {
      const int64_t np = std::min<int64_t>(NP, end - first);
      std::fill(result.begin(), result.end(), 0.0f);
      for (int64_t p = 0; p < np; p += (np == NP ? NP : 1)) {
        const int64_t at = (first + p) * groups * kPanel;
        const Block b{x,
                      k,
                      groups,
                      0,
                      w.codes + (first + p) * panel_bytes,
                      panel_bytes,
                      w.scales + at,
                      w.mins == nullptr ? nullptr : w.mins + at,
                      result.data() + p * kPanel,
                      kCols};
        if (np == NP) {
          multiply_rows<P, Bits, NP, MR>(b, rows);
        } else {  // the share's last, partial tile: one panel at a time
          multiply_rows<P, Bits, 1, MR>(b, rows);
        }
      }
      store_columns(result.data(), rows, kCols, np * kPanel, bias, first * kPanel, out, n);
    }
  });
}

template <Path P, int Bits, typename T>
void multiply_on(const QuantizedRows& x, int64_t rows, int64_t k, const Weight& w,
                 const std::vector<float>& bias, T* out) {
  constexpr Blocking kBlock = blocking(P, Bits);
  if (rows <= kBlock.few_rows) {
    multiply<P, Bits, kBlock.few_np, 1>(x, rows, k, w, bias, out);
  } else {
    multiply<P, Bits, kBlock.many_np, kBlock.many_mr>(x, rows, k, w, bias, out);
  }
}

template <int Bits, typename T>
void multiply_any(const QuantizedRows& x, int64_t rows, int64_t k, const Weight& w,
                  const std::vector<float>& bias, T* out) {
#if defined(CPU_CAPABILITY_AVX512)
  if (has_vnni()) return multiply_on<Path::kVnni, Bits>(x, rows, k, w, bias, out);
  multiply_on<Path::kPairs, Bits>(x, rows, k, w, bias, out);
#elif defined(CPU_CAPABILITY_AVX2)
  multiply_on<Path::kPairs, Bits>(x, rows, k, w, bias, out);
#else
  multiply_on<Path::kFloat, Bits>(x, rows, k, w, bias, out);
#endif
}

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                        const std::optional<at::Tensor>& mins,
                        const std::optional<at::Tensor>& bias) {
  checks::quant_linear_meta(x, weight, scales, mins, bias);
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous(), sc = scales.contiguous();
  const at::Tensor mc = mins ? mins->contiguous() : at::Tensor();
  const int64_t k = xc.size(-1), rows = xc.numel() / k, panels = wc.size(0);
  std::vector<int64_t> shape = xc.sizes().vec();
  shape.back() = panels * kPanel;
  at::Tensor out = at::empty(shape, xc.options());
  const std::vector<float> b = bias ? float_values(*bias) : std::vector<float>();
  const Weight w{wc.const_data_ptr<uint8_t>(), sc.const_data_ptr<Scale>(),
                 mins ? mc.const_data_ptr<Scale>() : nullptr, panels};
  DFLASH_DISPATCH_FLOATS(x.scalar_type(), "quant_linear", [&] {
    const QuantizedRows xq = quantize_rows(xc.const_data_ptr<scalar_t>(), rows, k);
    auto* op = out.mutable_data_ptr<scalar_t>();
    if (mins) {
      multiply_any<4>(xq, rows, k, w, b, op);
    } else {
      multiply_any<8>(xq, rows, k, w, b, op);
    }
  });
  return out;
}

}  // namespace
}  // namespace dflash::cpu::quant_linear

TORCH_LIBRARY_IMPL(dflash, CPU, m) {
  m.impl("quant_linear", &dflash::cpu::quant_linear::quant_linear);
}
