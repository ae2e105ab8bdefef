// CPU kernel for dflash::philox_bits (docs/design.md 3.3): the counter-based noise that sampling
// turns into rejection_sample's coins and races.
//
// Why it exists: the PyTorch reference computes Philox4x32-10 in about 240 tensor operations
// (32-bit products split so that int64 never overflows on any backend): about 1.5 ms on CPU for
// one race over a 49152-token vocabulary, and a sampled step draws two; here it is one pass of
// 64-bit integer arithmetic per counter (bench/bench_noise.py).
#include "cpu/common.h"

namespace dflash::cpu::philox {
namespace {

constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;  // multipliers
constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;  // Weyl key increments
constexpr int kRounds = 10;

// Philox4x32-10 of counter c under key (k0, k1), in place.
inline void philox4x32(uint32_t c[4], uint32_t k0, uint32_t k1) {
  for (int r = 0; r < kRounds; ++r) {
    const uint64_t p0 = static_cast<uint64_t>(kM0) * c[0];
    const uint64_t p1 = static_cast<uint64_t>(kM1) * c[2];
    const uint32_t next[4] = {
        static_cast<uint32_t>(p1 >> 32) ^ c[1] ^ k0, static_cast<uint32_t>(p1),
        static_cast<uint32_t>(p0 >> 32) ^ c[3] ^ k1, static_cast<uint32_t>(p0)};
    for (int w = 0; w < 4; ++w) c[w] = next[w];
    k0 += kW0;
    k1 += kW1;
  }
}

// The key and counter words are read here anyway, so they are checked whatever `check` says.
at::Tensor philox_bits(const at::Tensor& seeds, const at::Tensor& offsets, int64_t stream,
                       int64_t rows, int64_t n, bool /*check*/) {
  checks::philox_bits_meta(seeds, offsets, stream, rows, n);
  const at::Tensor s = seeds.contiguous(), o = offsets.contiguous();
  const int64_t count = s.size(0);
  const int64_t* seed = s.const_data_ptr<int64_t>();
  const int64_t* offset = o.const_data_ptr<int64_t>();
  checks::philox_bits_values(seed, 2 * count, "seeds");
  checks::philox_bits_values(offset, count, "offsets");
  at::Tensor out = at::empty({count, rows, n}, s.options());
  int64_t* words = out.mutable_data_ptr<int64_t>();
  const int64_t counters = (n + 3) / 4;
  const int64_t grain = std::max<int64_t>(1, (1 << 14) / std::max<int64_t>(counters, 1));
  at::parallel_for(0, count * rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t i = item / rows, j = item % rows;
      const auto k0 = static_cast<uint32_t>(seed[2 * i]),
                 k1 = static_cast<uint32_t>(seed[2 * i + 1]);
      int64_t* row = words + item * n;
      for (int64_t e = 0; e < counters; ++e) {
        uint32_t c[4] = {static_cast<uint32_t>(e), static_cast<uint32_t>(offset[i]),
                         static_cast<uint32_t>(stream), static_cast<uint32_t>(j)};
        philox4x32(c, k0, k1);
        for (int64_t w = 0; w < 4 && 4 * e + w < n; ++w) row[4 * e + w] = c[w];
      }
    }
  });
  return out;
}

}  // namespace
}  // namespace dflash::cpu::philox

TORCH_LIBRARY_IMPL(dflash, CPU, m) {
  m.impl("philox_bits", &dflash::cpu::philox::philox_bits);
}
