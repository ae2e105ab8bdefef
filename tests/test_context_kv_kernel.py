"""The C++ CPU kernel of dflash::context_kv against the PyTorch reference (docs/design.md 3.1).

Both GEMMs and the hidden RMSNorm reproduce the reference bit for bit, so V must be identical; K
goes through a float32 epilogue whose summation order may differ: within 1e-5 in float32 and
within 1 ulp of the dtype in bfloat16 / float16 (see assert_within_one_ulp). Entries the op does
not write stay bit-identical.
"""

import itertools

import pytest
import torch

from dflash.ops import reference, registry
from dflash.ops.cases import context_kv_inputs


@pytest.fixture(autouse=True)
def _kernel_is_loaded():
    assert registry.has_kernel("context_kv"), "the compiled context_kv kernel is not loaded"


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int16)


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Steps between two 16-bit floats on the ordered line of representable values."""
    def ordered(t):
        bits = _bits(t).int()
        return torch.where(bits < 0, -(bits & 0x7FFF), bits)
    return (ordered(a) - ordered(b)).abs()


def assert_within_one_ulp(got: torch.Tensor, want: torch.Tensor) -> None:
    """1 ulp of the 16-bit dtype, or 1e-6 absolute where RoPE cancels to almost zero: there the
    float32 epilogue's rounding noise (relative to the O(1) normalized inputs) exceeds an ulp of
    the tiny result."""
    diff = (got.float() - want.float()).abs()
    bad = (ulp_distance(got, want) > 1) & (diff > 1e-6)
    assert not bad.any(), f"{int(bad.sum())} values differ by more than 1 ulp, e.g. " \
        f"{got[bad][:4].tolist()} vs {want[bad][:4].tolist()}"


def run_both(**kwargs):
    """Reference and kernel on two identical copies of the inputs; returns both argument sets."""
    expected, actual = context_kv_inputs(**kwargs), context_kv_inputs(**kwargs)
    reference.context_kv(**expected)
    torch.ops.dflash.context_kv(**actual)
    return expected, actual


def assert_caches_match(expected: dict, actual: dict, exact_v: bool = True) -> None:
    """K within the epilogue's tolerance; V bit-identical (or like K when not `exact_v`);
    entries no token writes keep their bits (the NaN fill)."""
    written = torch.zeros(expected["key_caches"][0].shape[:2], dtype=torch.bool)
    written.view(-1)[expected["slot_mapping"][expected["slot_mapping"] >= 0]] = True
    pairs = [(want, got, False) for want, got in zip(expected["key_caches"], actual["key_caches"])]
    pairs += [(want, got, exact_v)
              for want, got in zip(expected["value_caches"], actual["value_caches"])]
    for want, got, exact in pairs:
        if exact:
            assert torch.equal(_bits(got), _bits(want))
            continue
        assert torch.equal(_bits(got[~written]), _bits(want[~written]))
        if got.dtype == torch.float32:
            torch.testing.assert_close(got[written], want[written], rtol=1e-5, atol=1e-5)
        else:
            assert_within_one_ulp(got[written], want[written])


SHAPES = list(itertools.product((1, 2, 5), (1, 2, 8), (64, 128), (1, 16, 300)))   # L, Hkv, D, N
VARIANTS = list(itertools.product(                       # fc, bias, cache layout, dtype
    (True, False), (False, True), (False, True, "block_major", "vllm_cpu"),
    (torch.float32, torch.bfloat16, torch.float16)))
# The default run gives every shape one variant, cycling through all of them (each variant meets
# one or two shapes); `-m slow` runs the full product.
DEFAULT_CASES = [(*shape, *VARIANTS[i % len(VARIANTS)]) for i, shape in enumerate(SHAPES)]
FULL_CASES = [(*s, *v) for s, v in itertools.product(SHAPES, VARIANTS)
              if (*s, *v) not in DEFAULT_CASES]


def _case(layers, hkv, d, n, with_fc, with_bias, stacked, dtype):
    # Slots leave a quarter of the cache untouched; every third token (from the first) is -1,
    # except for N = 1, which would then write nothing.
    expected, actual = run_both(
        n=n, d_in=96, h=64, layers=layers, hkv=hkv, d=d, num_blocks=25, block_size=16,
        with_fc=with_fc, with_bias=with_bias, dtype=dtype, stacked=stacked,
        skip_every=3 if n > 1 else 0, seed=n + 10 * d + 1000 * layers)
    assert_caches_match(expected, actual)


@pytest.mark.parametrize("layers, hkv, d, n, with_fc, with_bias, stacked, dtype", DEFAULT_CASES)
def test_matches_reference(layers, hkv, d, n, with_fc, with_bias, stacked, dtype):
    _case(layers, hkv, d, n, with_fc, with_bias, stacked, dtype)


@pytest.mark.slow
@pytest.mark.parametrize("layers, hkv, d, n, with_fc, with_bias, stacked, dtype", FULL_CASES)
def test_matches_reference_full_matrix(layers, hkv, d, n, with_fc, with_bias, stacked, dtype):
    _case(layers, hkv, d, n, with_fc, with_bias, stacked, dtype)


@pytest.mark.parametrize("d", [2, 20, 48])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_head_dims_that_are_not_a_vector_multiple(d, dtype):
    """Half the head is 1, 10 or 24 floats: partial vectors in the RoPE and norm loops."""
    assert_caches_match(*run_both(n=9, d=d, hkv=3, dtype=dtype, skip_every=4))


@pytest.mark.parametrize("h, n", [(4096, 9), (4096, 33), (4100, 16)])
def test_wide_hidden_norm_is_bit_identical(h, n):
    """The hidden RMSNorm reduces rows in chunks: at the draft's width, c (and so V) must still
    match the reference's whole-tensor reduction bit for bit."""
    expected, actual = run_both(n=n, d_in=32, h=h, layers=1, hkv=1, d=64, num_blocks=16,
                                block_size=4, dtype=torch.bfloat16, skip_every=5)
    assert_caches_match(expected, actual)


