"""The C++ CPU kernel of dflash::rejection_sample against the reference (docs/design.md 3.3).

Given the same noise the kernel must return exactly the reference's tokens (torch.equal), with
every check and with `check=False` (which reads only what sampling needs), and for bad
input exactly the reference's error message.
"""

import pytest
import torch

import dflash
from dflash.ops import reference
from dflash.ops.cases import rejection_sample_inputs

kernel = torch.ops.dflash.rejection_sample


def assert_same(args):
    want = reference.rejection_sample(**args)
    for check in (True, False):
        got = kernel(**args, check=check)
        assert got[0].dtype == got[1].dtype == torch.int64
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (check, got, want)
    return got


def assert_same_error(args):
    with pytest.raises(ValueError) as want:
        reference.rejection_sample(**args)
    with pytest.raises(ValueError) as got:
        kernel(**args)
    assert str(got.value) == str(want.value)


def test_cpu_kernel_serves_the_op():
    assert dflash.ops.implementation("rejection_sample").startswith("kernel")


@pytest.mark.parametrize("dense", [True, False], ids=["dense", "one_hot"])
@pytest.mark.parametrize("k", [1, 3, 7, 15])
@pytest.mark.parametrize("v", [7, 1000])
def test_matches_reference_on_random_batches(v, k, dense):
    for seed in range(8):
        g = torch.Generator().manual_seed(seed)
        bs = int(torch.randint(1, 65, (1,), generator=g))
        assert_same(rejection_sample_inputs(
            bs=bs, k=k, v=v, dense=dense, seed=seed, greedy_every=1 + seed % 3,
            peaked=seed % 2 == 0, draft_noise=(0.0, 0.3, 1.0, 3.0)[seed % 4]))


@pytest.mark.parametrize("dense", [True, False], ids=["dense", "one_hot"])
@pytest.mark.parametrize("k", [1, 3, 7, 15])
def test_matches_reference_at_full_vocabulary(k, dense):
    for seed, bs in ((0, 1), (1, 3)):
        assert_same(rejection_sample_inputs(bs=bs, k=k, v=151936, dense=dense, seed=seed,
                                            draft_noise=0.3))


@pytest.mark.slow
@pytest.mark.parametrize("dense", [True, False], ids=["dense", "one_hot"])
def test_matches_reference_at_full_vocabulary_large_batches(dense):
    for seed, (bs, k) in enumerate([(16, 15), (64, 7), (64, 15)]):
        assert_same(rejection_sample_inputs(bs=bs, k=k, v=151936, dense=dense, seed=seed,
                                            draft_noise=0.3))


def test_matches_reference_on_unnormalized_and_sparse_rows():
    # the op takes any finite non-negative weights: huge, tiny, exact zeros and -0.0
    for seed in range(6):
        a = rejection_sample_inputs(bs=16, k=3, v=5000, seed=seed, greedy_every=3)
        g = torch.Generator().manual_seed(seed)
        scale = torch.tensor([1e-30, 1.0, 1e30])[torch.randint(0, 3, (16, 1, 1), generator=g)]
        for name in ("target_probs", "draft_probs"):
            x = a[name] * scale[:, : a[name].shape[1]]
            x[torch.rand(x.shape, generator=g) < 0.5] = 0.0
            x[torch.rand(x.shape, generator=g) < 0.1] = -0.0
            a[name] = x
        assert_same(a)
        assert_same({**a, "draft_probs": None})


# ------------------------------------------------------------------- closed-form cases

def _one_row(drafts, p, q=None, greedy=False, uniform=None, exponential=None):
    """Kernel and reference on one sequence; returns the kernel's (tokens, num_accepted)."""
    k, v = len(drafts), p.shape[-1]
    out, n = assert_same(dict(
        draft_token_ids=torch.tensor([drafts], dtype=torch.long).view(1, k),
        draft_probs=None if q is None else q[None],
        target_probs=p[None],
        is_greedy=torch.tensor([greedy]),
        uniform=torch.full((1, k), 0.5) if uniform is None else torch.tensor([uniform]),
        exponential=torch.ones(1, v) if exponential is None else exponential[None]))
    return out[0].tolist(), int(n[0])


