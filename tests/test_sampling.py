"""The sampling layer (dflash/sampling.py) and the statistics of speculative sampling.

The property that justifies the whole op: whatever the proposal, the tokens emitted at every
position follow the target distribution. It is checked with a chi-square test (seeds fixed in
advance, significance 1e-3) over 200k sequences run as one batch, and with the total variation
distance, which for correct draws must stay below a bound that falls like 1/sqrt(n) (derived from
the chi-square quantile, at a stated significance). A negative control (a known bug, whose output
distribution is computed in closed form) fails both checks by a margin that chance cannot close.
"""

import math

import pytest
import torch
from scipy.stats import chi2

from dflash import ops, sampling
from dflash.sampling import SamplingParams, noise

N = 200_000
ALPHA = 1e-3


# ------------------------------------------------------------------------------ statistics

def chi_square_pvalue(tokens: torch.Tensor, p: torch.Tensor) -> float:
    """p-value of the tokens being draws from p (categories with expected count < 5 pooled)."""
    counts = torch.bincount(tokens, minlength=len(p)).double()
    if counts[p == 0].sum() > 0:
        return 0.0                               # a token the target never emits
    expected = p.double() / p.double().sum() * len(tokens)
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = ((obs - exp) ** 2 / exp).sum()
    df = torch.tensor(len(obs) - 1, dtype=torch.float64)
    return float(torch.special.gammaincc(df / 2, stat / 2))


def total_variation(tokens: torch.Tensor, p: torch.Tensor) -> float:
    """Total variation distance between the tokens' empirical distribution and p."""
    p = p.double() / p.double().sum()
    return float(0.5 * (torch.bincount(tokens, minlength=len(p)).double() / len(tokens) - p)
                 .abs().sum())


def tv_bound(p: torch.Tensor, n: int, alpha: float) -> float:
    """A distance n correct draws from p exceed with probability at most alpha (asymptotically).

    By Cauchy-Schwarz, TV = 1/2 sum_v |f_v - p_v| <= 1/2 sqrt(sum_v (f_v - p_v)^2 / p_v)
    = 1/2 sqrt(X2 / n), where X2 is Pearson's statistic over the V categories, chi-square with V - 1
    degrees of freedom for correct draws (close to it when every expected count n p_v is >= 5)."""
    return 0.5 * math.sqrt(chi2.isf(alpha, len(p) - 1) / n)


def emitted_at(out, num_accepted, i):
    """Tokens emitted at position i, by the sequences that got that far."""
    return out[num_accepted >= i, i]


