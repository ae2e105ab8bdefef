"""8-bit weights (`ops.quantize_int8`, `ops.quant_linear`, `LLM(quantization="int8")`): the
quantizer against its closed form, the op against the float32 product of the dequantized weight
within the bound activation rounding allows, rows independent of the rows beside them, and
DFlash over a quantized target token for token equal to that target's own decoding.
(The kernel against the reference on exact inputs, opcheck and the fake kernel: test_layer_ops.)"""

import pytest
import torch

from dflash import LLM, SamplingParams, ops
from dflash.engine import EngineArgs
from dflash.models.layers import Int8Weight, linear, unpacked
from dflash.ops import packing, reference

from helpers import make_tiny_pair

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _weight(n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g)


def test_quantizer_matches_its_closed_form():
    w = _weight(32, 96)
    quads, scales = ops.quantize_int8(w)
    assert quads.dtype == torch.uint8 and quads.shape == (2, 24, 16, 4)
    assert scales.dtype == torch.float32 and scales.shape == (2, 3, 16)
    groups = w.view(32, 3, 32)
    d = groups.abs().amax(-1) / 127
    # the layout: quads[p, i, j, t] = q[16 p + j, 4 i + t] + 128, scales[p, g, j] = d[16 p + j, g]
    q = torch.round(groups / d[..., None]).view(32, 96)
    assert torch.equal(quads[1, 5, 3].long() - 128, q[16 + 3, 20:24].long())
    assert torch.equal(scales[0, 2], d[:16, 2])
    deq = ops.dequantize_int8(quads, scales)
    assert torch.all((deq - w).abs().view(32, 3, 32) <= d[..., None] / 2 * (1 + 1e-6))
    assert (q.view(32, 3, 32).abs().amax(-1) == 127).all()   # each group's maximum maps to 127


def test_weights_on_the_grid_round_trip_exactly():
    """A weight that already is q * d with max |q| = 127 per group (a GGUF Q8_0 tensor) comes
    back bit for bit."""
    g = torch.Generator().manual_seed(1)
    q = torch.randint(-127, 128, (48, 64), generator=g)
    q[:, ::32] = -127
    d = torch.rand(48, 2, generator=g).half().float() + 0.01
    w = (q.view(48, 2, 32) * d[..., None]).view(48, 64)
    assert torch.equal(ops.dequantize_int8(*ops.quantize_int8(w)), w)


def test_zero_groups_and_bad_shapes():
    quads, scales = ops.quantize_int8(torch.zeros(16, 32))
    assert (quads == 128).all() and (scales == 0).all()
    with pytest.raises(ValueError, match="quantize_int8: weight has shape \\[16, 40\\]"):
        ops.quantize_int8(torch.zeros(16, 40))
    with pytest.raises(ValueError, match="quantize_int8: weight has shape \\[20, 32\\]"):
        ops.quantize_int8(torch.zeros(20, 32))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows, n, k", [(1, 48, 64), (7, 144, 96), (16, 256, 576), (40, 32, 32)])