@pytest.mark.parametrize("drafts, targets, expected, accepted", [
    ([1, 2, 3], [1, 2, 3, 4], [1, 2, 3, 4], 3),     # perfect match: 3 drafts + bonus
    ([5, 2, 3], [1, 2, 3, 4], [1, -1, -1, -1], 0),  # first-position mismatch: correction only
    ([1, 5, 3], [1, 2, 3, 4], [1, 2, -1, -1], 1),   # middle mismatch
    ([1, 2, 5], [1, 2, 3, 4], [1, 2, 3, -1], 2),    # last-draft mismatch
    ([4], [4, 0], [4, 0], 1),                        # K = 1
    ([3], [4, 0], [4, -1], 0),
])
@pytest.mark.parametrize("v", [6, 5000])
def test_greedy_rows_emit_accepted_drafts_then_argmax(drafts, targets, expected, accepted, v):
    p = 0.1 + 0.5 * torch.nn.functional.one_hot(torch.tensor(targets), v).float()
    assert _one_row(drafts, p, greedy=True) == (expected, accepted)
    # a greedy row ignores its noise and any dense q
    q = torch.softmax(torch.randn(len(drafts), v), -1)
    assert _one_row(drafts, p, q=q, greedy=True, uniform=[0.99] * len(drafts),
                    exponential=torch.rand(v) + 0.01) == (expected, accepted)


def test_greedy_ties_take_the_first_index_across_chunks():
    v = 10000
    p = torch.full((2, v), 0.5)
    p[0, [4100, 2049, 9000]] = 2.0      # maxima in three different 2048-wide chunks
    p[1, [7, 8]] = 3.0                  # and two in one chunk
    assert _one_row([2049], p, greedy=True) == ([2049, 7], 1)
    assert _one_row([4100], p, greedy=True) == ([2049, -1], 0)


def test_race_ties_take_the_first_index():
    v = 10000
    p = torch.full((1, v), 0.25)
    e = torch.full((v,), 2.0)
    e[[6000, 3000, 9999]] = 1.0         # equal best ratios in different chunks
    assert _one_row([], p, exponential=e) == ([3000], 0)
    e[[6000, 3000, 9999]] = 1e-45       # ratio 0.25 / denormal = inf, three times
    assert _one_row([], p, exponential=e) == ([3000], 0)


@pytest.mark.parametrize("draft", [0, 2047, 2048, 4095, 4096, 4999])
def test_one_hot_residual_zeroes_the_draft_in_any_chunk(draft):
    v = 5000
    p = torch.full((2, v), 1e-3)
    p[0, draft] = 0.5
    e = torch.ones(v)
    e[draft] = 1e-6                     # the draft would win the race if it were not zeroed
    tokens, n = _one_row([draft], p, uniform=[0.9], exponential=e)   # 0.9 >= 0.5: rejected
    assert n == 0 and tokens[0] == (1 if draft == 0 else 0)


def test_all_zero_residual_falls_back_to_p():
    v = 3000
    p = torch.zeros(2, v)
    p[0, 2500] = 0.5                    # unnormalized: all mass on the draft
    p[1] = 1.0
    e = torch.ones(v)
    assert _one_row([2500], p, uniform=[0.7]) == ([2500, -1], 0)     # one-hot
    q = p[:1].clone()                   # dense, q = p: the residual is zero everywhere
    q[0, 100] = 1.0                     # p(100) = 0 < q(100): rejecting 100 leaves no residual
    assert _one_row([100], p, q=q, uniform=[0.0], exponential=e) == ([2500, -1], 0)


def test_a_subnormal_residual_is_empty_and_a_normal_one_is_used_even_if_its_ratios_underflow():
    v = 3000
    p = torch.zeros(2, v)
    p[0, 1] = 0.5
    p[0, 2999] = 1e-45
    q = torch.zeros(1, v)
    q[0, 1] = 1.0
    # the residual max(p - q, 0) is 1e-45 at one token: subnormal, so empty (design.md 3.3): the
    # race falls back to p, whose mass is at token 1
    assert _one_row([1], p, q=q, uniform=[0.999], exponential=torch.full((v,), 10.0)) == \
        ([1, -1], 0)
    # the smallest normal float is mass: no fallback, yet tiny / 1e30 rounds to 0 like every
    # other ratio, so the race returns the first index
    p[0, 2999] = torch.finfo(torch.float32).tiny
    assert _one_row([1], p, q=q, uniform=[0.999], exponential=torch.full((v,), 1e30)) == \
        ([0, -1], 0)


def test_acceptance_coin_is_the_float32_product():
    u, q = torch.tensor(0.7), torch.tensor(0.3)
    coin = u * q                          # float32 product, rounded up from the exact one:
    assert float(u.double() * q.double()) < float(coin)   # a wider product would accept at p = coin
    p = torch.zeros(2, 4)
    p[:, 0] = 1.0
    qr = torch.full((1, 4), 0.1)
    qr[0, 2] = q
    p[0, 2] = coin                        # coin < p is False
    assert _one_row([2], p, q=qr, uniform=[float(u)])[1] == 0
    p[0, 2] = torch.nextafter(coin, torch.tensor(1.0))
    assert _one_row([2], p, q=qr, uniform=[float(u)])[1] == 1


