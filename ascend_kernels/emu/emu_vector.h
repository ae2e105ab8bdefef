// Level-2 (count form) vector instructions: elementwise, scalar, unary, Duplicate, Cast,
// Compare/Select and the reductions. Each one runs on pipe V and checks operand alignment,
// bounds and overlap, the A2 type rules and pipe synchronization before computing.
#pragma once

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <limits>

#include "emu_tensor.h"

namespace AscendC {

enum class RoundMode {
  CAST_NONE,
  CAST_RINT,
  CAST_FLOOR,
  CAST_CEIL,
  CAST_ROUND,
  CAST_TRUNC,
  CAST_ODD
};
enum class CMPMODE { LT, GT, EQ, LE, GE, NE };
enum class SELMODE { VSEL_CMPMASK_SPR, VSEL_TENSOR_SCALAR_MODE, VSEL_TENSOR_TENSOR_MODE };

namespace detail {

template <typename T>
constexpr bool is_16bit_float = std::is_same_v<T, half> || std::is_same_v<T, bfloat16_t>;

// Values are computed in float for the 16-bit types and rounded back once (RNE).
template <typename T>
using compute_t = std::conditional_t<is_16bit_float<T>, float, T>;

template <typename T>
compute_t<T> load(T v) {
  if constexpr (is_16bit_float<T>)
    return static_cast<float>(v);
  else
    return v;
}

template <typename T>
T store(compute_t<T> v) {
  if constexpr (is_16bit_float<T>)
    return T(v);
  else
    return v;
}

template <typename T>
struct identity {
  using type = T;
};

template <typename T>
void arithmetic(const char* op) {
  if constexpr (std::is_same_v<T, bfloat16_t>)
    dflash::emu::fail("bf16-arith", op,
                      " on bfloat16_t: the A2 vector unit has no bf16 arithmetic; Cast to ",
                      "float (RoundMode::CAST_NONE) first");
}

// One vector instruction: collects its operands, checks them, then records the UB accesses.
class VecInstr {
 public:
  explicit VecInstr(const char* name) : name_(name) {}

  template <typename T>
  VecInstr& src(const LocalTensor<T>& t, uint32_t bytes, uint32_t align = dflash::emu::kAlign) {
    return add(t, bytes, align, false);
  }
  template <typename T>
  VecInstr& dst(const LocalTensor<T>& t, uint32_t bytes, uint32_t align = dflash::emu::kAlign) {
    return add(t, bytes, align, true);
  }

  // Operands may not overlap, except a destination that is exactly one of the sources (in place).
  void run(bool in_place_ok = true) {
    for (const Operand& d : ops_) {
      if (!d.write) continue;
      for (const Operand& s : ops_) {
        if (&s == &d || s.begin >= d.begin + d.bytes || d.begin >= s.begin + s.bytes) continue;
        bool same =
            in_place_ok && !s.write && s.begin == d.begin && s.elem == d.elem && s.bytes == d.bytes;
        if (!same)
          dflash::emu::fail("overlap", name_, ": operands [", s.begin, ", ", s.begin + s.bytes,
                            ") and [", d.begin, ", ", d.begin + d.bytes,
                            ") of the UB overlap (only an identical in-place ",
                            "destination is allowed)");
      }
    }
    auto& h = dflash::emu::block().hazards();
    h.issue(dflash::emu::kV);
    for (const Operand& o : ops_)
      if (!o.write) h.read(dflash::emu::kV, o.begin, o.bytes, name_);
    for (const Operand& o : ops_)
      if (o.write) h.write(dflash::emu::kV, o.begin, o.bytes, name_);
  }

 private:
  struct Operand {
    uint32_t begin, bytes, elem;
    bool write;
  };

  template <typename T>
  VecInstr& add(const LocalTensor<T>& t, uint32_t bytes, uint32_t align, bool write) {
    ub_operand(t, bytes, name_, align);
    ops_.push_back({t.offset(), bytes, static_cast<uint32_t>(sizeof(T)), write});
    return *this;
  }

