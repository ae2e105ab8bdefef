// CPU kernel for dflash::rejection_sample (docs/design.md 3.3); dflash/reference.py is the specification.
//
// The op is memory bound: validation must read every probability once, and the sampling itself
// touches only a few rows per sequence. So it runs in two parallel phases:
//   1. one vectorized pass over every row of target_probs, draft_probs and exponential, recording
//      which rows are invalid and, for greedy sequences, the argmax of each target row;
//   2. once all input is known valid, per sequence: the acceptance walk, then one fused pass that
//      computes the residual, its exponential race and whether it has any positive mass.
// Errors are raised between the phases with the reference's messages, in the reference's order.
#include <algorithm>
#include <cmath>
#include <limits>

#include <ATen/cpu/vec/functional.h>

#include "cpu/common.h"

namespace dflash::rejection_sample_cpu {
namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t W = Vec::size();
// Rows are processed in chunks that stay in L1, so finding the first index of a chunk's maximum
// re-reads cached data; it happens only when the running maximum improves.
constexpr int64_t kChunk = 2048;

#define RS_CHECK(cond, ...) DFLASH_CHECK(cond, "rejection_sample", __VA_ARGS__)

// ------------------------------------------------------------------------------------------
// Phase 1: one pass per row

float reduce_max(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](Vec a, Vec b) { return at::vec::maximum(a, b); }, v);
}
float reduce_min(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](Vec a, Vec b) { return at::vec::minimum(a, b); }, v);
}

struct RowScan {
  bool finite;     // no NaN or Inf
  float lo;        // minimum (meaningful when finite)
  int64_t argmax;  // first index of the maximum, when requested (and finite)
};

// Per vector: one FMA (x * 0 is NaN exactly for NaN / Inf x, and NaN sticks in the sum), one
// min, and for argmax rows one max; U independent accumulators hide their latency.
template <bool kArgmax>
RowScan scan_row(const float* x, int64_t n) {
  constexpr int U = 4;
  const Vec zero(0.0f);
  Vec nan_sum[U], lo[U], hi[U];
  float best = -1.0f;
  int64_t argmax = 0;
  std::fill(nan_sum, nan_sum + U, zero);
  std::fill(lo, lo + U, Vec(x[0]));
  for (int64_t c0 = 0; c0 < n; c0 += kChunk) {
    const int64_t c1 = std::min(n, c0 + kChunk);
    std::fill(hi, hi + U, Vec(x[c0]));
    auto add = [&](int u, const Vec& v) {
      nan_sum[u] = at::vec::fmadd(v, zero, nan_sum[u]);
      lo[u] = at::vec::clamp_max(v, lo[u]);
      if constexpr (kArgmax) hi[u] = at::vec::clamp_min(v, hi[u]);
    };
    int64_t i = c0;
    for (; i + U * W <= c1; i += U * W)
      for (int u = 0; u < U; ++u) add(u, Vec::loadu(x + i + u * W));
    for (; i + W <= c1; i += W) add(0, Vec::loadu(x + i));
    if (i < c1)  // pad the partial vector with x[c0], neutral for min and max
      add(0, Vec::set(Vec(x[c0]), Vec::loadu(x + i, c1 - i), c1 - i));
    if constexpr (kArgmax) {
      for (int u = 1; u < U; ++u) hi[0] = at::vec::clamp_min(hi[0], hi[u]);
      const float m = reduce_max(hi[0]);
      if (m > best) {  // strict: an equal maximum in a later chunk is not the first index
        best = m;
        argmax = std::find(x + c0, x + c1, m) - x;
      }
    }
  }
  for (int u = 1; u < U; ++u) {
    nan_sum[0] += nan_sum[u];
    lo[0] = at::vec::minimum(lo[0], lo[u]);
  }
  const float sum = at::vec::vec_reduce_all<float>([](Vec a, Vec b) { return a + b; }, nan_sum[0]);
  return {!std::isnan(sum), reduce_min(lo[0]), argmax};
}

enum RowStatus : uint8_t { kOk, kNonFinite, kNegative };

