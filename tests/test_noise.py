"""The counter-based sampling noise (dflash/noise.py): Philox4x32-10 against the published
known-answer vectors, the distributions of the coins and the exponentials (fixed seeds,
significance 1e-3), and the keying that makes a request's noise its own."""

import math

import pytest
import torch

import dflash.ops
from dflash.ops import cases, reference
from dflash.sampling import noise

ALPHA = 1e-3


# counter, key -> output: the known-answer vectors of the Philox authors (Random123 kat_vectors)
KNOWN_ANSWERS = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("counter, key, want", KNOWN_ANSWERS)
def test_philox_matches_the_known_answers(counter, key, want):
    assert tuple(int(w) for w in reference.philox4x32(counter, key)) == want


def test_philox_of_tensors_matches_the_known_answers_and_leaves_its_inputs():
    """All vectors in one call, as tensors (each a column, repeated over a second axis; the key
    broadcast along it): the in-place rounds give the same words and do not write the inputs."""
    counter = [torch.tensor([[c[w]] * 5 for c, _, _ in KNOWN_ANSWERS]) for w in range(4)]
    key = [torch.tensor([[k[w]] for _, k, _ in KNOWN_ANSWERS]) for w in range(2)]
    before = [x.clone() for x in counter + key]
    words = reference.philox4x32(counter, key)
    want = torch.tensor([w for _, _, w in KNOWN_ANSWERS])
    for w in range(4):
        assert torch.equal(words[w], want[:, w, None].expand(3, 5))
    assert all(torch.equal(x, y) for x, y in zip(counter + key, before))