  const char* name_;
  std::vector<Operand> ops_;
};

// How A2's vector unit rounds: Div, Exp, Ln, Sqrt and Rsqrt within one ulp, not correctly, and
// subnormal operands and results flushed to zero. The emulation rounds correctly unless
// DFLASH_EMU_INEXACT is set (not "0"): then every vector arithmetic instruction flushes
// subnormals, and those five move each result by -1, 0 or +1 ulp of its type, chosen from its
// operands' bits (the same inputs give the same result), so a kernel whose claims assume
// correctly rounded math fails here as it would on the chip.
inline bool inexact_math() {
  const char* v = std::getenv("DFLASH_EMU_INEXACT");
  return v != nullptr && *v != '\0' && std::strcmp(v, "0") != 0;
}

// The smallest normal T: 2^-14 for half, float's for float and bfloat16_t.
template <typename T>
constexpr float min_normal() {
  return std::is_same_v<T, half> ? 6.103515625e-05f : std::numeric_limits<float>::min();
}

// x as the chip reads it: a subnormal is zero.
template <typename T>
compute_t<T> operand(T x) {
  const float v = load(x);
  return std::fabs(v) > 0.f && std::fabs(v) < min_normal<T>() ? std::copysign(0.f, v) : load(x);
}

template <typename T>
uint32_t bits_of(T v) {
  if constexpr (sizeof(T) == 4) {
    uint32_t u;
    std::memcpy(&u, &v, 4);
    return u;
  } else {
    uint16_t u;
    std::memcpy(&u, &v, 2);
    return u;
  }
}

// The chip's result for the correctly rounded `exact` (a T): a subnormal flushed, and for a
// `rough` instruction moved by -1, 0 or +1 ulp as `seed` picks (zeros, infinities and NaNs stay;
// no step leaves the normal finite range).
template <typename T>
T chip_result(T exact, bool rough, uint32_t seed) {
  const float v = load(exact);
  if (std::fabs(v) > 0.f && std::fabs(v) < min_normal<T>()) return store<T>(std::copysign(0.f, v));
  const int step = rough ? static_cast<int>((seed * 0x9E3779B1u) >> 30) % 3 - 1 : 0;
  if (!std::isfinite(v) || v == 0.f || step == 0) return exact;
  using U = std::conditional_t<sizeof(T) == 4, uint32_t, uint16_t>;
  U u = static_cast<U>(bits_of(exact));
  u = static_cast<U>(u + step);  // the magnitude moves one ulp (the sign bit is untouched)
  T moved;
  std::memcpy(&moved, &u, sizeof(T));
  const float m = load(moved);
  return std::isfinite(m) && std::fabs(m) >= min_normal<T>() ? moved : exact;
}

template <typename T, typename F>
void binary(const char* name, const LocalTensor<T>& dst, const LocalTensor<T>& a,
            const LocalTensor<T>& b, uint32_t count, F f, bool rough = false) {
  arithmetic<T>(name);
  const uint32_t bytes = count * sizeof(T);
  VecInstr(name).src(a, bytes).src(b, bytes).dst(dst, bytes).run();
  T *d = dst.data(), *x = a.data(), *y = b.data();
  if (inexact_math()) {
    for (uint32_t i = 0; i < count; ++i)
      d[i] = chip_result(store<T>(f(operand(x[i]), operand(y[i]))), rough,
                         bits_of(x[i]) * 31u + bits_of(y[i]));
    return;
  }
  for (uint32_t i = 0; i < count; ++i) d[i] = store<T>(f(load(x[i]), load(y[i])));
}

template <typename T, typename F>
void unary(const char* name, const LocalTensor<T>& dst, const LocalTensor<T>& a, uint32_t count,
           F f, bool rough = false) {
  arithmetic<T>(name);
  const uint32_t bytes = count * sizeof(T);
  VecInstr(name).src(a, bytes).dst(dst, bytes).run();
  T *d = dst.data(), *x = a.data();
  if (inexact_math()) {
    for (uint32_t i = 0; i < count; ++i)
      d[i] = chip_result(store<T>(f(operand(x[i]))), rough, bits_of(x[i]));
    return;
  }
  for (uint32_t i = 0; i < count; ++i) d[i] = store<T>(f(load(x[i])));
}

template <typename T>
void floating(const char* name) {
  static_assert(std::is_same_v<T, float> || is_16bit_float<T>, "half or float only");
  arithmetic<T>(name);
}

// Workspace the reductions need: one (value, index) pair per 256-byte repeat, in 32-byte units.
template <typename T>
uint32_t reduce_tmp_bytes(uint32_t count) {
  uint32_t repeats =
      (count * sizeof(T) + dflash::emu::kRepeatBytes - 1) / dflash::emu::kRepeatBytes;
  return dflash::emu::round_up(repeats * 2 * sizeof(T), dflash::emu::kAlign);
}

template <typename T>
void reduction(const char* name, const LocalTensor<T>& dst, const LocalTensor<T>& src,
               const LocalTensor<T>& tmp, uint32_t count, uint32_t dst_elems) {
  floating<T>(name);
  if (count == 0) dflash::emu::fail("ub-bounds", name, " of zero elements");
  VecInstr(name)
      .src(src, count * sizeof(T))
      .dst(tmp, reduce_tmp_bytes<T>(count))
      .dst(dst, dst_elems * sizeof(T), 2 * sizeof(T))
      .run(false);
}

// Index of the first extreme element: max (Better = greater) or min (Better = less).
template <typename T, typename Better>
void reduce_extreme(const char* name, const LocalTensor<T>& dst, const LocalTensor<T>& src,
                    const LocalTensor<T>& tmp, uint32_t count, bool cal_index, Better better) {
  reduction(name, dst, src, tmp, count, cal_index ? 2 : 1);
  const T* x = src.data();
  uint32_t best = 0;
  for (uint32_t i = 1; i < count; ++i)
    if (better(load(x[i]), load(x[best]))) best = i;
  T* d = dst.data();
  d[0] = x[best];
  if (cal_index) {  // the index is stored as the bits of an unsigned integer of T's width
    using Index = std::conditional_t<sizeof(T) == 4, uint32_t, uint16_t>;
    Index idx = static_cast<Index>(best);
    std::memcpy(&d[1], &idx, sizeof(T));
  }
}

}  // namespace detail

// ROUGH: the instruction is within one ulp on A2 (detail::inexact_math)
#define EMU_BINARY(NAME, EXPR, ROUGH)                                                          \
  template <typename T>                                                                        \
  void NAME(const LocalTensor<T>& dst, const LocalTensor<T>& src0, const LocalTensor<T>& src1, \
            uint32_t count) {                                                                  \
    detail::binary(#NAME, dst, src0, src1, count, [](auto a, auto b) { return EXPR; }, ROUGH); \
  }
// clang-format off
EMU_BINARY(Add, a + b, false)
EMU_BINARY(Sub, a - b, false)
EMU_BINARY(Mul, a * b, false)
EMU_BINARY(Div, a / b, true)
EMU_BINARY(Max, a > b ? a : b, false)
EMU_BINARY(Min, a < b ? a : b, false)
// clang-format on
#undef EMU_BINARY

#define EMU_SCALAR(NAME, EXPR)                                                  \
  template <typename T>                                                         \
  void NAME(const LocalTensor<T>& dst, const LocalTensor<T>& src,               \
            const typename detail::identity<T>::type& scalar, uint32_t count) { \
    auto b = detail::load(scalar);                                              \
    detail::unary(#NAME, dst, src, count, [b](auto a) { return EXPR; });        \
  }
// clang-format off
EMU_SCALAR(Adds, a + b)
EMU_SCALAR(Muls, a * b)
EMU_SCALAR(Maxs, a > b ? a : b)
// clang-format on
#undef EMU_SCALAR

#define EMU_UNARY(NAME, EXPR)                                                       \
  template <typename T>                                                             \
  void NAME(const LocalTensor<T>& dst, const LocalTensor<T>& src, uint32_t count) { \
    detail::floating<T>(#NAME);                                                     \
    detail::unary(#NAME, dst, src, count, [](auto a) { return EXPR; }, true);       \
  }
EMU_UNARY(Exp, std::exp(a))
EMU_UNARY(Ln, std::log(a))
EMU_UNARY(Sqrt, std::sqrt(a))
EMU_UNARY(Rsqrt, 1.0f / std::sqrt(a))
#undef EMU_UNARY

template <typename T>
void Duplicate(const LocalTensor<T>& dst, const typename detail::identity<T>::type& value,
               uint32_t count) {
  detail::VecInstr("Duplicate").dst(dst, count * sizeof(T)).run();
  T* d = dst.data();
  for (uint32_t i = 0; i < count; ++i) d[i] = value;
}

// float <-> half / bfloat16_t; narrowing rounds to nearest even (CAST_RINT, or CAST_NONE, which
// means the same for a lossy conversion).
template <typename D, typename S>
void Cast(const LocalTensor<D>& dst, const LocalTensor<S>& src, RoundMode mode, uint32_t count) {
  detail::VecInstr("Cast").src(src, count * sizeof(S)).dst(dst, count * sizeof(D)).run();
  const S* x = src.data();
  D* d = dst.data();
  if constexpr (std::is_same_v<S, float> && detail::is_16bit_float<D>) {
    if (mode != RoundMode::CAST_RINT && mode != RoundMode::CAST_NONE)
      dflash::emu::fail("cast", "float -> 16-bit float: only CAST_RINT / CAST_NONE are modelled");
    for (uint32_t i = 0; i < count; ++i) d[i] = D(x[i]);
  } else if constexpr (detail::is_16bit_float<S> && std::is_same_v<D, float>) {
    for (uint32_t i = 0; i < count; ++i) d[i] = static_cast<float>(x[i]);
  } else {
    static_assert(sizeof(D) == 0, "Cast between these types is not modelled");
  }
}

// dst bit i (little-endian within each byte) = cmp(src0[i], src1[i]). On A2 the count form works
// on whole 256-byte repeats, so count * sizeof(T) must be a multiple of 256.
template <typename T, typename U>
void Compare(const LocalTensor<U>& dst, const LocalTensor<T>& src0, const LocalTensor<T>& src1,
             CMPMODE mode, uint32_t count) {
  static_assert(std::is_same_v<U, uint8_t>, "Compare writes a uint8_t bit mask");
  detail::floating<T>("Compare");
  if (count * sizeof(T) % dflash::emu::kRepeatBytes)
    dflash::emu::fail("compare-256", "Compare of ", count, " x ", sizeof(T),
                      " bytes: the length must be a multiple ",
                      "of 256 bytes (pad the operands and compare whole repeats)");
  const uint32_t bytes = count * sizeof(T);
  detail::VecInstr("Compare").src(src0, bytes).src(src1, bytes).dst(dst, count / 8).run();
  const T *a = src0.data(), *b = src1.data();
  uint8_t* m = dst.data();
  std::memset(m, 0, count / 8);
  for (uint32_t i = 0; i < count; ++i) {
    auto x = detail::load(a[i]), y = detail::load(b[i]);
    bool bit = false;
    switch (mode) {
      case CMPMODE::LT:
        bit = x < y;
        break;
      case CMPMODE::GT:
        bit = x > y;
        break;
      case CMPMODE::EQ:
        bit = x == y;
        break;
      case CMPMODE::LE:
        bit = x <= y;
        break;
      case CMPMODE::GE:
        bit = x >= y;
        break;
      case CMPMODE::NE:
        bit = x != y;
        break;
    }
    if (bit) m[i / 8] |= static_cast<uint8_t>(1u << (i % 8));
  }
}

// dst[i] = mask bit i ? src0[i] : src1 (VSEL_TENSOR_SCALAR_MODE; the tensor-tensor mode is not
// modelled).
template <typename T, typename U>
void Select(const LocalTensor<T>& dst, const LocalTensor<U>& mask, const LocalTensor<T>& src0,
            const typename detail::identity<T>::type& src1, SELMODE mode, uint32_t count) {
  detail::floating<T>("Select");
  if (mode != SELMODE::VSEL_TENSOR_SCALAR_MODE)
    dflash::emu::fail("select", "a scalar src1 needs VSEL_TENSOR_SCALAR_MODE");
  const uint32_t bytes = count * sizeof(T);
  detail::VecInstr("Select").src(mask, (count + 7) / 8).src(src0, bytes).dst(dst, bytes).run();
  if (dflash::emu::block().used() > dflash::emu::kSelectReservedOffset)
    dflash::emu::fail(
        "select-reserved",
        "Select in tensor-scalar mode stores its scalar in the UB from "
        "byte ",
        dflash::emu::kSelectReservedOffset,
        " (the reserved last 8 KiB), but this kernel's "
        "buffers reach byte ",
        dflash::emu::block().used(),
        ": the scalar would overwrite them; plan at most 184 KiB where Select is used");
  const uint8_t* m = mask.template ReinterpretCast<uint8_t>().data();
  T *d = dst.data(), *a = src0.data();
  for (uint32_t i = 0; i < count; ++i) d[i] = (m[i / 8] >> (i % 8)) & 1 ? a[i] : src1;
}

namespace detail {

// A2's count-form ReduceSum adds the lanes of each repeat (256 bytes) as a binary tree of adjacent
// pairs (lanes past the count add as zeros), then the repeats' sums in order (the API docs'
// "mode 2" for the first-n form on A2). Sum is documented to add the same way within a repeat;
// across repeats the emulation takes ReduceSum's order.
template <typename T>
compute_t<T> tree_sum(const T* x, uint32_t count) {
  const uint32_t lanes = dflash::emu::kRepeatBytes / sizeof(T);
  compute_t<T> total = 0;
  for (uint32_t start = 0; start < count; start += lanes) {
    std::vector<compute_t<T>> v(lanes, compute_t<T>(0));
    for (uint32_t i = start; i < count && i < start + lanes; ++i) v[i - start] = load(x[i]);
    for (uint32_t width = lanes; width > 1; width /= 2)
      for (uint32_t i = 0; i < width / 2; ++i) v[i] = v[2 * i] + v[2 * i + 1];
    total = start ? total + v[0] : v[0];
  }
  return total;
}

}  // namespace detail

// dst[0] = sum, added in A2's tree order (detail::tree_sum).
template <typename T>
void ReduceSum(const LocalTensor<T>& dst, const LocalTensor<T>& src, const LocalTensor<T>& tmp,
               int32_t count) {
  detail::reduction("ReduceSum", dst, src, tmp, count, 1);
  dst.data()[0] = detail::store<T>(detail::tree_sum(src.data(), count));
}

// dst[0] = max; with calIndex dst[1] holds the bits of the (first) maximal element's index.
template <typename T>
void ReduceMax(const LocalTensor<T>& dst, const LocalTensor<T>& src, const LocalTensor<T>& tmp,
               int32_t count, bool calIndex = false) {
  detail::reduce_extreme("ReduceMax", dst, src, tmp, count, calIndex,
                         [](auto a, auto b) { return a > b; });
}

template <typename T>
void ReduceMin(const LocalTensor<T>& dst, const LocalTensor<T>& src, const LocalTensor<T>& tmp,
               int32_t count, bool calIndex = false) {
  detail::reduce_extreme("ReduceMin", dst, src, tmp, count, calIndex,
                         [](auto a, auto b) { return a < b; });
}

// Sum (high-level API): dst[i] = sum of the first n elements of row i of src [outter, inner], in
// float, in A2's tree order (detail::tree_sum). Rows are inner elements apart, and inner is what
// the documentation says it is: n elements rounded up to 32 bytes; dst covers outter elements rounded up to 32
// bytes and its lanes past outter are left unspecified (poisoned); src and dst may not overlap.
// The workspace size is our reading (one partial per 32-byte block of a row); on the NPU
// GetSumMaxMinTmpSize gives the real one.
struct SumParams {
  uint32_t outter = 1;
  uint32_t inner = 0;
  uint32_t n = 0;
};

template <typename T, int32_t reduceDim = -1, bool isReuseSource = false, bool isBasicBlock = false>
void Sum(const LocalTensor<T>& dst, const LocalTensor<T>& src, const LocalTensor<uint8_t>& tmp,
         const SumParams& p) {
  detail::floating<T>("Sum");
  if (p.outter == 0 || p.n == 0 || p.n > p.inner)
    dflash::emu::fail("sum", "Sum needs outter >= 1 and 1 <= n <= inner, got outter ", p.outter,
                      ", n ", p.n, ", inner ", p.inner);
  if (p.inner * sizeof(T) % dflash::emu::kAlign)
    dflash::emu::fail("sum", "Sum rows of inner = ", p.inner,
                      " elements are not a multiple of 32 bytes");
  const uint32_t aligned = dflash::emu::round_up(p.n * sizeof(T), dflash::emu::kAlign) / sizeof(T);
  if (p.inner != aligned)
    dflash::emu::fail("sum", "Sum rows of inner = ", p.inner, " elements for n = ", p.n,
                      ": the documented contract is inner = n rounded up to 32 bytes (", aligned,
                      ")");
  const uint32_t dst_bytes = dflash::emu::round_up(p.outter * sizeof(T), dflash::emu::kAlign);
  const uint32_t tmp_bytes = dflash::emu::round_up(
      (p.n * sizeof(T) + dflash::emu::kAlign - 1) / dflash::emu::kAlign * sizeof(T),
      dflash::emu::kAlign);
  detail::VecInstr("Sum")
      .src(src, p.outter * p.inner * sizeof(T))
      .dst(tmp, tmp_bytes)
      .dst(dst, dst_bytes)
      .run(false);
  const T* x = src.data();
  T* d = dst.data();
  for (uint32_t i = 0; i < p.outter; ++i)
    d[i] = detail::store<T>(detail::tree_sum(x + i * p.inner, p.n));
  for (uint32_t i = p.outter; i < dst_bytes / sizeof(T); ++i)
    std::memcpy(&d[i], &dflash::emu::kPoisonWord, sizeof(T));
}

}  // namespace AscendC
