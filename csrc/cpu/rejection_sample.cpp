// CPU kernel for dflash::rejection_sample (docs/design.md 3.3); dflash/ops/reference.py is the specification.
//
// The op is memory bound, and the sampling itself touches only a few rows per sequence.
// With check (the default, for direct calls) every probability is checked, in two parallel
// phases:
//   1. one vectorized pass over every row of target_probs, draft_probs and exponential, recording
//      which rows are invalid and, for greedy sequences, the argmax of each target row;
//   2. once all input is known valid, per sequence: the acceptance walk, then one fused pass that
//      computes the residual, its exponential race and whether it has any positive mass.
// Errors are raised between the phases with the reference's messages, in the reference's order.
// Without check (a caller that built the probabilities itself, like the engine) each sequence
// reads only what sampling needs: p[draft] and q[draft] position by position until the first
// rejection, then the residual's rows and its exponential row (or the bonus row), or for greedy
// sequences the target rows up to the first mismatch; it checks exactly the values it reads and
// reports a bad one with the same messages.
#include <algorithm>
#include <cmath>
#include <limits>

#include <ATen/cpu/vec/functional.h>

#include "cpu/common.h"
#include "out_variants.h"

namespace dflash::cpu::rejection_sample {
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

// Finiteness and minimum of the values a sequence reads, accumulated chunk by chunk.
struct Seen {
  Vec nan_sum = Vec(0.0f), lo = Vec(std::numeric_limits<float>::infinity());