def test_philox_bits_kernel_gives_the_known_answer_and_the_reference_words():
    """The op (the CPU kernel here) against the published vector of counter 0 under key 0, and
    word for word against the tensor-op reference over keys and offsets at the 32-bit extremes,
    a cut last counter, empty shapes and every stream."""
    zero = torch.zeros(1, 2, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
    assert dflash.ops.implementation("philox_bits").startswith("kernel")
    assert tuple(dflash.ops.philox_bits(*zero, 0, 1, 4)[0, 0].tolist()) == KNOWN_ANSWERS[0][2]
    for change in ({}, {"stream": 2**32 - 1, "rows": 1, "n": 3}, {"rows": 0}, {"n": 0},
                   {"sequences": 0}, {"sequences": 1, "rows": 16, "n": 64}):
        args = cases.philox_bits_inputs(**change)
        got, want = dflash.ops.philox_bits(**args), reference.philox_bits(**args)
        assert got.shape == want.shape == (args["seeds"].shape[0], args["rows"], args["n"])
        assert torch.equal(got, want), change


@pytest.mark.parametrize("impl", ["reference", "torch.ops"])
def test_philox_bits_rejects_bad_keys_and_counters(impl):
    fn = reference.philox_bits if impl == "reference" else torch.ops.dflash.philox_bits
    args = cases.philox_bits_inputs()
    bad = [("seeds has shape", {"seeds": args["seeds"][:, :1]}),
           ("seeds has dtype", {"seeds": args["seeds"].int()}),
           ("offsets has shape", {"offsets": args["offsets"][:2]}),
           ("stream must be in", {"stream": 2**32}),
           ("rows and n must be non-negative", {"n": -1}),
           ("n at most 2\\*\\*34, got 2 and 17179869188", {"n": 2**34 + 4}),
           ("seeds must hold 32-bit words .* got 4294967296",
            {"seeds": args["seeds"].index_fill(0, torch.tensor([2]), 2**32)}),
           ("offsets must hold 32-bit words .* got -1",
            {"offsets": args["offsets"].index_fill(0, torch.tensor([1]), -1)})]
    for pattern, change in bad:
        with pytest.raises(ValueError, match=f"^philox_bits: .*{pattern}"):
            fn(**{**args, **change})


def test_philox_bits_check_false_skips_the_value_read_where_it_would_copy():
    """check=False (what the sampling noise passes, having checked its integers) spares the
    reference its read of the values (a device-to-host copy on an accelerator); the CPU kernel
    reads them anyway and still rejects them."""
    args = {**cases.philox_bits_inputs(), "check": False}
    args["offsets"] = args["offsets"].index_fill(0, torch.tensor([1]), -1)
    assert reference.philox_bits(**args).shape == (3, 2, 4099)
    with pytest.raises(ValueError, match="^philox_bits: offsets must hold 32-bit words"):
        torch.ops.dflash.philox_bits(**args)


def test_philox_bits_has_a_fake_kernel_and_traces():
    torch.library.opcheck(torch.ops.dflash.philox_bits.default, (), cases.philox_bits_inputs())
    args = cases.philox_bits_inputs()

    @torch.compile(backend="eager", fullgraph=True)
    def draw(seeds, offsets):
        return torch.ops.dflash.philox_bits(seeds, offsets, 1, 2, 4099)

    assert torch.equal(draw(args["seeds"], args["offsets"]), reference.philox_bits(**args))


def _chi_square_uniform_pvalue(x: torch.Tensor, bins: int = 64) -> float:
    counts = torch.histc(x.double(), bins, 0, 1)
    expected = len(x) / bins
    stat = ((counts - expected) ** 2 / expected).sum()
    return float(torch.special.gammaincc(torch.tensor((bins - 1) / 2.0, dtype=torch.float64),
                                         stat / 2))


def test_coins_are_uniform_and_exponentials_are_exp1():
    u = noise.uniform(range(1000), [3] * 1000, noise.COINS, 4, 100, "cpu").flatten()
    assert u.dtype == torch.float32 and 0 <= float(u.min()) and float(u.max()) < 1
    assert _chi_square_uniform_pvalue(u) > ALPHA
    e = noise.exponential(range(1000), [3] * 1000, noise.TARGET_RACE, 4, 100, "cpu").flatten()
    assert float(e.min()) > 0 and bool(e.isfinite().all())
    assert _chi_square_uniform_pvalue(torch.exp(-e.double())) > ALPHA   # exp(-E) ~ U(0, 1)
    n = len(e)
    assert abs(float(e.double().mean()) - 1) < 4 / math.sqrt(n)
    # the sample variance has standard deviation sqrt((mu4 - 1) / n), mu4 = 9 for Exp(1)
    assert abs(float(e.double().var()) - 1) < 4 * math.sqrt(8 / n)


def test_exponential_is_positive_and_finite_at_the_extreme_words():
    e = noise.exponential_of(torch.tensor([0, 1, 2**24, 2**32 - 2**7, 2**32 - 1]))
    assert bool((e > 0).all()) and bool(e.isfinite().all())
    assert float(e[0]) == pytest.approx(2.0 ** -33, rel=1e-6)
    assert bool((e[1:] >= e[:-1]).all())                   # non-decreasing in the word


def test_streams_offsets_and_seeds_give_independent_values():
    """Coins and races of one request and step, and its neighbouring offsets and seeds, are
    uncorrelated (|r| < 4 / sqrt(n) under independence)."""
    seeds, n = list(range(200)), 1000
    base = noise.uniform(seeds, [10] * 200, noise.COINS, 1, n, "cpu").flatten().double()
    others = {
        "target race": noise.uniform(seeds, [10] * 200, noise.TARGET_RACE, 1, n, "cpu"),
        "draft race": noise.uniform(seeds, [10] * 200, noise.DRAFT_RACE, 1, n, "cpu"),
        "next offset": noise.uniform(seeds, [11] * 200, noise.COINS, 1, n, "cpu"),
        "next seed": noise.uniform([s + 1 for s in seeds], [10] * 200, noise.COINS, 1, n, "cpu"),
        "second row": noise.uniform(seeds, [10] * 200, noise.COINS, 2, n, "cpu")[:, 1:],
    }
    for name, x in others.items():
        r = torch.corrcoef(torch.stack([base, x.flatten().double()]))[0, 1]
        assert abs(float(r)) < 4 / math.sqrt(len(base)), name
    # and the element-wise values themselves differ
    assert float((base == others["next offset"].flatten().double()).double().mean()) < 1e-3


def test_a_request_noise_is_independent_of_its_batch():
    seeds, offsets = [7, 2**64 - 1, 0, 123456789], [0, 5, 2**32 - 1, 17]
    batch = noise.bits(seeds, offsets, noise.DRAFT_RACE, 3, 1001, "cpu")
    assert batch.shape == (4, 3, 1001) and int(batch.min()) >= 0 and int(batch.max()) < 2**32
    for i in range(4):
        alone = noise.bits(seeds[i : i + 1], offsets[i : i + 1], noise.DRAFT_RACE, 3, 1001, "cpu")
        assert torch.equal(batch[i], alone[0])
    # a longer row starts with the shorter one (element e is counted by e // 4 and e % 4)
    assert torch.equal(noise.bits(seeds, offsets, noise.DRAFT_RACE, 3, 13, "cpu"),
                       batch[..., :13])


@pytest.mark.parametrize("seeds, offsets, message", [
    ([1, 2], [0], "expected one offset per seed, got 2 seeds and 1 offsets"),
    ([-1], [0], "seeds must be in \\[0, 2\\*\\*64\\) and offsets in \\[0, 2\\*\\*32\\), got -1"),
    ([2**64], [0], "got 18446744073709551616"),
    ([0], [2**32], "offsets in \\[0, 2\\*\\*32\\), got 4294967296"),
])
def test_bad_seeds_and_offsets_are_clear_errors(seeds, offsets, message):
    with pytest.raises(ValueError, match=message):
        noise.bits(seeds, offsets, noise.COINS, 1, 4, "cpu")