def speculative_setup(v=20, k=3, seed=0):
    """Per-position target p [K+1, V] (one likely token, ~0.55) and draft q [K, V] close to p,
    so that enough of the 200k sequences reach the last position."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.empty(k + 1, v).uniform_(-1.5, 1.5, generator=g)
    logits[torch.arange(k + 1), torch.randint(0, v, (k + 1,), generator=g)] = 3.5
    p = torch.softmax(logits, -1)
    q = torch.softmax(logits[:k] + 0.5 * torch.randn(k, v, generator=g), -1)
    return p, q


def run_batch(p, drafts, draft_probs, seed=1):
    """Every row runs the same speculative step with its own noise (row i: seed + i)."""
    n = drafts.shape[0]
    return sampling.rejection_sample(drafts, draft_probs, p.expand(n, *p.shape),
                                     torch.zeros(n, dtype=torch.bool), range(seed, seed + n),
                                     [0] * n)


def sampled_drafts(q, n=N, seed=2):
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.multinomial(qi, n, replacement=True, generator=g) for qi in q], 1)


def argmax_drafts(q, n=N):
    return q.argmax(-1).expand(n, -1)


# proposal(p, q) -> (drafts, draft_probs passed to the op)
CORRECT = {
    "dense q, drafts sampled from q": lambda p, q: (sampled_drafts(q), q.expand(N, *q.shape)),
    "one-hot q, argmax drafts": lambda p, q: (argmax_drafts(q), None),
    # any draft choice independent of the step's noise works with one-hot q
    "one-hot q, drafts sampled from p": lambda p, q: (sampled_drafts(p[:-1]), None),
}
# The known bug of one production engine: drafts are argmax tokens (q is one-hot), yet the
# draft's softmax score of that token is used as q(x).
BUGGY = {"argmax drafts scored with softmax q":
         lambda p, q: (argmax_drafts(q), q.expand(N, *q.shape))}


@pytest.fixture(scope="module")
def runs():
    p, q = speculative_setup()
    results = {}
    for name, proposal in {**CORRECT, **BUGGY}.items():
        drafts, draft_probs = proposal(p, q)
        out, num_accepted = run_batch(p, drafts, draft_probs)
        results[name] = (p, out, num_accepted)
    return results


@pytest.mark.parametrize("name", CORRECT)
def test_emitted_tokens_follow_the_target_at_every_position(runs, name):
    p, out, num_accepted = runs[name]
    for i in range(len(p)):
        tokens = emitted_at(out, num_accepted, i)
        assert len(tokens) > 5_000, "design: enough sequences reach every position"
        assert chi_square_pvalue(tokens, p[i]) > ALPHA, f"position {i}"


@pytest.mark.parametrize("name", CORRECT)
def test_total_variation_stays_below_its_one_over_sqrt_n_bound(runs, name):
    """At every position, on prefixes of the draws 4x apart in size: TV(n) <= tv_bound(n), which
    falls like 1/sqrt(n). The sizes are those where every expected count is >= 5 (the chi-square
    regime); each check has significance ALPHA / (number of checks), so a correct sampler fails
    this test with probability at most ALPHA."""
    p, out, num_accepted = runs[name]
    checks = []
    for i in range(len(p)):
        tokens = emitted_at(out, num_accepted, i)
        sizes = [len(tokens) // 4**j for j in range(5)]
        sizes = [n for n in sizes if n * float(p[i].min()) >= 5]
        assert len(sizes) >= 2, "design: enough draws for two sizes 4x apart"
        checks += [(i, n, tokens[:n]) for n in sizes]
    for i, n, tokens in checks:
        assert total_variation(tokens, p[i]) <= tv_bound(p[i], n, ALPHA / len(checks)), (i, n)


def bug_first_position(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The distribution the BUGGY proposal emits at position 0, in closed form: the argmax draft
    x of q is accepted with probability min(1, p(x) / q(x)), else a token is drawn from the
    residual max(p - q, 0) (normalised)."""
    x = int(q.argmax())
    accept = min(1.0, float(p[x] / q[x]))
    residual = (p - q).clamp(min=0)
    out = (1 - accept) * residual / residual.sum()
    out[x] += accept
    return out


@pytest.mark.parametrize("name", BUGGY)
def test_negative_control_fails_both_checks(runs, name):
    p, out, num_accepted = runs[name]
    pvalues = [chi_square_pvalue(emitted_at(out, num_accepted, i), p[i]) for i in range(len(p))]
    assert min(pvalues) < ALPHA
    tokens = emitted_at(out, num_accepted, 0)
    bound = tv_bound(p[0], len(tokens), ALPHA)
    assert total_variation(tokens, p[0]) > bound
    # Not by chance: the draws follow the bug's own distribution, which is more than twice the
    # bound away from p; by the triangle inequality the TV check would pass only if the draws
    # strayed beyond the bound from their own distribution (probability < ALPHA).
    biased = bug_first_position(p[0], speculative_setup()[1][0])
    assert chi_square_pvalue(tokens, biased) > ALPHA
    assert 0.5 * float((biased - p[0]).abs().sum()) > 2 * bound


def test_acceptance_rate_is_the_overlap_of_p_and_q(runs):
    # P(accept position i | reached) = sum_v min(p_i, q_i) for dense q, p_i(x_i) for one-hot
    p, q = speculative_setup()
    for name, rate in (("dense q, drafts sampled from q", torch.minimum(p[:-1], q).sum(-1)),
                       ("one-hot q, argmax drafts", p[:-1].gather(1, q.argmax(-1, True))[:, 0])):
        _, out, num_accepted = runs[name]
        for i in range(len(q)):
            reached = num_accepted >= i
            got = (num_accepted[reached] > i).double().mean()
            sd = math.sqrt(rate[i] * (1 - rate[i]) / int(reached.sum()))
            assert abs(got - rate[i]) < 4 * sd, (name, i)


def test_output_layout(runs):
    _, out, num_accepted = runs["dense q, drafts sampled from q"]
    cols = torch.arange(out.shape[1])
    assert bool(((out >= 0) == (cols <= num_accepted[:, None])).all())   # -1 after the emitted


# ------------------------------------------------------------------------------- greedy