def test_empty_batch_and_zero_drafts():
    for bs, k in ((0, 3), (3, 0), (0, 0)):
        for dense in (True, False):
            out, n = assert_same(rejection_sample_inputs(bs=bs, k=k, v=9, dense=dense))
            assert out.shape == (bs, k + 1) and n.shape == (bs,)


def test_non_contiguous_inputs():
    a = rejection_sample_inputs(bs=6, k=3, v=300, seed=3)
    b = rejection_sample_inputs(bs=12, k=3, v=600, seed=4)
    views = {name: (t.transpose(0, -1).contiguous().transpose(0, -1) if t.dim() > 1 else t)
             for name, t in a.items()}
    views["target_probs"] = torch.cat([a["target_probs"], b["target_probs"][:6, :, :300]],
                                      -1)[..., :300]
    views["uniform"] = torch.stack([a["uniform"], a["uniform"]], -1)[..., 0]
    assert not views["target_probs"].is_contiguous() and not views["uniform"].is_contiguous()
    assert torch.equal(kernel(**views)[0], reference.rejection_sample(**a)[0])


# ------------------------------------------------------------------------------ bad input

def _corrupt(name, index, value):
    def change(a):
        t = a[name].clone()
        t[index] = value
        return {name: t}
    return change


BAD_INPUTS = {
    "target NaN": _corrupt("target_probs", (2, 1, 3), float("nan")),
    "target +Inf": _corrupt("target_probs", (0, 3, 10), float("inf")),
    "target -Inf": _corrupt("target_probs", (3, 0, 0), float("-inf")),
    "target negative": _corrupt("target_probs", (3, 3, 5), -0.1),
    "draft NaN": _corrupt("draft_probs", (1, 0, 0), float("nan")),
    "draft negative": _corrupt("draft_probs", (3, 2, 10), -1e-30),
    "id too large": _corrupt("draft_token_ids", (1, 2), 11),
    "id negative": _corrupt("draft_token_ids", (3, 0), -1),
    "uniform 1": _corrupt("uniform", (0, 1), 1.0),
    "uniform negative": _corrupt("uniform", (2, 2), -0.1),
    "uniform NaN": _corrupt("uniform", (1, 1), float("nan")),
    "uniform just above 1": _corrupt("uniform", (0, 0), 1.0000001),
    "uniform huge": _corrupt("uniform", (3, 1), 3e20),
    "uniform -Inf": _corrupt("uniform", (3, 2), float("-inf")),
    "exponential zero": _corrupt("exponential", (2, 4), 0.0),
    "exponential negative": _corrupt("exponential", (1, 0), -1.0),
    "exponential Inf": _corrupt("exponential", (3, 10), float("inf")),
    "exponential NaN": _corrupt("exponential", (0, 5), float("nan")),
    # several problems: the reference's check order decides which one is named
    "NaN and negative rows": lambda a: {"target_probs": _set(a["target_probs"], [
        ((3, 0, 1), float("nan")), ((1, 2, 4), -1.0)])},
    "NaN and negative in one row": lambda a: {"target_probs": _set(a["target_probs"], [
        ((1, 2, 1), -1.0), ((1, 2, 9), float("nan"))])},
    "bad id before NaN": lambda a: {**_corrupt("draft_token_ids", (3, 2), 99)(a),
                                    **_corrupt("target_probs", (0, 0, 0), float("nan"))(a)},
    "target before draft": lambda a: {**_corrupt("draft_probs", (0, 0, 0), -1.0)(a),
                                      **_corrupt("target_probs", (3, 3, 0), -1.0)(a)},
    "draft before uniform": lambda a: {**_corrupt("draft_probs", (3, 2, 0), -1.0)(a),
                                       **_corrupt("uniform", (0, 0), 2.0)(a)},
    "uniform before exponential": lambda a: {**_corrupt("uniform", (3, 2), 2.0)(a),
                                             **_corrupt("exponential", (0, 0), 0.0)(a)},
    "ids dtype": lambda a: {"draft_token_ids": a["draft_token_ids"].int()},
    "ids rank": lambda a: {"draft_token_ids": a["draft_token_ids"][0]},
    "target dtype": lambda a: {"target_probs": a["target_probs"].double()},
    "target rank": lambda a: {"target_probs": a["target_probs"][0]},
    "target batch": lambda a: {"target_probs": a["target_probs"][:3]},
    "target positions": lambda a: {"target_probs": a["target_probs"][:, :3]},
    "empty vocabulary": lambda a: {"target_probs": a["target_probs"][..., :0]},
    "draft dtype": lambda a: {"draft_probs": a["draft_probs"].bfloat16()},
    "draft vocabulary": lambda a: {"draft_probs": a["draft_probs"][..., :5]},
    "draft positions": lambda a: {"draft_probs": a["draft_probs"][:, :2]},
    "greedy dtype": lambda a: {"is_greedy": a["is_greedy"].int()},
    "greedy length": lambda a: {"is_greedy": a["is_greedy"][:2]},
    "uniform dtype": lambda a: {"uniform": a["uniform"].double()},
    "uniform shape": lambda a: {"uniform": a["uniform"][:, :2]},
    "exponential dtype": lambda a: {"exponential": a["exponential"].half()},
    "exponential shape": lambda a: {"exponential": a["exponential"][:, :10]},
    "exponential rank": lambda a: {"exponential": a["exponential"][None]},
}