def test_matches_the_float_product_within_the_activation_rounding(rows, n, k, dtype):
    """The weight's own rounding is in W_deq; what is left is x's rounding, at most half a step
    d_x per element: |y - x @ W_deq.T| <= sum_g d_x,g / 2 * sum_{k in g} |W_deq| (+ float32 and
    the output dtype's rounding)."""
    w = _weight(n, k, seed=rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(k)).to(dtype)
    quads, scales = ops.quantize_int8(w)
    deq = ops.dequantize_int8(quads, scales)
    got = ops.quant_linear(x, quads, scales).float()
    exact = x.double() @ deq.double().T
    _, dx = packing.quantize_groups(x)
    bound = (dx.double()[:, None, :] / 2 * deq.double().abs().view(n, k // 32, 32).sum(-1)).sum(-1)
    slack = 1e-5 * (x.double().abs() @ deq.double().abs().T) + \
        torch.finfo(dtype).eps * exact.abs()
    assert torch.all((got.double() - exact).abs() <= bound + slack)
    # and the bound is not vacuous: the result is far closer to x @ W_deq.T than to a 1% error
    rel = (got.double() - exact).norm() / exact.norm()
    assert rel < 0.01
    torch.testing.assert_close(got, reference.quant_linear(x, quads, scales, None).float(),
                               rtol=2e-6 if dtype == torch.float32 else 2 * torch.finfo(dtype).eps,
                               atol=1e-5)


@pytest.mark.parametrize("mistake", ["groups' scales swapped", "columns' scales swapped",
                                     "inputs of a quad reversed"])
def test_the_bound_catches_a_layout_mistake(mistake):
    """Negative control for the test above: an index off in the layout breaks the bound."""
    w = _weight(48, 64)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(2))
    quads, scales = ops.quantize_int8(w)
    deq = ops.dequantize_int8(quads, scales)
    if mistake == "groups' scales swapped":
        scales = scales.flip(1)
    elif mistake == "columns' scales swapped":
        scales = scales.flip(2)
    else:
        quads = quads.flip(3)
    wrong = ops.quant_linear(x, quads.contiguous(), scales.contiguous())
    _, dx = packing.quantize_groups(x)
    bound = (dx[:, None, :] / 2 * deq.abs().view(48, 2, 32).sum(-1)).sum(-1)
    assert ((wrong - x @ deq.T).abs() > bound + 1e-5).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("n", [16, 48, 144, 272])
def test_rows_do_not_depend_on_the_rows_beside_them(n, dtype):
    """Every row count takes another block shape (1-2 rows: 8 panels a block; more: 4 panels x 6
    rows and their remainders) and n another partial last tile, yet each row of a call equals
    the same row alone, bit for bit: what makes DFlash's verification equal decoding."""
    w = _weight(n, 96, seed=n)
    quads, scales = ops.quantize_int8(w)
    x = torch.randn(23, 96, generator=torch.Generator().manual_seed(3)).to(dtype)
    alone = torch.cat([ops.quant_linear(x[i:i + 1], quads, scales) for i in range(23)])
    for rows in (2, 3, 6, 7, 13, 23):
        assert torch.equal(ops.quant_linear(x[:rows], quads, scales), alone[:rows])


def test_a_non_finite_row_gives_nan_and_leaves_the_others_alone():
    quads, scales = ops.quantize_int8(_weight(32, 64))
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(4))
    for bad in (float("nan"), float("inf")):
        y = x.clone()
        y[1, 40] = bad
        for impl in (ops.quant_linear, reference.quant_linear):
            out = impl(y, quads, scales, None)
            assert out[1].isnan().all()
            assert torch.equal(out[[0, 2]], impl(x, quads, scales, None)[[0, 2]])


def test_linear_and_unpacked_take_quantized_weights():
    w = _weight(64, 64)
    qw = Int8Weight(*ops.quantize_int8(w))
    x = torch.randn(2, 64)
    assert torch.equal(linear(x, qw), ops.quant_linear(x, qw.quads, qw.scales))
    assert torch.equal(unpacked(qw), ops.dequantize_int8(qw.quads, qw.scales))
    assert qw.nbytes == 64 * 64 + 64 * 2 * 4


def test_an_unknown_quantization_is_refused():
    with pytest.raises(ValueError, match="quantization must be None or one of \\['int8'\\], "
                                         "got 'int4'"):
        EngineArgs("target", quantization="int4")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_tiny_pair(tmp_path_factory.mktemp("quantized"), 8)


PROMPTS = [[(5 * i + 2 * j) % 90 + 1 for j in range(n)] for i, n in enumerate([6, 13, 2, 18])]


@pytest.mark.parametrize("speculation", ["adaptive", "chain", "fixed"])
def test_dflash_over_an_int8_target_equals_its_own_decoding(pair, speculation):
    target, draft, _ = pair
    sp = [SamplingParams(max_tokens=24 + 4 * i) for i in range(len(PROMPTS))]
    base = LLM(target, dtype="float32", max_num_seqs=4, quantization="int8")
    llm = LLM(target, draft, dtype="float32", max_num_seqs=2, speculation=speculation,
              quantization="int8")
    layer = llm.target.layers[0]
    assert isinstance(layer.attn.qkv, Int8Weight) and isinstance(layer.mlp.down, Int8Weight)
    assert isinstance(llm.target.packed_head, Int8Weight)
    assert not isinstance(llm.draft.layers[0].q, Int8Weight)   # the draft stays as loaded
    outs, expected = llm.generate(PROMPTS, sp), base.generate(PROMPTS, sp)
    assert [o.token_ids for o in outs] == [e.token_ids for e in expected]
    if speculation == "fixed":
        assert sum(o.metrics.num_drafts for o in outs) > 0
    # the weights really are the 8-bit ones: decoding differs from the float target somewhere
    float_target = LLM(target, dtype="float32", max_num_seqs=4)
    logits = [llm.target.logits(torch.randn(1, 64, generator=torch.Generator().manual_seed(s)))
              for s in range(2)]
    floats = [float_target.target.logits(torch.randn(1, 64, generator=torch.Generator()
                                                     .manual_seed(s))) for s in range(2)]
    assert all(not torch.equal(a, b) for a, b in zip(logits, floats))
    for a, b in zip(logits, floats):
        torch.testing.assert_close(a, b, rtol=0.05, atol=0.05 * float(b.abs().max()))