def test_duplicate_slots_keep_the_last_token_like_the_reference():
    expected, actual = context_kv_inputs(n=12), context_kv_inputs(n=12)
    for args in (expected, actual):
        args["slot_mapping"][5] = args["slot_mapping"][2]
        args["slot_mapping"][9] = args["slot_mapping"][2]
        args["slot_mapping"][7] = args["slot_mapping"][11]
    reference.context_kv(**expected)
    torch.ops.dflash.context_kv(**actual)
    assert_caches_match(expected, actual)


def test_no_tokens_writes_nothing():
    args = context_kv_inputs(n=0)
    torch.ops.dflash.context_kv(**args)
    assert all(c.isnan().all() for c in args["key_caches"] + args["value_caches"])


def test_non_contiguous_inputs():
    def strided(args):
        args["hidden"] = args["hidden"].t().contiguous().t()        # column-major [N, D_in]
        args["kv_weight"] = args["kv_weight"].t().contiguous().t()
        args["positions"] = args["positions"].repeat_interleave(2)[::2]
        args["slot_mapping"] = args["slot_mapping"].repeat_interleave(2)[::2]
        args["cos_sin_cache"] = args["cos_sin_cache"].t().contiguous().t()
        args["k_norm_weight"] = args["k_norm_weight"].t().contiguous().t()
        return args
    expected, actual = strided(context_kv_inputs(n=9)), strided(context_kv_inputs(n=9))
    assert not actual["hidden"].is_contiguous() and not actual["positions"].is_contiguous()
    reference.context_kv(**expected)
    torch.ops.dflash.context_kv(**actual)
    assert_caches_match(expected, actual)


def test_strided_hidden_without_fc():
    """The kernel makes `hidden` row-major; the reference reduces it strided, so c (and V) may
    differ in float32 summation order only."""
    def column_major(args):
        args["hidden"] = args["hidden"].t().contiguous().t()
        return args
    expected = column_major(context_kv_inputs(n=9, with_fc=False))
    actual = column_major(context_kv_inputs(n=9, with_fc=False))
    reference.context_kv(**expected)
    torch.ops.dflash.context_kv(**actual)
    assert_caches_match(expected, actual, exact_v=False)


def test_weights_that_require_grad_leave_the_caches_out_of_autograd():
    expected, actual = context_kv_inputs(with_bias=True), context_kv_inputs(with_bias=True)
    for name in ("hidden", "fc_weight", "hidden_norm_weight", "kv_weight", "kv_bias",
                 "k_norm_weight"):
        actual[name].requires_grad_()
    reference.context_kv(**expected)
    torch.ops.dflash.context_kv(**actual)
    assert not any(c.requires_grad for c in actual["key_caches"] + actual["value_caches"])
    assert_caches_match(expected, actual)


def _bad_cases():
    k = context_kv_inputs()
    last = k["slot_mapping"].clone()
    last[-1] = 6 * 4
    return [
        ("expected 2 key and value caches .* got 1 key and 2 value caches",
         dict(key_caches=k["key_caches"][:1])),
        ("slot_mapping\\[4\\] = 24 is out of range for a cache of 6 blocks x 4 slots "
         "\\(valid: -1 to 23\\)", dict(slot_mapping=last)),
        ("positions\\[0\\] = -1 is out of range for a cos_sin_cache of 64 positions",
         dict(positions=k["positions"].index_fill(0, torch.tensor([0]), -1))),
        ("kv_bias has dtype torch.bfloat16, expected torch.float32",
         dict(kv_bias=torch.zeros(2 * 2 * 2 * 16, dtype=torch.bfloat16))),
        ("value_caches\\[0\\] has dtype torch.float16, expected torch.float32",
         dict(value_caches=[c.half() for c in k["value_caches"]])),
        ("hidden_norm_weight has shape \\[31\\], expected size 32 in dim 0",
         dict(hidden_norm_weight=k["hidden_norm_weight"][:-1])),
        ("head_dim 15 must be even", dict(k_norm_weight=k["k_norm_weight"][:, :15])),
        ("eps must be non-negative, got -0.5", dict(eps=-0.5)),
    ]


@pytest.mark.parametrize("pattern, change", _bad_cases())
def test_bad_input_raises_and_leaves_the_caches_unchanged(pattern, change):
    args = {**context_kv_inputs(), **change}
    for cache in args["key_caches"] + args["value_caches"]:
        cache.normal_()                      # finite values, so any write would show
    before = [c.clone() for c in args["key_caches"] + args["value_caches"]]
    with pytest.raises(ValueError, match=f"^context_kv: {pattern}"):
        torch.ops.dflash.context_kv(**args)
    for was, now in zip(before, args["key_caches"] + args["value_caches"]):
        assert torch.equal(was, now)