def _set(t, changes):
    t = t.clone()
    for index, value in changes:
        t[index] = value
    return t


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_gives_the_reference_error_message(case):
    a = rejection_sample_inputs()
    args = {**a, **BAD_INPUTS[case](a)}
    assert_same_error(args)


def _read_rows_case():
    """Six sequences (0 and 3 greedy) with, from the reference, each one's accepted count."""
    a = rejection_sample_inputs(bs=6, k=4, v=3000, dense=True, greedy_every=3, seed=2,
                                draft_noise=1.0)
    accepted = reference.rejection_sample(**a)[1].tolist()
    sampled = [b for b in range(6) if b % 3]
    rejected = next(b for b in sampled if accepted[b] < 4)
    return a, accepted, rejected


def _bad_values_read_by_sampling():
    """(description, change) for bad values in rows that sampling with check=False reads."""
    a, accepted, b = _read_rows_case()
    at, x0 = accepted[b], int(a["draft_token_ids"][b, 0])
    spot = (int(a["draft_token_ids"][b, at]) + 1) % 3000   # not the draft token itself
    return [
        ("target at a draft token", "target_probs", (b, 0, x0), -0.5),
        ("residual's target row", "target_probs", (b, at, spot), float("nan")),
        ("residual's draft row", "draft_probs", (b, at, 2999), -1e-30),
        ("draft at a draft token", "draft_probs", (b, 0, x0), float("inf")),
        ("noise row of the residual", "exponential", (b, 17), 0.0),
        ("greedy target row", "target_probs", (3, 0, 2500), float("inf")),
        ("greedy row of the last step", "target_probs", (0, accepted[0], 1), -1.0),
    ]


@pytest.mark.parametrize("case", range(7))
def test_without_check_bad_values_it_reads_give_the_same_message(case):
    a, _, _ = _read_rows_case()
    _, name, index, value = _bad_values_read_by_sampling()[case]
    args = {**a, name: _set(a[name], [(index, value)])}
    with pytest.raises(ValueError) as want:
        reference.rejection_sample(**args)
    with pytest.raises(ValueError) as got:
        kernel(**args, check=False)
    assert str(got.value) == str(want.value)


def test_without_check_rows_sampling_does_not_need_are_not_read():
    # NaN in every row the walk never reaches: the checked call rejects the input, the
    # unchecked one returns the tokens of the clean input.
    a, accepted, b = _read_rows_case()
    clean = reference.rejection_sample(**a)
    at = accepted[b]
    later = (b, slice(at + 1, None))
    args = {**a, "target_probs": _set(a["target_probs"], [(later, float("nan"))]),
            "draft_probs": _set(a["draft_probs"], [(later, float("nan"))]),
            "exponential": _set(a["exponential"], [((0,), float("nan")), ((3,), -1.0)])}
    with pytest.raises(ValueError, match="NaN/Inf probabilities"):
        kernel(**args)
    got = kernel(**args, check=False)
    assert torch.equal(got[0], clean[0]) and torch.equal(got[1], clean[1])


def test_bad_rows_found_in_long_rows_and_any_chunk():
    a = rejection_sample_inputs(bs=3, k=2, v=5000)
    for index in [(1, 2, 4999), (2, 0, 2048), (0, 1, 4095)]:
        for value in (float("nan"), float("inf"), -1.0):
            args = {**a, "target_probs": _set(a["target_probs"], [(index, value)])}
            assert_same_error(args)


@pytest.mark.parametrize("value", [1.0, 1.5, 16777216.0, 123456789.0, 1e15, 1e16, 3.4e38,
                                   -1e-05, -0.0001, -0.00012345, -1e-10, -2.5e-39, -7.0])
def test_out_of_range_coin_is_printed_like_python(value):
    a = rejection_sample_inputs()
    args = {**a, "uniform": _set(a["uniform"], [((1, 0), value)])}
    assert_same_error(args)
