"""8- and 4-bit weights (`ops.quantize_int8` / `quantize_int4`, `ops.quant_linear`,
`LLM(quantization=...)`): the quantizers against their closed forms and GGUF's own Q8_0 / Q4_1
values, the op against the float32 product of the dequantized weight within the bound activation
rounding allows (with layout mistakes as the negative control), the kernel against the reference
on exact inputs, rows independent of the rows beside them, and DFlash over a quantized target
token for token equal to that target's own decoding. (8-bit bad inputs, opcheck: test_layer_ops.)
"""

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from dflash import LLM, SamplingParams, ops
from dflash.cli import QUANTIZATION_CHOICES
from dflash.engine import EngineArgs
from dflash.models import load_target
from dflash.models.layers import QUANTIZATIONS, QuantizedWeight, linear, unpacked
from dflash.ops import packing, reference, registry
from dflash.ops.cases import quant_linear_inputs

from helpers import make_tiny_pair, make_tiny_target, write_llama_gguf

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
QUANTIZE = {8: ops.quantize_int8, 4: ops.quantize_int4}


def _weight(n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g)


def _quantized(w, bits) -> QuantizedWeight:
    return QuantizedWeight(*QUANTIZE[bits](w))


def test_int8_quantizer_matches_its_closed_form():
    w = _weight(32, 96)
    quads, scales = ops.quantize_int8(w)
    assert quads.dtype == torch.uint8 and quads.shape == (2, 24, 16, 4)
    assert scales.dtype == torch.float16 and scales.shape == (2, 3, 16)   # Q8_0's block field
    groups = w.view(32, 3, 32)
    d = groups.abs().amax(-1) / 127
    # the layout: quads[p, i, j, t] = q[16 p + j, 4 i + t] + 128, scales[p, g, j] = d[16 p + j, g]
    # rounded to float16 (the codes come from d itself, as llama.cpp's quantizer computes them)
    q = torch.round(groups / d[..., None]).view(32, 96)
    assert torch.equal(quads[1, 5, 3].long() - 128, q[16 + 3, 20:24].long())
    assert torch.equal(scales[0, 2], d[:16, 2].half())
    deq = ops.dequantize_int8(quads, scales)
    # half a step, plus what rounding the scale to float16 moved the largest code
    d16 = scales.transpose(1, 2).reshape(32, 3).float()
    bound = d / 2 * (1 + 1e-6) + 127 * (d - d16).abs()
    assert torch.all((deq - w).abs().view(32, 3, 32) <= bound[..., None])
    assert (q.view(32, 3, 32).abs().amax(-1) == 127).all()   # each group's maximum maps to 127


def test_int4_quantizer_matches_its_closed_form():
    """llama.cpp's Q4_1: min and (max - min) / 15 per group, stored as float16; codes 0..15."""
    w = _weight(32, 96)
    nibbles, scales, mins = ops.quantize_int4(w)
    assert nibbles.dtype == torch.uint8 and nibbles.shape == (2, 12, 16, 4)
    assert scales.shape == mins.shape == (2, 3, 16)
    assert scales.dtype == mins.dtype == torch.float16   # Q4_1's block fields
    groups = w.view(32, 3, 32)
    low, d = groups.amin(-1), (groups.amax(-1) - groups.amin(-1)) / 15
    c = ((groups - low[..., None]) / d[..., None] + 0.5).floor().clamp(0, 15).view(32, 96)
    # byte [p, i, j, t]: code of input 8 i + t (low nibble) and of 8 i + 4 + t (high nibble)
    byte = nibbles[1, 5, 3].long()
    assert torch.equal(byte & 15, c[16 + 3, 40:44].long())
    assert torch.equal(byte >> 4, c[16 + 3, 44:48].long())
    assert torch.equal(scales[0, 2], d[:16, 2].half().float())
    assert torch.equal(mins[0, 2], low[:16, 2].half().float())
    deq = ops.dequantize_int4(nibbles, scales, mins)
    step = scales.transpose(1, 2).reshape(32, 3)
    # half a step, plus what rounding the scale and min to float16 moved
    assert torch.all((deq - w).abs().view(32, 3, 32) <= step[..., None] * (0.5 + 2e-3) + 2e-3)


