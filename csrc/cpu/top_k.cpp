// CPU kernel for dflash::top_k (docs/design.md 3.3.1): each row's k largest entries, largest
// first and lower index first among equal ones (NaN above every number, as torch.sort and
// torch.max rank it), or their softmax probabilities.
//
// Why it exists: the engine takes the greedy token of every verified row, and the draft tree's
// candidates, from rows as wide as the vocabulary. On CPU, torch.max with indices reads a row of
// 49152 at about 3 cycles an element, torch.topk is slower still and softmax is another pass;
// here a row is read once against a threshold, the k-th best value so far, which a whole vector
// is compared with at once (it is almost never beaten once the row's first part has gone by),
// and the probabilities take one more pass (bench/bench_top_k.py).
#include <algorithm>
#include <cmath>
#include <numeric>

#include "cpu/common.h"

namespace dflash::cpu::top_k {
namespace {

using fVec = at::vec::Vectorized<float>;
constexpr int64_t kV = fVec::size();
// Up to this k the k best are kept sorted by insertion (O(k) per insertion, and a row of
// increasing values inserts every entry); larger k take a partial sort, O(V log k) for any row.
constexpr int64_t kMaxInsertionK = 32;

// The k best of x[0:n] into value / index, best first: x[i] enters when it beats the k-th best
// kept so far, so among equal values the earlier entry stays. Returns false at the first NaN
// (value / index then hold a part of the answer: the caller sorts instead).
bool select_by_insertion(const float* x, int64_t n, int64_t k, float* value, int64_t* index) {
  int64_t count = 0;
  const auto offer = [&](int64_t i) {
    if (std::isnan(x[i])) return false;
    if (count == k && !(x[i] > value[k - 1])) return true;
    int64_t p = count < k ? count++ : k - 1;
    for (; p > 0 && value[p - 1] < x[i]; --p) {
      value[p] = value[p - 1];
      index[p] = index[p - 1];
    }
    value[p] = x[i];
    index[p] = i;
    return true;
  };
  for (int64_t i = 0; i < k; ++i)
    if (!offer(i)) return false;
  fVec threshold(value[k - 1]);
  int64_t i = k;
  for (; i + kV <= n; i += kV) {
    // the lanes that beat the threshold or hold a NaN: those where `<=` is false (zero)
    uint32_t offered = static_cast<uint32_t>((fVec::loadu(x + i) <= threshold).zero_mask());
    if (offered == 0) continue;
    for (; offered != 0; offered &= offered - 1)
      if (!offer(i + __builtin_ctz(offered))) return false;
    threshold = fVec(value[k - 1]);
  }
  for (; i < n; ++i)
    if (!offer(i)) return false;
  return true;
}

// The same order for any k and any row: (value descending with NaN first, index ascending).
void select_by_sort(const float* x, int64_t n, int64_t k, float* value, int64_t* index) {
  std::vector<int64_t> order(n);
  std::iota(order.begin(), order.end(), int64_t{0});
  std::partial_sort(order.begin(), order.begin() + k, order.end(), [x](int64_t a, int64_t b) {
    const bool nan_a = std::isnan(x[a]), nan_b = std::isnan(x[b]);
    if (nan_a || nan_b) return nan_a && (!nan_b || a < b);
    return x[a] > x[b] || (x[a] == x[b] && a < b);
  });
  for (int64_t j = 0; j < k; ++j) {
    index[j] = order[j];
    value[j] = x[order[j]];
  }
}

// value[0:k] (the row's k best, value[0] its max) becomes their softmax probabilities over x
// (all NaN when the row holds a NaN, as softmax gives).
void to_probabilities(const float* x, int64_t n, int64_t k, float* value) {
  const fVec max(value[0]);
  fVec sums(0.f);
  int64_t i = 0;
  for (; i + kV <= n; i += kV) sums = sums + (fVec::loadu(x + i) - max).exp();
  if (i < n) sums = sums + fVec::set(fVec(0.f), (fVec::loadu(x + i, n - i) - max).exp(), n - i);
  const fVec total(at::vec::vec_reduce_all<float>([](fVec a, fVec b) { return a + b; }, sums));
  for (int64_t j = 0; j < k; j += kV) {
    const int64_t m = std::min(kV, k - j);
    ((fVec::loadu(value + j, m) - max).exp() / total).store(value + j, m);
  }
}

std::tuple<at::Tensor, at::Tensor> top_k(const at::Tensor& x, int64_t k, bool probs) {
  checks::top_k_meta(x, k);
  const at::Tensor xc = x.contiguous();
  const int64_t n = xc.size(-1), rows = xc.numel() / n;
  std::vector<int64_t> shape = xc.sizes().vec();
  shape.back() = k;
  at::Tensor values = at::empty(shape, xc.options().dtype(at::kFloat));
  at::Tensor indices = at::empty(shape, xc.options().dtype(at::kLong));
  float* vp = values.mutable_data_ptr<float>();
  int64_t* ip = indices.mutable_data_ptr<int64_t>();
  DFLASH_DISPATCH_FLOATS(x.scalar_type(), "top_k", [&] {
    const scalar_t* xp = xc.const_data_ptr<scalar_t>();
    for_each_row(rows, n, scratch_for<scalar_t>(n), [&](int64_t r, float* scratch) {
      const float* row = as_float(xp + r * n, scratch, n);
      float* value = vp + r * k;
      int64_t* index = ip + r * k;
      if (k > kMaxInsertionK || !select_by_insertion(row, n, k, value, index))
        select_by_sort(row, n, k, value, index);
      if (probs) to_probabilities(row, n, k, value);
    });
  });
  return {values, indices};
}

}  // namespace
}  // namespace dflash::cpu::top_k

TORCH_LIBRARY_IMPL(dflash, CPU, m) {
  m.impl("top_k", &dflash::cpu::top_k::top_k);
}