RowStatus prob_status(const RowScan& s) {
  return !s.finite ? kNonFinite : s.lo < 0 ? kNegative : kOk;
}

// ------------------------------------------------------------------------------------------
// Phase 2: the exponential race

struct Race {
  int64_t token;  // argmax_v w[v] / e[v], first index on ties
  bool positive;  // any w[v] > 0
};

// w = max(p - q, 0), or p with w[skip] = 0 when q is null (one-hot proposal); skip = -1: w = p.
// Divisions are IEEE float32 in both the vector and the scalar code, as in the reference.
Race race(const float* p, const float* q, int64_t skip, const float* e, int64_t n) {
  auto weight = [&](int64_t v) {
    return q ? std::max(p[v] - q[v], 0.0f) : (v == skip ? 0.0f : p[v]);
  };
  const Vec zero(0.0f);
  auto weights = [&](int64_t i, int64_t count) {  // lanes past count are 0: neutral here
    const Vec pv = Vec::loadu(p + i, count);
    return q ? at::vec::clamp_min(pv - Vec::loadu(q + i, count), zero) : pv;
  };
  float best = -1.0f;  // every ratio is >= 0
  int64_t token = 0;
  bool positive = false;
  Vec w_hi = zero;
  for (int64_t c0 = 0; c0 < n; c0 += kChunk) {
    const int64_t c1 = std::min(n, c0 + kChunk);
    if (c0 <= skip && skip < c1) {  // the one chunk holding the zeroed draft: plain scalar loop
      for (int64_t i = c0; i < c1; ++i) {
        const float w = weight(i), r = w / e[i];
        positive |= w > 0;
        if (r > best) best = r, token = i;
      }
      continue;
    }
    Vec r_hi = zero;
    auto accumulate = [&](const Vec& w, const Vec& ev) {
      w_hi = at::vec::clamp_min(w, w_hi);  // plain max: no NaN here
      r_hi = at::vec::clamp_min(w / ev, r_hi);
    };
    int64_t i = c0;
    for (; i + W <= c1; i += W) accumulate(weights(i, W), Vec::loadu(e + i));
    if (i < c1)  // padding lanes hold 0 / 1
      accumulate(weights(i, c1 - i), Vec::set(Vec(1.0f), Vec::loadu(e + i, c1 - i), c1 - i));
    const float m = reduce_max(r_hi);
    if (m > best) {  // strict: an equal ratio in a later chunk is not the first index
      best = m;
      i = c0;
      while (i < c1 && weight(i) / e[i] != m) ++i;
      token = i;
    }
  }
  positive |= reduce_max(w_hi) > 0;
  return {token, positive};
}

// ------------------------------------------------------------------------------------------