def test_int8_rejects_values_no_float16_scale_holds():
    """int8 stores Q8_0's float16 scale: a group whose max |w| / 127 lies beyond float16's range
    is refused by name, where an infinite scale would make every output NaN; a non-finite group
    keeps a NaN scale, so what it multiplies is NaN (test_a_non_finite_row_gives_nan...)."""
    w = torch.ones(16, 64)
    w[3, 40] = 127 * 65536.0
    with pytest.raises(ValueError, match="quantize_int8: the weight holds .* float16"):
        ops.quantize_int8(w)
    w[3, 40] = 127 * 65504.0   # max / 127 = 65504, the largest float16: accepted, exactly
    assert unpacked(_quantized(w, 8))[3, 40] == w[3, 40]
    w[3, 40] = float("nan")
    assert unpacked(_quantized(w, 8))[3, 32:].isnan().all()


def test_int4_rejects_values_no_float16_minimum_holds():
    """int4 stores Q4_1's float16 scale and minimum: a weight beyond float16's range (here a
    Q4_0 grid with d = 2^14, whose -8 d no float16 holds) or with NaN is refused by name, where
    an infinite minimum would make every output NaN."""
    codes = torch.arange(32).remainder(16).repeat(16, 1).float()
    for w in ((codes - 8) * 16384.0, torch.full((16, 32), float("nan"))):
        with pytest.raises(ValueError, match="quantize_int4: the weight holds .* float16"):
            ops.quantize_int4(w)
    ops.quantize_int4((codes - 8) * 8188.0)   # -8 d = -65504, the largest float16: accepted


@pytest.mark.parametrize("form", ["Q8_0", "Q4_1", "Q4_0"])
def test_weights_on_the_grid_round_trip_exactly(form):
    """A weight that already is a GGUF Q8_0 (q * d, max |q| = 127 per group), Q4_1 (c * d + m,
    codes 0 and 15 present per group, d and m float16) or Q4_0 (d * (c - 8), -8 d the largest
    magnitude, d float16) tensor comes back bit for bit."""
    g = torch.Generator().manual_seed(1)
    d = (torch.rand(48, 2, generator=g) + 0.01).half().float()
    bits = 8 if form == "Q8_0" else 4
    if form == "Q8_0":
        q = torch.randint(-127, 128, (48, 64), generator=g)
        q[:, ::32] = -127
        w = (q.view(48, 2, 32) * d[..., None]).view(48, 64)
    elif form == "Q4_0":
        c = torch.randint(1, 16, (48, 64), generator=g)
        c[:, ::32] = 0
        w = ((c.view(48, 2, 32) - 8) * d[..., None]).view(48, 64)
    else:
        c = torch.randint(0, 16, (48, 64), generator=g)
        c[:, ::32], c[:, 1::32] = 0, 15
        m = (torch.rand(48, 2, generator=g) - 1).half().float()
        w = (c.view(48, 2, 32) * d[..., None] + m[..., None]).view(48, 64)
    assert torch.equal(unpacked(_quantized(w, bits)), w)


@pytest.mark.parametrize("bits", [8, 4])
def test_constant_groups_and_bad_shapes(bits):
    # 8 bits: a constant group is 127 scales, exact when float16 holds the scale (2^-8 here;
    # what rounding it moves otherwise: test_int8_quantizer_matches_its_closed_form)
    w = torch.full((16, 32), -0.5 if bits == 4 else -127 / 256)
    assert torch.equal(unpacked(_quantized(w, bits)), w)
    assert torch.equal(unpacked(_quantized(torch.zeros(16, 32), bits)), torch.zeros(16, 32))
    name = f"quantize_int{bits}"
    with pytest.raises(ValueError, match=f"{name}: weight has shape \\[16, 40\\]"):
        QUANTIZE[bits](torch.zeros(16, 40))
    with pytest.raises(ValueError, match=f"{name}: weight has shape \\[20, 32\\]"):
        QUANTIZE[bits](torch.zeros(20, 32))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_int4_kernel_matches_the_reference_on_exact_inputs(dtype):
    args = quant_linear_inputs(dtype, bits=4)
    assert torch.equal(torch.ops.dflash.quant_linear(**args), reference.quant_linear(**args))
    torch.library.opcheck(torch.ops.dflash.quant_linear, (), args)