@pytest.mark.parametrize("drafts, best, expected, accepted", [
    ([1, 2, 3], [1, 2, 3, 4], [1, 2, 3, 4], 3),     # perfect match
    ([5, 2, 3], [1, 2, 3, 4], [1, -1, -1, -1], 0),  # first-position mismatch
    ([1, 5, 3], [1, 2, 3, 4], [1, 2, -1, -1], 1),   # middle mismatch
    ([4], [4, 0], [4, 0], 1),                        # K = 1
    ([3], [4, 0], [4, -1], 0),
])
def test_greedy_through_the_sampling_layer(drafts, best, expected, accepted):
    v = 8
    logits = torch.randn(1, len(best), v)
    logits[0, torch.arange(len(best)), torch.tensor(best)] = 10.0
    probs = sampling.target_probs(logits, [SamplingParams()])
    for seed in (0, 1):                               # greedy rows use no noise
        out, n = sampling.rejection_sample(torch.tensor([drafts]), None, probs,
                                           torch.tensor([True]), [seed], [0])
        assert out[0].tolist() == expected and n.tolist() == [accepted]


def test_verify_of_a_greedy_batch_equals_the_op_on_one_hot_targets():
    """The all-greedy shortcut (no probabilities) against rejection_sample of one-hot targets:
    every acceptance length 0..K, ties in the logits included."""
    g = torch.Generator().manual_seed(0)
    k, v = 5, 6   # a tiny vocabulary: drafts often match, logits often tie
    logits = torch.randint(0, 3, (64, k + 1, v), generator=g).float()
    best = logits.argmax(-1)
    drafts = torch.where(torch.rand(64, k, generator=g) < 0.8, best[:, :k],
                         torch.randint(0, v, (64, k), generator=g))
    params = [SamplingParams()] * 64
    out, n = sampling.verify(drafts, None, logits.view(-1, v), [k] * 64, params, [0] * 64,
                             [0] * 64)
    want_out, want_n = sampling.rejection_sample(drafts, None,
                                                 sampling.target_probs(logits, params),
                                                 torch.ones(64, dtype=torch.bool), [0] * 64,
                                                 [0] * 64)
    assert n == want_n.tolist() and out == [row[:a + 1] for row, a in zip(want_out.tolist(), n)]
    assert set(n) == set(range(k + 1))
    with pytest.raises(ValueError, match="target_ids must be"):
        sampling.greedy_accept(drafts, best[:, :k])