std::tuple<at::Tensor, at::Tensor> rejection_sample(
    const at::Tensor& draft_token_ids_, const std::optional<at::Tensor>& draft_probs_,
    const at::Tensor& target_probs_, const at::Tensor& is_greedy_, const at::Tensor& uniform_,
    const at::Tensor& exponential_) {
  checks::rejection_sample_meta(draft_token_ids_, draft_probs_, target_probs_, is_greedy_,
                                uniform_, exponential_);
  const int64_t bs = draft_token_ids_.size(0), k = draft_token_ids_.size(1);
  const int64_t v = target_probs_.size(2);
  const bool dense = draft_probs_.has_value();

  const at::Tensor ids_t = draft_token_ids_.contiguous(), p_t = target_probs_.contiguous(),
                   greedy_t = is_greedy_.contiguous(), u_t = uniform_.contiguous(),
                   e_t = exponential_.contiguous();
  const at::Tensor q_t = dense ? draft_probs_->contiguous() : at::Tensor();
  const int64_t* ids = ids_t.data_ptr<int64_t>();
  const float* p = p_t.data_ptr<float>();
  const float* q = dense ? q_t.data_ptr<float>() : nullptr;
  const bool* greedy = greedy_t.data_ptr<bool>();
  const float* u = u_t.data_ptr<float>();
  const float* e = e_t.data_ptr<float>();

  // checks.rejection_sample_values, part 1: token ids, before anything indexes with them
  checks::rejection_sample_ids(ids, bs, k, v);

  // Phase 1 over rows [target rows | draft rows | exponential rows]
  const int64_t n_target = bs * (k + 1), n_draft = dense ? bs * k : 0;
  std::vector<uint8_t> status(n_target + n_draft + bs);
  std::vector<int64_t> argmax(n_target);
  at::parallel_for(0, static_cast<int64_t>(status.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      if (row < n_target) {
        const float* x = p + row * v;
        const RowScan s = greedy[row / (k + 1)] ? scan_row<true>(x, v) : scan_row<false>(x, v);
        status[row] = prob_status(s);
        argmax[row] = s.argmax;
      } else if (row < n_target + n_draft) {
        status[row] = prob_status(scan_row<false>(q + (row - n_target) * v, v));
      } else {
        const RowScan s = scan_row<false>(e + (row - n_target - n_draft) * v, v);
        status[row] = s.finite && s.lo > 0 ? kOk : kNonFinite;
      }
    }
  });

  // checks.rejection_sample_values, part 2, in the reference's order
  auto check_probs = [&](const char* name, int64_t first, int64_t rows, int64_t per_seq) {
    for (int64_t r = 0; r < rows; ++r)
      RS_CHECK(status[first + r] == kOk, name, " row (sequence ", r / per_seq, ", position ",
               r % per_seq, ") has ", status[first + r] == kNonFinite ? "NaN/Inf" : "negative",
               " probabilities");
  };
  check_probs("target_probs", 0, n_target, k + 1);
  check_probs("draft_probs", n_target, n_draft, k);
  checks::rejection_sample_uniform(u, bs, k);
  for (int64_t b = 0; b < bs; ++b)
    RS_CHECK(status[n_target + n_draft + b] == kOk, "exponential row ", b,
             " must be positive and finite (Exp(1) noise)");

  // Phase 2 per sequence: about two rows of reads each, so a few sequences share one thread
  // (one sequence alone is not worth a fork-join)
  at::Tensor out = at::empty({bs, k + 1}, ids_t.options());
  at::Tensor num_accepted = at::empty({bs}, ids_t.options());
  int64_t* out_p = out.data_ptr<int64_t>();
  int64_t* num_p = num_accepted.data_ptr<int64_t>();
  at::parallel_for(0, bs, 4, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t* drafts = ids + b * k;
      int64_t a = 0, token;
      if (greedy[b]) {
        const int64_t* targets = argmax.data() + b * (k + 1);
        while (a < k && drafts[a] == targets[a]) ++a;
        token = targets[a];
      } else {
        auto p_row = [&](int64_t i) { return p + (b * (k + 1) + i) * v; };
        // float32 product, as in the reference (q = 1 for one-hot proposals)
        while (a < k) {
          const float coin = dense ? u[b * k + a] * q[(b * k + a) * v + drafts[a]] : u[b * k + a];
          if (!(coin < p_row(a)[drafts[a]])) break;
          ++a;
        }
        const float* e_row = e + b * v;
        if (a < k) {
          const Race r = dense ? race(p_row(a), q + (b * k + a) * v, -1, e_row, v)
                               : race(p_row(a), nullptr, drafts[a], e_row, v);
          token = r.positive ? r.token : race(p_row(a), nullptr, -1, e_row, v).token;
        } else {
          token = race(p_row(k), nullptr, -1, e_row, v).token;
        }
      }
      int64_t* row = out_p + b * (k + 1);
      std::copy(drafts, drafts + a, row);
      row[a] = token;
      std::fill(row + a + 1, row + k + 1, int64_t{-1});
      num_p[b] = a;
    }
  });
  return {out, num_accepted};
}

}  // namespace
}  // namespace dflash::rejection_sample_cpu

TORCH_LIBRARY_IMPL(dflash, CPU, m) {
  m.impl("rejection_sample", &dflash::rejection_sample_cpu::rejection_sample);
}