@pytest.mark.parametrize("bits", [8, 4])
def test_the_largest_integer_products_stay_exact(bits):
    """Weights at the ends of their range (8 bits: -128, which a GGUF Q8_0 block may hold, and
    127; 4 bits: code 15) against activations that quantize to +-127 with the weights' signs, so
    every pair of byte products sums to about +-2 * 128 * 127, the most an int16 holds (AVX2's
    VPMADDUBSW saturates beyond it), and 4-bit groups of one sign sum to +-8 * 2 * 15 * 127,
    what the pairs path adds up in int16 lanes (5 rows: a block of 4 and one more): the kernel
    equals the reference and the float64 product."""
    n, k = 32, 64
    sign = torch.where(torch.arange(k) % 3 == 0, -1.0, 1.0)
    ones = torch.ones(k)
    x = torch.stack([sign, -sign, ones, -ones, ones]) * 127 / 64   # quantize exactly to +-127
    scale = torch.full((n, k // 32), 2.0 ** -5)
    if bits == 8:
        q = torch.where(sign < 0, -128, 127).expand(n, k).to(torch.int8)
        (weight, scales), mins = packing.to_quad_panels(q, scale), None
        deq = q.double() * 2.0 ** -5
    else:
        codes = torch.full((n, k), 15, dtype=torch.uint8)
        low = torch.full((n, k // 32), -0.25)
        weight, scales, mins = packing.to_nibble_panels(codes, scale, low)
        deq = torch.full((n, k), 15 * 2.0 ** -5 - 0.25, dtype=torch.float64)
    got = torch.ops.dflash.quant_linear(x, weight, scales, mins, None)
    assert torch.equal(got, reference.quant_linear(x, weight, scales, mins, None))
    assert torch.equal(got.double(), x.double() @ deq.T)


def test_4_bit_weights_need_their_minimums():
    args = quant_linear_inputs(bits=4)
    with pytest.raises(ValueError, match="quant_linear: weight has shape \\[3, 8, 16, 4\\], "
                                         "expected size 16 in dim 1"):
        torch.ops.dflash.quant_linear(**{**args, "mins": None})
    with pytest.raises(ValueError, match="quant_linear: mins has shape \\[3, 1, 16\\]"):
        torch.ops.dflash.quant_linear(**{**args, "mins": args["mins"][:, :1]})


def _activation_bound(x, deq):
    """|x @ W.T - quant_linear(x)| <= sum over groups of e * sum |W| over the group: the
    weight's rounding is in W (dequantized); what is left is x's, q = round(x / d) with
    d = max|x| / 127, then q * d16 with d16 = d in float16: e = d / 2 + 127 |d - d16|."""
    n, k = deq.shape
    _, d = packing.quantize_groups(x)
    _, d16 = packing.quantize_activations(x)
    e = d.double() / 2 + 127 * (d.double() - d16.double()).abs()
    return (e[:, None, :] * deq.double().abs().view(n, k // 32, 32).sum(-1)).sum(-1)


def test_activations_are_quantized_as_llama_cpp_quantizes_a_q8_0_input():
    """q = rint(x * (127 / max|x|)) with a correctly rounded quotient, scale = max|x| / 127 in
    float16 (numpy as the oracle), float32 where float16 overflows; the kernel quantizes alike."""
    np = pytest.importorskip("numpy")
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 96, generator=g).bfloat16().float()   # bf16 values hit exact .5 ties
    x[1, 32:64] *= 1e7                                        # max / 127 beyond float16
    x[2, :32] = 0
    q, scale = packing.quantize_activations(x)
    v = x.numpy().reshape(5, 3, 32)
    amax = np.abs(v).max(-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        inverse = np.where(amax != 0, np.float32(127) / amax, np.float32(0))
    want_q = np.rint(v * inverse[..., None]).astype(np.int8).reshape(5, 96)
    d = amax / np.float32(127)
    with np.errstate(over="ignore"):
        half = d.astype(np.float16).astype(np.float32)
    assert torch.equal(q, torch.from_numpy(want_q))
    assert torch.equal(scale, torch.from_numpy(np.where(np.isinf(half), d, half)))
    assert scale[1, 1] == d[1, 1] and scale[0, 0] != d[0, 0]
    w = _weight(16, 96)
    qw = _quantized(w, 8)
    got = torch.ops.dflash.quant_linear(x, qw.codes, qw.scales, None, None)
    assert torch.isfinite(got).all()   # fused multiply-adds: equal to rounding
    torch.testing.assert_close(got, reference.quant_linear(x, qw.codes, qw.scales, None, None),
                               rtol=2e-6, atol=1e-5)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows, n, k", [(1, 48, 64), (7, 144, 96), (16, 256, 576), (40, 32, 32)])
def test_matches_the_float_product_within_the_activation_rounding(rows, n, k, dtype, bits):
    qw = _quantized(_weight(n, k, seed=rows), bits)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(k)).to(dtype)
    deq = unpacked(qw)
    got = linear(x, qw).float()
    exact = x.double() @ deq.double().T
    slack = 1e-5 * (x.double().abs() @ deq.double().abs().T) + \
        torch.finfo(dtype).eps * exact.abs()
    assert torch.all((got.double() - exact).abs() <= _activation_bound(x, deq) + slack)
    assert (got.double() - exact).norm() / exact.norm() < 0.01
    torch.testing.assert_close(
        got, reference.quant_linear(x, qw.codes, qw.scales, qw.mins, None).float(),
        rtol=2e-6 if dtype == torch.float32 else 2 * torch.finfo(dtype).eps, atol=1e-5)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("mistake", ["groups' scales swapped", "columns' scales swapped",
                                     "inputs of a quad reversed"])
def test_the_bound_catches_a_layout_mistake(mistake, bits):
    """Negative control for the test above: an index off in the layout breaks the bound."""
    qw = _quantized(_weight(48, 64), bits)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(2))
    codes, scales = qw.codes, qw.scales
    if mistake == "groups' scales swapped":
        scales = scales.flip(1)
    elif mistake == "columns' scales swapped":
        scales = scales.flip(2)
    else:
        codes = codes.flip(3)
    wrong = ops.quant_linear(x, codes.contiguous(), scales.contiguous(), qw.mins)
    deq = unpacked(qw)
    assert ((wrong - x @ deq.T).abs() > _activation_bound(x, deq) + 1e-5).any()


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("n", [16, 48, 144, 272])
def test_rows_do_not_depend_on_the_rows_beside_them(n, dtype, bits):
    """Every row count takes another block shape (AVX-512, 1-2 rows: 8 (8 bits) or 4 (4 bits)
    panels a block; more: 4 panels x 6 (8 bits with VNNI) or 4 rows; AVX2: 1 panel x 1 row for
    1-2 rows, x 4 rows for more; and their remainders) and n another partial last tile, yet each
    row of a call equals the same row alone, bit for bit: what makes DFlash's verification equal
    decoding."""
    qw = _quantized(_weight(n, 96, seed=n), bits)
    x = torch.randn(23, 96, generator=torch.Generator().manual_seed(3)).to(dtype)
    alone = torch.cat([linear(x[i:i + 1], qw) for i in range(23)])
    for rows in (2, 3, 5, 6, 7, 13, 23):
        assert torch.equal(linear(x[:rows], qw), alone[:rows])


WITHOUT_VNNI = """
import sys, torch
from dflash import ops
inputs = torch.load(sys.argv[1])
torch.save([ops.quant_linear(x, *w, None) for x, w in inputs], sys.argv[2])
"""


@pytest.mark.skipif(registry.CPU_CAPABILITY != "AVX512", reason="the AVX-512 build's two paths")
def test_avx512_without_vnni_computes_what_vnni_computes(tmp_path):
    """ONEDNN_MAX_CPU_ISA=AVX512_CORE hides AVX512-VNNI from the AVX-512 build, as on an AVX-512
    CPU without it (Skylake-SP), which then takes VPMADDUBSW pairs instead of VPDPBUSD. A group's
    integer is exact on both paths, so every row equals this process's bit for bit: random
    inputs at each block shape, 8 and 4 bits, and the products at the ends of the range that
    would saturate VPMADDUBSW's int16 sums if q's sign were not moved onto x."""
    import subprocess
    import sys

    g = torch.Generator().manual_seed(5)
    inputs = []
    for bits in (8, 4):
        for n, rows in ((48, 1), (272, 2), (144, 5), (272, 23)):
            x = torch.randn(rows, 96, generator=g).to(torch.bfloat16)
            inputs.append((x, _quantized(_weight(n, 96, seed=n + bits), bits)))
    q = torch.where(torch.arange(64) % 3 == 0, -128, 127).expand(32, 64).to(torch.int8)
    ends = torch.where(torch.arange(64) % 3 == 0, -1.0, 1.0).expand(3, 64) * 127 / 64   # exact
    inputs.append((ends, QuantizedWeight(*packing.to_quad_panels(q, torch.full((32, 2), 0.5)))))
    torch.save([(x, (w.codes, w.scales, w.mins)) for x, w in inputs], tmp_path / "inputs.pt")
    subprocess.run([sys.executable, "-c", WITHOUT_VNNI, tmp_path / "inputs.pt",
                    tmp_path / "outputs.pt"],
                   env={**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX512_CORE"}, check=True)
    outputs = torch.load(tmp_path / "outputs.pt")
    for (x, w), got in zip(inputs, outputs, strict=True):
        assert torch.equal(got, linear(x, w))
    assert torch.equal(outputs[-1].double(), ends.double() @ (q.double() * 0.5).T)


@pytest.mark.parametrize("bits", [8, 4])
def test_a_non_finite_row_gives_nan_and_leaves_the_others_alone(bits):
    qw = _quantized(_weight(32, 64), bits)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(4))
    for bad in (float("nan"), float("inf")):
        y = x.clone()
        y[1, 40] = bad
        for impl in (ops.quant_linear, reference.quant_linear):
            out = impl(y, qw.codes, qw.scales, qw.mins, None)
            assert out[1].isnan().all()
            assert torch.equal(out[[0, 2]], impl(x, qw.codes, qw.scales, qw.mins, None)[[0, 2]])


def test_quantized_weight_sizes():
    assert _quantized(_weight(64, 64), 8).nbytes == 64 * 64 + 64 * 2 * 2   # Q8_0: 34 / 32
    assert _quantized(_weight(64, 64), 4).nbytes == 64 * 64 // 2 + 2 * 64 * 2 * 2   # float16


@pytest.mark.parametrize("qtype, quantization", [("Q8_0", "int8"), ("Q4_1", "int4"),
                                                  ("Q4_0", "int4")])
def test_a_gguf_target_keeps_its_exact_weights(tmp_path, qtype, quantization):
    """A Q8_0 tensor is int8 with one fp16 scale per 32 values, a Q4_1 one 4-bit codes with an
    fp16 scale and minimum, a Q4_0 one 4-bit codes with an fp16 scale (minimum -8 scales):
    quantizing its values as loaded (float32, whatever the model dtype) gives them back bit for
    bit. The embedding (the tied lm_head) is Q8_0, as in llama.cpp's
    4-bit files (and the bundled target); int4 keeps the lm_head in int8."""
    pytest.importorskip("gguf")
    write_llama_gguf(make_tiny_target(tmp_path / "hf", "llama"), tmp_path / "t.gguf",
                     qtype=qtype, embedding_qtype="Q8_0")
    exact = load_target(tmp_path / "t.gguf", torch.float32)   # the file's values
    ours = load_target(tmp_path / "t.gguf", torch.bfloat16, quantization=quantization)
    names = exact.linear_weights()
    assert len(names) == 16
    for name in names:
        module, _, leaf = name.rpartition(".")
        weight = getattr(ours.get_submodule(module), leaf)
        assert isinstance(weight, QuantizedWeight)
        assert torch.equal(unpacked(weight), exact.get_parameter(name))
    assert torch.equal(unpacked(ours.packed_head), exact.embed)
    assert ours.packed_head.mins is None   # the head in int8 either way
    # the tied embedding is read from it: the file's rows, in the model dtype
    ids = torch.arange(exact.cfg.vocab_size)
    assert ours.embed is None
    assert torch.equal(ours.embed_tokens(ids), exact.embed.bfloat16())
    assert torch.equal(ours.output_rows(ids[::3]), exact.embed[::3].bfloat16())
    assert ours.layers[0].input_norm.dtype == torch.bfloat16
    # the values need float32: quantized from bf16 they would not come back
    assert not torch.equal(exact.embed.bfloat16().float(), exact.embed)


@pytest.mark.parametrize("quantization", ["int8", "int4"])
@pytest.mark.parametrize("tied", [True, False])
def test_a_quantized_target_holds_its_weights_once(tmp_path, quantization, tied):
    """Resident bytes of the loaded target (its parameters and quantized weights) against the
    bytes of its quantized weights: within 1.2x, the norms being the rest. The vocabulary
    matrices are held quantized only: lookups read the quantized lm_head (tied) or an int8 copy
    of the embedding, logits and draft-vocabulary rows the quantized lm_head."""
    hf = make_tiny_target(tmp_path, "qwen3", tie_word_embeddings=tied, vocab_size=64,
                          hidden_size=128, intermediate_size=256)
    target = load_target(tmp_path, torch.float32, quantization=quantization)
    target.pack_weights()
    quantized = [target.packed_head] + [
        getattr(target.get_submodule(name.rpartition(".")[0]), name.rpartition(".")[2])
        for name in target.linear_weights()] + ([] if tied else [target.embed_rows])
    assert all(isinstance(w, QuantizedWeight) for w in quantized)
    packed = sum(w.nbytes for w in quantized)
    resident = packed + sum(p.nbytes for p in target.parameters())
    assert resident <= 1.2 * packed
    assert target.embed is None and target.lm_head is None
    int8 = lambda w: ops.dequantize_int8(*ops.quantize_int8(w.detach().float()))  # noqa: E731
    head = hf.lm_head.weight
    ids = torch.tensor([3, 0, 63, 3])
    assert torch.equal(target.output_rows(ids), int8(head)[ids])
    assert torch.equal(target.embed_tokens(ids), int8(hf.model.embed_tokens.weight)[ids])
    assert torch.equal(target.output_embedding, int8(head))


PEAK = """
import sys, torch
from pathlib import Path
from dflash.models import load_target

def kib(field):
    return int(Path("/proc/self/status").read_text().split(field + ":")[1].split()[0])

torch.set_num_threads(1)
Path("/proc/self/clear_refs").write_text("5")   # resets VmHWM, the peak resident size
before = kib("VmRSS")
model = load_target(sys.argv[1], torch.bfloat16, quantization="int8")
print((kib("VmHWM") - before) * 1024)
"""


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc")
@pytest.mark.parametrize("form", ["safetensors", "gguf"])
def test_loading_quantizes_weight_by_weight(tmp_path, form):
    """The peak resident size while loading a quantized target, less the file (memory-mapped,
    its pages count as resident once read), stays well below the float32 bytes of the weights:
    each is quantized as soon as it is read, a GGUF tensor dequantized only then. Loading in
    float32 (the negative control: every weight held in float32 at once, as a quantized load
    once did) measures above them."""
    import subprocess
    import sys

    hf = make_tiny_target(tmp_path / "hf", "llama", vocab_size=256, hidden_size=512,
                          intermediate_size=2048, num_hidden_layers=16, num_attention_heads=8,
                          num_key_value_heads=8, head_dim=64, tie_word_embeddings=True)
    float32_bytes = 4 * sum(p.numel() for p in hf.parameters())
    if form == "safetensors":
        hf.to(torch.bfloat16).save_pretrained(tmp_path / "hf")   # bf16 on disk
        path, file_bytes = tmp_path / "hf", (tmp_path / "hf" / "model.safetensors").stat().st_size
    else:
        path = tmp_path / "t.gguf"
        write_llama_gguf(hf, path, qtype="Q8_0")
        file_bytes = path.stat().st_size

    def peak(script):
        run = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True,
                             text=True, check=True)
        return int(run.stdout.split()[-1]) - file_bytes

    assert peak(PEAK) < 0.8 * float32_bytes   # measured: 0.5-0.6 (1.2-1.3 holding them all)
    assert peak(PEAK.replace('quantization="int8"', "quantization=None")
                .replace("torch.bfloat16", "torch.float32")) > float32_bytes


def test_an_unknown_quantization_is_refused_and_the_cli_offers_the_known_ones():
    with pytest.raises(ValueError, match="quantization must be None or one of \\['int8', "
                                         "'int4'\\], got 'int2'"):
        EngineArgs("target", quantization="int2")
    with pytest.raises(ValueError, match="draft_quantization must be None or one of "
                                         "\\['int8', 'int4'\\], got 'bf16'"):
        EngineArgs("target", draft_quantization="bf16")
    assert QUANTIZATION_CHOICES == list(QUANTIZATIONS)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_tiny_pair(tmp_path_factory.mktemp("quantized"), 8)


PROMPTS = [[(5 * i + 2 * j) % 90 + 1 for j in range(n)] for i, n in enumerate([6, 13, 2, 18])]


@pytest.mark.parametrize("quantization, speculation", [
    ("int8", "adaptive"), ("int8", "chain"), ("int8", "fixed"), ("int4", "adaptive"),
    ("int4", "fixed")])
def test_dflash_over_a_quantized_target_equals_its_own_decoding(pair, quantization, speculation):
    target, draft, _ = pair
    sp = [SamplingParams(max_tokens=24 + 4 * i) for i in range(len(PROMPTS))]
    base = LLM(target, dtype="float32", max_num_seqs=4, quantization=quantization)
    llm = LLM(target, draft, dtype="float32", max_num_seqs=2, speculation=speculation,
              quantization=quantization)
    layer = llm.target.layers[0]
    assert isinstance(layer.attn.qkv, QuantizedWeight) and isinstance(layer.mlp.down,
                                                                      QuantizedWeight)
    assert (layer.attn.qkv.mins is None) == (quantization == "int8")
    assert isinstance(llm.target.packed_head, QuantizedWeight)
    assert not isinstance(llm.draft.layers[0].q, QuantizedWeight)   # the draft stays as loaded
    outs, expected = llm.generate(PROMPTS, sp), base.generate(PROMPTS, sp)
    assert [o.token_ids for o in outs] == [e.token_ids for e in expected]
    if speculation == "fixed":
        assert sum(o.metrics.num_drafts for o in outs) > 0
    # the weights really are the quantized ones: logits near the float target's, not equal
    float_target = LLM(target, dtype="float32", max_num_seqs=4)
    hidden = torch.randn(2, 64, generator=torch.Generator().manual_seed(0))
    got, want = llm.target.logits(hidden), float_target.target.logits(hidden)
    assert not torch.equal(got, want)
    tol = 0.05 if quantization == "int8" else 0.3
    torch.testing.assert_close(got, want, rtol=tol, atol=tol * float(want.abs().max()))


@pytest.mark.parametrize("draft_quantization", ["int8", "int4"])
def test_a_quantized_draft_changes_no_output(pair, tmp_path, draft_quantization):
    """The draft's block GEMM weights (each layer's q, o and MLP; the K/V slices, the context
    projection, and a draft vocabulary's head) quantized: their products near the float draft's
    (not equal), the target untouched, and DFlash's output still the target's own, token for
    token."""
    target, draft, _ = pair
    vocab_draft = tmp_path / "draft"
    shutil.copytree(draft, vocab_draft)
    (vocab_draft / "draft_vocab.json").write_text(json.dumps({"token_ids": list(range(3, 35))}))
    sp = [SamplingParams(max_tokens=24 + 4 * i) for i in range(len(PROMPTS))]
    expected = [o.token_ids for o in LLM(target, dtype="float32", max_num_seqs=4).generate(
        PROMPTS, sp)]
    plain = LLM(target, vocab_draft, dtype="float32", max_num_seqs=2, speculation="fixed")
    llm = LLM(target, vocab_draft, dtype="float32", max_num_seqs=2, speculation="fixed",
              draft_quantization=draft_quantization)
    d, f = llm.draft, plain.draft
    pairs = [(d.layers[0].q, f.layers[0].q), (d.layers[1].mlp.down, f.layers[1].mlp.down),
             (d.layers[1].mlp.gate_up, f.layers[1].mlp.gate_up), (d.layers[0].o, f.layers[0].o),
             (d.packed_kv[1], f.packed_kv[1]), (d.packed_fc, f.packed_fc),
             (llm.worker.draft_head, plain.worker.draft_head)]
    g = torch.Generator().manual_seed(1)
    for got, want in pairs:
        assert isinstance(got, QuantizedWeight) and not isinstance(want, QuantizedWeight)
        assert (got.mins is None) == (draft_quantization == "int8")
        x = torch.randn(3, unpacked(want).shape[1], generator=g)
        y, z = linear(x, got), linear(x, want)
        tol = 0.05 if draft_quantization == "int8" else 0.3
        assert not torch.equal(y, z)
        torch.testing.assert_close(y, z, rtol=tol, atol=tol * float(z.abs().max()))
    assert not isinstance(llm.target.layers[0].attn.qkv, QuantizedWeight)
    outs = llm.generate(PROMPTS, sp)
    assert [o.token_ids for o in outs] == expected
    assert sum(o.metrics.num_drafts for o in outs) > 0