  void add(const float* x, int64_t n) {
    const Vec zero(0.0f);
    auto put = [&](const Vec& v) {
      nan_sum = at::vec::fmadd(v, zero, nan_sum);
      lo = at::vec::clamp_max(v, lo);
    };
    int64_t i = 0;
    for (; i + W <= n; i += W) put(Vec::loadu(x + i));
    if (i < n) put(Vec::set(Vec(x[0]), Vec::loadu(x + i, n - i), n - i));  // x[0]: neutral
  }
  bool finite() const {
    return !std::isnan(at::vec::vec_reduce_all<float>([](Vec a, Vec b) { return a + b; }, nan_sum));
  }
  RowStatus probs() const { return !finite() ? kNonFinite : reduce_min(lo) < 0 ? kNegative : kOk; }
  bool noise_ok() const { return finite() && reduce_min(lo) > 0; }
};

// The rows a checked race read: p, q (dense residuals) and e.
struct RaceChecks {
  Seen p, q, e;
};

// ------------------------------------------------------------------------------------------
// Phase 2: the exponential race

// The smallest normal float: a residual below it everywhere counts as empty (docs/design.md 3.3),
// as hardware that flushes subnormals (Ascend's vector unit) sees no mass there.
constexpr float kMinNormal = std::numeric_limits<float>::min();

struct Race {
  int64_t token;  // argmax_v w[v] / e[v], first index on ties
  bool positive;  // any w[v] >= kMinNormal
};

// w = max(p - q, 0), or p with w[skip] = 0 when q is null (one-hot proposal); skip = -1: w = p.
// Divisions are IEEE float32 in both the vector and the scalar code, as in the reference. With
// `checks`, each chunk of p, q and e is also checked while it is in L1.
Race race(const float* p, const float* q, int64_t skip, const float* e, int64_t n,
          RaceChecks* checks = nullptr) {
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
    if (checks) {
      checks->p.add(p + c0, c1 - c0);
      if (q) checks->q.add(q + c0, c1 - c0);
      checks->e.add(e + c0, c1 - c0);
    }
    if (c0 <= skip && skip < c1) {  // the one chunk holding the zeroed draft: plain scalar loop
      for (int64_t i = c0; i < c1; ++i) {
        const float w = weight(i), r = w / e[i];
        positive |= w >= kMinNormal;
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
  positive |= reduce_max(w_hi) >= kMinNormal;
  return {token, positive};
}

// ------------------------------------------------------------------------------------------

// The inputs as raw pointers (contiguous), and the sizes.
struct Inputs {
  int64_t bs, k, v;
  const int64_t* ids;
  const float *p, *q, *u, *e;  // q: nullptr for one-hot proposals
  const bool* greedy;

  const float* p_row(int64_t b, int64_t i) const { return p + (b * (k + 1) + i) * v; }
  const float* q_row(int64_t b, int64_t i) const { return q + (b * k + i) * v; }
  const float* e_row(int64_t b) const { return e + b * v; }
};

// A value a sequence read that fails checks, in the terms of the full check's messages.
struct Failure {
  enum Kind : uint8_t { kNone, kTarget, kDraft, kNoise } kind = kNone;
  int64_t position = 0;
  RowStatus status = kOk;
};

RowStatus value_status(float x) {
  return !std::isfinite(x) ? kNonFinite : x < 0 ? kNegative : kOk;
}

// Where the walk of sequence b stops: a accepted drafts, then `token`.
struct Outcome {
  int64_t accepted = 0, token = 0;
};

// Sampling row b: accept x_a while u_a * q_a(x_a) < p_a(x_a) (float32 product, q = 1 for one-hot
// proposals), then the residual's race at the first rejection, else the bonus race. With
// `failure`, every value read is checked and the first bad one stops the walk.
Outcome sample(const Inputs& in, int64_t b, Failure* failure) {
  const int64_t* drafts = in.ids + b * in.k;
  Outcome o;
  int64_t& a = o.accepted;
  auto stop = [&](Failure::Kind kind, RowStatus status) {
    *failure = {kind, a, status};
    return o;
  };
  while (a < in.k) {
    const float p = in.p_row(b, a)[drafts[a]];
    const float q = in.q ? in.q_row(b, a)[drafts[a]] : 1.0f;
    if (failure) {
      if (value_status(p) != kOk) return stop(Failure::kTarget, value_status(p));
      if (value_status(q) != kOk) return stop(Failure::kDraft, value_status(q));
    }
    if (!(in.u[b * in.k + a] * q < p)) break;
    ++a;
  }
  RaceChecks seen;
  RaceChecks* checks = failure ? &seen : nullptr;
  const float* p_row = in.p_row(b, a);
  Race r;
  if (a < in.k) {
    r = in.q ? race(p_row, in.q_row(b, a), -1, in.e_row(b), in.v, checks)
             : race(p_row, nullptr, drafts[a], in.e_row(b), in.v, checks);
  } else {
    r = race(p_row, nullptr, -1, in.e_row(b), in.v, checks);
  }
  if (failure) {
    if (seen.p.probs() != kOk) return stop(Failure::kTarget, seen.p.probs());
    if (in.q && a < in.k && seen.q.probs() != kOk) return stop(Failure::kDraft, seen.q.probs());
    if (!seen.e.noise_ok()) return stop(Failure::kNoise, kOk);
  }
  // an empty residual falls back to p (a < K only: the bonus race takes p already)
  o.token = r.positive || a == in.k ? r.token : race(p_row, nullptr, -1, in.e_row(b), in.v).token;
  return o;
}

void write_row(const Inputs& in, int64_t b, const Outcome& o, int64_t* out, int64_t* num) {
  const int64_t* drafts = in.ids + b * in.k;
  int64_t* row = out + b * (in.k + 1);
  std::copy(drafts, drafts + o.accepted, row);
  row[o.accepted] = o.token;
  std::fill(row + o.accepted + 1, row + in.k + 1, int64_t{-1});
  num[b] = o.accepted;
}

[[noreturn]] void fail_probs(const char* name, int64_t b, int64_t i, RowStatus status) {
  RS_CHECK(false, name, " row (sequence ", b, ", position ", i, ") has ",
           status == kNonFinite ? "NaN/Inf" : "negative", " probabilities");
  std::abort();  // unreachable: RS_CHECK(false, ...) throws
}

[[noreturn]] void fail_noise(int64_t b) {
  RS_CHECK(false, "exponential row ", b, " must be positive and finite (Exp(1) noise)");
  std::abort();
}

// check: every probability and noise value is checked first (phase 1 above), as in the
// reference; else each sequence checks what it reads, and the first failure in the reference's
// order (target rows, draft rows, noise rows; lowest sequence first) is reported.
// Into `out_ids` / `num_out` (rejection_sample.out), or into new tensors when they are absent.
std::tuple<at::Tensor, at::Tensor> sample_into(
    const at::Tensor& draft_token_ids_, const std::optional<at::Tensor>& draft_probs_,
    const at::Tensor& target_probs_, const at::Tensor& is_greedy_, const at::Tensor& uniform_,
    const at::Tensor& exponential_, bool check, const std::optional<at::Tensor>& out_ids,
    const std::optional<at::Tensor>& num_out) {
  checks::rejection_sample_meta(draft_token_ids_, draft_probs_, target_probs_, is_greedy_, uniform_,
                                exponential_);
  if (out_ids) checks::rejection_sample_out(draft_token_ids_, *out_ids, *num_out);
  const at::Tensor ids_t = draft_token_ids_.contiguous(), p_t = target_probs_.contiguous(),
                   greedy_t = is_greedy_.contiguous(), u_t = uniform_.contiguous(),
                   e_t = exponential_.contiguous();
  const at::Tensor q_t = draft_probs_.has_value() ? draft_probs_->contiguous() : at::Tensor();
  const Inputs in{ids_t.size(0),
                  ids_t.size(1),
                  p_t.size(2),
                  ids_t.data_ptr<int64_t>(),
                  p_t.data_ptr<float>(),
                  q_t.defined() ? q_t.data_ptr<float>() : nullptr,
                  u_t.data_ptr<float>(),
                  e_t.data_ptr<float>(),
                  greedy_t.data_ptr<bool>()};
  const int64_t bs = in.bs, k = in.k, v = in.v;

  // checks.rejection_sample_values, part 1: token ids, before anything indexes with them
  checks::rejection_sample_ids(in.ids, bs, k, v);

  std::vector<int64_t> argmax(bs * (k + 1));  // greedy target rows' argmax, once computed
  std::vector<Failure> failures(bs);
  if (check) {
    // Phase 1 over rows [target rows | draft rows | exponential rows]
    const int64_t n_target = bs * (k + 1), n_draft = in.q ? bs * k : 0;
    std::vector<uint8_t> status(n_target + n_draft + bs);
    at::parallel_for(0, static_cast<int64_t>(status.size()), 1, [&](int64_t begin, int64_t end) {
      for (int64_t row = begin; row < end; ++row) {
        if (row < n_target) {
          const float* x = in.p + row * v;
          const RowScan s = in.greedy[row / (k + 1)] ? scan_row<true>(x, v) : scan_row<false>(x, v);
          status[row] = prob_status(s);
          argmax[row] = s.argmax;
        } else if (row < n_target + n_draft) {
          status[row] = prob_status(scan_row<false>(in.q + (row - n_target) * v, v));
        } else {
          const RowScan s = scan_row<false>(in.e + (row - n_target - n_draft) * v, v);
          status[row] = s.finite && s.lo > 0 ? kOk : kNonFinite;
        }
      }
    });
    // checks.rejection_sample_values, part 2, in the reference's order
    for (int64_t r = 0; r < n_target; ++r)
      if (status[r] != kOk)
        fail_probs("target_probs", r / (k + 1), r % (k + 1), RowStatus(status[r]));
    for (int64_t r = 0; r < n_draft; ++r)
      if (status[n_target + r] != kOk)
        fail_probs("draft_probs", r / k, r % k, RowStatus(status[n_target + r]));
    checks::rejection_sample_uniform(in.u, bs, k);
    for (int64_t b = 0; b < bs; ++b)
      if (status[n_target + n_draft + b] != kOk) fail_noise(b);
  } else {
    checks::rejection_sample_uniform(in.u, bs, k);  // Bs x K values, all of which may be read
  }

  // Phase 2 per sequence: about two rows of reads each, so a few sequences share one thread
  // (one sequence alone is not worth a fork-join)
  at::Tensor out = out_ids ? *out_ids : at::empty({bs, k + 1}, ids_t.options());
  at::Tensor num_accepted = num_out ? *num_out : at::empty({bs}, ids_t.options());
  int64_t* out_p = out.data_ptr<int64_t>();
  int64_t* num_p = num_accepted.data_ptr<int64_t>();
  at::parallel_for(0, bs, 4, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      Failure* failure = check ? nullptr : &failures[b];
      Outcome o;
      if (in.greedy[b]) {
        const int64_t* drafts = in.ids + b * k;
        int64_t* targets = argmax.data() + b * (k + 1);
        for (int64_t& a = o.accepted;; ++a) {
          if (!check) {  // the argmax of the rows up to the first mismatch only
            const RowScan s = scan_row<true>(in.p_row(b, a), v);
            targets[a] = s.argmax;
            if (prob_status(s) != kOk) {
              *failure = {Failure::kTarget, a, prob_status(s)};
              break;
            }
          }
          if (a == k || drafts[a] != targets[a]) break;
        }
        o.token = targets[o.accepted];
      } else {
        o = sample(in, b, failure);
      }
      write_row(in, b, o, out_p, num_p);
    }
  });
  for (auto kind : {Failure::kTarget, Failure::kDraft, Failure::kNoise}) {
    for (int64_t b = 0; b < bs; ++b) {
      const Failure& f = failures[b];
      if (f.kind != kind) continue;
      if (kind == Failure::kNoise) fail_noise(b);
      fail_probs(kind == Failure::kTarget ? "target_probs" : "draft_probs", b, f.position,
                 f.status);
    }
  }
  return {out, num_accepted};
}

}  // namespace
}  // namespace dflash::cpu::rejection_sample

TORCH_LIBRARY_IMPL(dflash, CPU, m) {
  using dflash::cpu::rejection_sample::sample_into;
  m.impl("rejection_sample", &dflash::variants::rejection_sample<sample_into>);
  m.impl("rejection_sample.out", &dflash::variants::rejection_sample_out<sample_into>);
}
