// The 16-bit float types of Ascend C device code, emulated as storage types with
// round-to-nearest-even conversion from float. They deliberately have no arithmetic operators:
// kernels compute in float (the A2 vector units cannot compute on bfloat16 at all).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__aarch64__)
// On aarch64 <arm_neon.h>, which torch's headers include, typedefs a global bfloat16_t (ACLE's
// __bf16) that the emulator's own bfloat16_t below would clash with. Include it first (its include
// guard makes later inclusions no-ops) and let the kernels' `bfloat16_t` name the emulator's type.
#include <arm_neon.h>
#define bfloat16_t dflash_emu_bfloat16_t
#endif

namespace dflash::emu {

inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t float_to_bf16(float f) {
  uint32_t u = float_bits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // quiet NaN
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

inline float bf16_to_float(uint16_t h) {
  return bits_float(static_cast<uint32_t>(h) << 16);
}

inline uint16_t float_to_half(float f) {
  uint32_t u = float_bits(f);
  uint32_t sign = (u >> 16) & 0x8000u;
  uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return static_cast<uint16_t>(sign | 0x7E00u);   // NaN
  if (a >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // >= 65520 rounds to inf
  if (a >= 0x38800000u) {                                              // normal half (>= 2^-14)
    uint32_t rounded = a + 0xFFFu + ((a >> 13) & 1u);                  // RNE on 13 dropped bits
    return static_cast<uint16_t>(sign | ((rounded - (112u << 23)) >> 13));  // rebias 127 -> 15
  }
  // Subnormal half: a multiple of 2^-24; scaling by 2^24 is exact, nearbyint rounds to even.
  float scaled = std::fabs(f) * 16777216.0f;
  return static_cast<uint16_t>(sign | static_cast<uint32_t>(std::nearbyint(scaled)));
}

inline float half_to_float(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1Fu, mant = h & 0x3FFu;
  if (exp == 0) {
    float v = static_cast<float>(mant) * (1.0f / 16777216.0f);
    return sign ? -v : v;
  }
  if (exp == 31) return bits_float(sign | 0x7F800000u | (mant << 13));
  return bits_float(sign | ((exp + 112u) << 23) | (mant << 13));
}

}  // namespace dflash::emu

struct half {
  uint16_t bits;
  half() = default;
  half(float f) : bits(dflash::emu::float_to_half(f)) {}  // NOLINT: implicit, as in device code
  explicit operator float() const { return dflash::emu::half_to_float(bits); }
};

struct bfloat16_t {
  uint16_t bits;
  bfloat16_t() = default;
  bfloat16_t(float f)
      : bits(dflash::emu::float_to_bf16(f)) {}  // NOLINT: implicit, as in device code
  explicit operator float() const { return dflash::emu::bf16_to_float(bits); }
};

static_assert(sizeof(half) == 2 && sizeof(bfloat16_t) == 2, "16-bit storage types");
