"""top_k: each row's k largest entries (or their softmax probabilities), lower index first among
equal ones; the CPU kernel against the reference, the reference against torch and closed forms."""

import math

import pytest
import torch

import dflash
from dflash.ops import cases, reference

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def same(got, want):
    """Equal indices; values equal up to float32 rounding (NaN where the other has NaN)."""
    assert torch.equal(got[1], want[1])
    assert got[0].dtype == want[0].dtype == torch.float32
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-7, equal_nan=True)


def test_kernel_serves_the_op():
    assert dflash.ops.implementation("top_k").startswith("kernel")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("v", [1, 15, 16, 17, 1000, 49152])
@pytest.mark.parametrize("probs", [False, True])
def test_kernel_equals_the_reference(dtype, v, probs):
    for k in sorted({1, min(8, v), min(32, v), min(33, v), v}):
        args = {**cases.top_k_inputs(dtype, rows=6, v=v, k=k, probs=probs)}
        same(dflash.ops.top_k(**args), reference.top_k(**args))


def test_rows_of_any_leading_shape_and_many_rows_in_parallel():
    x = cases.top_k_inputs(torch.bfloat16, rows=24, v=49152)["x"]
    for shape in ((24, 49152), (4, 6, 49152), (0, 49152)):
        y = x.reshape(-1)[: math.prod(shape)].view(shape)
        got = dflash.ops.top_k(y, 8, probs=True)
        assert got[0].shape == got[1].shape == (*shape[:-1], 8)
        same(got, reference.top_k(y, 8, True))


def test_lower_index_first_among_equal_values_and_nan_ranks_first():
    nan, inf = float("nan"), float("inf")
    x = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0], [1.0, nan, inf, nan, 3.0]])
    for fn in (dflash.ops.top_k, reference.top_k):
        values, indices = fn(x, 5, False)
        assert indices.tolist() == [[1, 2, 4, 3, 0], [1, 3, 2, 4, 0]]
        assert values[0].tolist() == [3.0, 3.0, 3.0, 2.0, 1.0]
        assert fn(x, 1, False)[1].tolist() == [[1], [1]]
        assert fn(x, 2, True)[0][1].isnan().all()   # softmax over a row with a NaN


def test_probabilities_in_closed_form():
    # softmax of (0, log 2, log 3, -inf): 1/6, 2/6, 3/6, 0
    x = torch.tensor([[0.0, math.log(2), math.log(3), float("-inf")]])
    for fn in (dflash.ops.top_k, reference.top_k):
        probs, indices = fn(x, 4, True)
        assert indices.tolist() == [[2, 1, 0, 3]]
        torch.testing.assert_close(probs, torch.tensor([[3 / 6, 2 / 6, 1 / 6, 0.0]]))


@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_agrees_with_torch_topk_and_softmax_on_distinct_values(dtype):
    g = torch.Generator().manual_seed(3)
    # integers of magnitude below 2**8: distinct and exact in every dtype
    x = torch.stack([torch.randperm(250, generator=g) - 125.0 for _ in range(5)]).to(dtype)
    values, indices = torch.topk(x.float(), 10, dim=-1)
    for fn in (dflash.ops.top_k, reference.top_k):
        got = fn(x, 10, False)
        assert torch.equal(got[1], indices) and torch.equal(got[0], values)
        probs = fn(x, 10, True)[0]
        torch.testing.assert_close(probs, torch.softmax(x.float(), -1).gather(-1, indices))


def test_first_argmax_follows_torch_max():
    x = cases.top_k_inputs(torch.bfloat16, rows=6, v=49152)["x"]
    assert torch.equal(dflash.sampling.first_argmax(x), x.max(-1).indices)


@pytest.mark.parametrize("impl", ["reference", "kernel"])
def test_bad_input_names_the_problem(impl):
    fn = reference.top_k if impl == "reference" else torch.ops.dflash.top_k
    x = torch.randn(3, 10)
    for pattern, args in [
        (r"k must be in \[1, 10\] \(x's last dim\), got 0", (x, 0, False)),
        (r"k must be in \[1, 10\] \(x's last dim\), got 11", (x, 11, True)),
        ("its last dim is empty", (torch.randn(3, 0), 1, False)),
        ("x has dtype torch.int64", (torch.arange(10), 1, False)),
    ]:
        with pytest.raises(ValueError, match=f"^top_k: .*{pattern}"):
            fn(*args)


def test_fake_kernel_and_tracing():
    # (opcheck compares outputs without equal_nan: rows without NaN results)
    args = {**cases.top_k_inputs(torch.bfloat16), "x": torch.randn(6, 1000).bfloat16()}
    torch.library.opcheck(torch.ops.dflash.top_k.default, (), args)

    @torch.compile(backend="eager", fullgraph=True)
    def candidates(x):
        return dflash.ops.top_k(x, 4, probs=True)

    same(candidates(args["x"]), reference.top_k(args["x"], 4, True))