@pytest.mark.parametrize("mixed", [False, True])
def test_verify_without_drafts_emits_each_rows_argmax(mixed):
    """Plain decoding (every k = 0): one token per row, its argmax (first on ties), in an
    all-greedy batch (its shortcut) as in a batch with a sampled row (rejection_sample)."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randint(0, 4, (8, 50), generator=g).float()
    params = [SamplingParams()] * 8
    if mixed:
        params[3] = SamplingParams(temperature=0.7, seed=3)
    out, n = sampling.verify(torch.zeros(8, 15, dtype=torch.int64), None, logits, [0] * 8,
                             params, list(range(8)), [0] * 8)
    want = logits.argmax(-1).tolist()
    assert n == [0] * 8 and len(out) == 8 and all(len(row) == 1 for row in out)
    assert [row[0] for i, row in enumerate(out) if i != 3] == want[:3] + want[4:]


def test_greedy_follows_logits_argmax_through_near_ties():
    # two logits one float32 ulp apart: softmax rounds them to the same probability, the
    # one-hot target keeps the true argmax; exact ties go to the first index
    v = 1000
    logits = torch.full((1, 2, v), -20.0)
    logits[0, 0, 300] = 0.1
    logits[0, 0, 700] = torch.nextafter(torch.tensor(0.1), torch.tensor(1.0))
    logits[0, 1, [50, 60]] = 5.0
    soft = torch.softmax(logits[0, 0], -1)
    assert soft[300] == soft[700]                     # the trap the one-hot avoids
    probs = sampling.target_probs(logits, [SamplingParams()])
    out, _ = sampling.rejection_sample(torch.tensor([[700]]), None, probs, torch.tensor([True]),
                                       [0], [0])
    assert out[0].tolist() == [700, 50]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_first_argmax_is_argmax_with_many_ties(dtype):
    # values from a small set: every row has its maximum many times over a Qwen3-size vocabulary
    x = torch.randint(0, 8, (64, 151936), generator=torch.Generator().manual_seed(0)).to(dtype)
    x[3, 1000:2000] = float("nan")
    assert torch.equal(sampling.first_argmax(x), x.argmax(-1))
    assert sampling.first_argmax(x)[3] == 1000


# -------------------------------------------------------------------------- target_probs

def _naive_row(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """One row [V] the obvious way: sort, cut, renormalize (the test's independent oracle)."""
    if params.is_greedy:
        return torch.nn.functional.one_hot(logits.argmax(), len(logits)).float()
    x = logits.double() / params.temperature
    probs = torch.softmax(x, -1)
    order = sorted(range(len(x)), key=lambda t: (-float(x[t]), t))
    keep = set(order)
    if params.top_k:
        kth = float(x[order[min(params.top_k, len(x)) - 1]])
        keep = {t for t in keep if float(x[t]) >= kth}
    if params.top_p < 1:
        kept = [t for t in order if t in keep]
        mass = torch.softmax(x[kept], -1)
        total, chosen = 0.0, set()
        for t, m in zip(kept, mass.tolist()):
            if total >= params.top_p:
                break
            chosen.add(t)
            total += m
        keep = chosen
    mask = torch.tensor([t in keep for t in range(len(x))])
    probs = torch.where(mask, probs, 0.0)
    return (probs / probs.sum()).float()


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.3),
    SamplingParams(temperature=2.5, top_k=5),
    SamplingParams(temperature=1.0, top_p=0.6),
    SamplingParams(temperature=0.7, top_k=10, top_p=0.9),
    SamplingParams(temperature=1.0, top_k=1),
    SamplingParams(temperature=1.0, top_k=100),     # k >= V: no cut
    SamplingParams(),
], ids=str)
def test_target_probs_match_a_naive_per_row_oracle(params):
    logits = torch.randn(3, 4, 40, generator=torch.Generator().manual_seed(0)) * 2
    got = sampling.target_probs(logits, [params] * 3)
    assert got.dtype == torch.float32 and got.shape == logits.shape
    want = torch.stack([torch.stack([_naive_row(r, params) for r in seq]) for seq in logits])
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_target_probs_mixed_batch_equals_rows_alone():
    params = [SamplingParams(), SamplingParams(temperature=0.8, top_p=0.5),
              SamplingParams(temperature=1.2, top_k=3), SamplingParams(temperature=1.0),
              SamplingParams(temperature=0.5, top_k=7, top_p=0.8)]
    logits = torch.randn(5, 3, 30, generator=torch.Generator().manual_seed(1)).bfloat16()
    mixed = sampling.target_probs(logits, params)
    for b, pr in enumerate(params):
        torch.testing.assert_close(mixed[b], sampling.target_probs(logits[b : b + 1], [pr])[0],
                                   atol=0, rtol=0)
        torch.testing.assert_close(mixed[b], torch.stack([_naive_row(r.float(), pr)
                                                          for r in logits[b]]),
                                   atol=1e-6, rtol=1e-5)


def test_top_p_closed_form():
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])
    logits = probs.log()[None, None]
    got = sampling.target_probs(logits, [SamplingParams(temperature=1.0, top_p=0.75)])[0, 0]
    torch.testing.assert_close(got, torch.tensor([0.0, 0.625, 0.0, 0.375]))
    got = sampling.target_probs(logits, [SamplingParams(temperature=1.0, top_k=3)])[0, 0]
    torch.testing.assert_close(got, torch.tensor([0.0, 0.5, 0.15, 0.3]) / 0.95)


def test_target_probs_rejects_a_params_count_mismatch():
    with pytest.raises(ValueError, match="one row of params per sequence"):
        sampling.target_probs(torch.randn(2, 1, 5), [SamplingParams()])


# ----------------------------------------------------------------------- params and seeds

@pytest.mark.parametrize("change, message", [
    ({"temperature": -0.1}, "temperature must be a finite number >= 0"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_k": -1}, "top_k must be an integer >= 0"),
    ({"top_k": 2.5}, "top_k"),
    ({"top_p": 0.0}, "top_p must be in \\(0, 1\\]"),
    ({"top_p": 1.5}, "top_p"),
    ({"max_tokens": 0}, "max_tokens must be an integer >= 1"),
    ({"stop_token_ids": [3, -1]}, "stop_token_ids must be non-negative integers, got -1"),
    ({"seed": -5}, "seed must be None or an integer"),
    ({"seed": 1.5}, "seed"),
])
def test_sampling_params_reject_bad_values(change, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**change)


def test_sampling_params_defaults_and_greedy():
    assert SamplingParams().is_greedy and not SamplingParams(temperature=0.5).is_greedy
    assert SamplingParams(stop_token_ids=[1, 2]).stop_token_ids == (1, 2)


def test_request_seed_is_the_given_seed_or_fresh():
    assert sampling.request_seed(SamplingParams(seed=7)) == 7
    fresh = {sampling.request_seed(SamplingParams()) for _ in range(4)}
    assert len(fresh) == 4 and all(0 <= s < 2**64 for s in fresh)


def test_rejection_sample_uses_the_coin_and_target_race_streams():
    a = dict(draft_token_ids=torch.tensor([[3, 1, 4]]), draft_probs=None,
             target_probs=torch.softmax(torch.randn(1, 4, 50), -1), is_greedy=torch.tensor([False]))
    out = sampling.rejection_sample(**a, seeds=[11], offsets=[7])
    uniform = noise.uniform([11], [7], noise.COINS, 1, 3, "cpu")[:, 0]
    exponential = noise.exponential([11], [7], noise.TARGET_RACE, 1, 50, "cpu")[:, 0]
    want = ops.rejection_sample(**a, uniform=uniform, exponential=exponential)
    assert torch.equal(out[0], want[0]) and torch.equal(out[1], want[1])


def test_seeded_request_is_independent_of_its_batch():
    v, k = 64, 4
    p = torch.softmax(torch.randn(6, k + 1, v, generator=torch.Generator().manual_seed(3)), -1)
    drafts = torch.randint(0, v, (6, k), generator=torch.Generator().manual_seed(4))
    greedy = torch.tensor([False, True, False, False, True, False])
    seeds = [100, 101, 102, 103, 104, 105]
    offsets = [5, 9, 5, 0, 3, 12]
    batch = sampling.rejection_sample(drafts, None, p, greedy, seeds, offsets)
    for b in range(6):
        alone = sampling.rejection_sample(drafts[b : b + 1], None, p[b : b + 1], greedy[b : b + 1],
                                          seeds[b : b + 1], offsets[b : b + 1])
        assert torch.equal(batch[0][b], alone[0][0])
    by_seed = [sampling.rejection_sample(drafts, None, p, torch.zeros(6, dtype=torch.bool),
                                         [s] * 6, [0] * 6)[0]
               for s in range(4)]
    assert len({tuple(out.flatten().tolist()) for out in by_seed}) == 4


def test_seeds_and_offsets_must_match_rows():
    with pytest.raises(ValueError, match="one seed and one offset per row: 3 rows, got 1 seeds"):
        sampling.sample(torch.ones(3, 4), torch.zeros(3, dtype=torch.bool), [0], [0])


# ------------------------------------------------------------------------------ sample()

def test_sample_follows_probs_and_argmax_for_greedy():
    g = torch.Generator().manual_seed(5)
    p = torch.softmax(torch.randn(30, generator=g), -1)
    tokens = sampling.sample(p.expand(N, -1), torch.zeros(N, dtype=torch.bool), range(N), [0] * N)
    assert chi_square_pvalue(tokens, p) > ALPHA
    probs = torch.tensor([[0.1, 0.4, 0.4, 0.1], [0.3, 0.2, 0.1, 0.4]])
    greedy = sampling.sample(probs, torch.tensor([True, True]), [0, 0], [0, 0])
    assert greedy.tolist() == [1, 3]


def test_sample_seeded_rows_are_reproducible():
    probs = torch.softmax(torch.randn(4, 100), -1)
    draw = lambda: sampling.sample(probs, torch.zeros(4, dtype=torch.bool),  # noqa: E731
                                   range(4), [0] * 4)
    assert torch.equal(draw(), draw())


def test_tiny_temperatures_are_greedy_and_huge_top_k_keeps_every_token():
    """Edge values a client can send: a temperature that over- or underflows float32 logits is
    greedy (one-hot at the argmax, not NaN), and a top_k past the vocabulary (even past int64)
    keeps every token."""
    torch.manual_seed(0)
    logits = torch.randn(1, 3, 50)
    for t in (1e-45, 5e-324, 1e-6):
        p = sampling.target_probs(logits, [SamplingParams(temperature=t)])
        assert SamplingParams(temperature=t).is_greedy
        assert torch.equal(p, sampling.one_hot_argmax(logits))
    assert not SamplingParams(temperature=1e-4).is_greedy
    for k in (50, 51, 2**63, 2**80):
        p = sampling.target_probs(logits, [SamplingParams(temperature=0.7, top_k=k)])
        assert torch.equal(p, sampling.target_probs(logits, [SamplingParams(temperature=0.7)]))
    p = sampling.target_probs(logits, [SamplingParams(temperature=0.7, top_k=2**63, top_p=0.5)])
    assert torch.isfinite(p).all()
