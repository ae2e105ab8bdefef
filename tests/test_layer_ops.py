"""The decoder layer's small ops (rms_norm, add_rms_norm, silu_and_mul, rope, qkv_rope_cache,
panel_linear, quant_linear): the compiled CPU kernels against the PyTorch reference, row
independence, cache writes, clear errors for bad input, and the fake implementations."""

import pytest
import torch

from dflash import ops
from dflash.ops import reference, registry
from dflash.ops.cases import (
    LAYER_OP_INPUTS,
    add_rms_norm_inputs,
    panel_linear_inputs,
    qkv_rope_cache_inputs,
    quant_linear_inputs,
    rms_norm_inputs,
    rope_inputs,
    silu_and_mul_inputs,
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


INPUTS = LAYER_OP_INPUTS


def _run(fn, args):
    """fn on copies of the caches; returns its outputs plus the caches it wrote, as a tuple."""
    args = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    out = fn(**args)
    out = out if isinstance(out, tuple) else (out,)
    return out + tuple(args[k] for k in ("key_cache", "value_cache") if k in args)


def _assert_close_in_dtype(got, expected):
    """Float32 math in another order: a few float32 ulps, which rounding to a narrower dtype can
    turn into one ulp of that dtype."""
    assert got.dtype == expected.dtype and got.shape == expected.shape
    eps = torch.finfo(expected.dtype).eps
    scale = float(expected.float().abs().max())
    torch.testing.assert_close(got.float(), expected.float(), rtol=4 * eps, atol=4 * eps * scale)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", INPUTS)
def test_kernel_matches_reference(op, dtype):
    args = INPUTS[op](dtype)
    for got, expected in zip(_run(getattr(torch.ops.dflash, op), args),
                             _run(getattr(reference, op), args), strict=True):
        _assert_close_in_dtype(got, expected)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_and_mul_and_norms_match_closed_forms(dtype):
    """Independent of the reference: silu(g) * u = g * u / (1 + e^-g); a constant row normalizes
    to the weight; the residual sum is the dtype's own addition."""
    g, u = torch.tensor([[0.0, 2.0, -3.0]]), torch.tensor([[5.0, 0.5, 2.0]])
    got = ops.silu_and_mul(torch.cat([g, u], -1).to(dtype)).float()
    torch.testing.assert_close(got, (g * u / (1 + torch.exp(-g))).to(dtype).float())
    w = torch.tensor([1.0, 2.0, -0.5, 4.0]).to(dtype)
    x = torch.full((2, 4), -3.0, dtype=dtype)
    torch.testing.assert_close(ops.rms_norm(x, w, 0.0), -w.expand(2, 4))
    r = torch.full((2, 4), 7.5, dtype=dtype)
    normed, total = ops.add_rms_norm(x, r, w, 0.0)
    assert torch.equal(total, x + r)
    torch.testing.assert_close(normed, w.expand(2, 4).clone())


def test_rope_rotates_pairs_by_the_angle():
    """Rotating (1, 0) pairs by angle a gives (cos a, sin a); rotating back restores x."""
    d, angles = 8, torch.tensor([[0.3, 1.0, -2.0, 3.1]])
    x = torch.cat([torch.ones(1, 1, d // 2), torch.zeros(1, 1, d // 2)], -1)
    cos_sin = torch.cat([angles.cos(), angles.sin()], -1)
    out = ops.rope(x, cos_sin)
    torch.testing.assert_close(out[0, 0], cos_sin[0])
    back = ops.rope(out, torch.cat([angles.cos(), -angles.sin()], -1))
    torch.testing.assert_close(back, x)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", INPUTS)
def test_a_row_does_not_depend_on_the_rows_beside_it(op, dtype):
    """Each row is computed alone, bit for bit: a 16-token verification row equals the decode of
    that token (what keeps DFlash output equal to target-only output in low precision)."""
    args = INPUTS[op](dtype)
    rows = {k for k in ("x", "residual", "qkv", "cos_sin", "slot_mapping") if k in args}
    together = _run(getattr(torch.ops.dflash, op), args)
    n = args["x" if "x" in args else "qkv"].shape[0]
    for i in range(n):
        alone = _run(getattr(torch.ops.dflash, op), {
            k: v[i:i + 1] if k in rows else v for k, v in args.items()})
        outputs = together[:len(together) - 2] if op == "qkv_rope_cache" else together
        for full, one in zip(outputs, alone):
            assert torch.equal(full[i:i + 1], one)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_qkv_rope_cache_writes_k_and_v_at_their_slots_only(dtype):
    args = qkv_rope_cache_inputs(dtype)
    q, k, v, key_cache, value_cache = _run(ops.qkv_rope_cache, args)
    hkv, d = args["key_cache"].shape[2:]
    flat_k, flat_v = key_cache.view(-1, hkv, d), value_cache.view(-1, hkv, d)
    before_k, before_v = args["key_cache"].view(-1, hkv, d), args["value_cache"].view(-1, hkv, d)
    slots = args["slot_mapping"].tolist()
    for i, slot in enumerate(slots):
        if slot != -1:
            assert torch.equal(flat_k[slot], k[i]) and torch.equal(flat_v[slot], v[i])
    untouched = [s for s in range(flat_k.shape[0]) if s not in slots]
    assert torch.equal(flat_k[untouched], before_k[untouched])
    assert torch.equal(flat_v[untouched], before_v[untouched])
    # v is the projection's v heads as they are
    t, hq = args["qkv"].shape[0], args["num_heads"]
    assert torch.equal(v, args["qkv"].view(t, -1, d)[:, hq + hkv:])


def test_qkv_rope_cache_without_norm_is_rope_of_the_heads():
    args = qkv_rope_cache_inputs(norm=False)
    q, k, _ = ops.qkv_rope_cache(**args)
    t, hq, d = args["qkv"].shape[0], args["num_heads"], args["key_cache"].shape[3]
    heads = args["qkv"].view(t, -1, d)
    assert torch.equal(q, ops.rope(heads[:, :hq].contiguous(), args["cos_sin"]))
    assert torch.equal(k, ops.rope(heads[:, hq:hq + k.shape[1]].contiguous(), args["cos_sin"]))


def test_qkv_rope_cache_writes_strided_per_layer_cache_views():
    """The engine passes views of one stacked [layers, 2, blocks, block_size, Hkv, D] cache."""
    args = qkv_rope_cache_inputs()
    stacked = torch.zeros(2, 2, *args["key_cache"].shape)
    expected = _run(reference.qkv_rope_cache, {**args, "key_cache": stacked[1, 0].clone(),
                                               "value_cache": stacked[1, 1].clone()})
    ops.qkv_rope_cache(**{**args, "key_cache": stacked[1, 0], "value_cache": stacked[1, 1]})
    _assert_close_in_dtype(stacked[1, 0], expected[3])
    assert torch.equal(stacked[1, 1], expected[4]) and not stacked[0].any()


PANEL_SHAPES = [(1, 16, 5), (2, 48, 37), (3, 48, 37), (16, 96, 64), (13, 4096, 576),
                (2, 160, 576), (40, 32, 1536), (7, 32, 2), (9, 64, 38)]


@pytest.mark.parametrize("rows, n, k, dtype, layout", [
    *((*shape, dtype, ops.to_panels) for shape in PANEL_SHAPES for dtype in DTYPES),
    # pair panels: bfloat16 with an even K (the dot-product instruction where the CPU has it)
    *((*shape, torch.bfloat16, ops.to_pair_panels) for shape in PANEL_SHAPES if shape[2] % 2 == 0),
], ids=str)
def test_panel_linear_matches_a_float64_gemm(rows, n, k, dtype, layout):
    """Random (inexact) values, row counts on both sides of the kernels' row tiles, K off the
    vector width, and shapes large enough to split across threads."""
    g = torch.Generator().manual_seed(rows * n + k)
    x, weight = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g) / k**0.5
    bias = torch.randn(n, generator=g)
    x, weight, bias = x.to(dtype), weight.to(dtype), bias.to(dtype)
    expected = x.double() @ weight.double().T + bias.double()
    panels = layout(weight)
    got = ops.panel_linear(x, panels, bias)
    assert got.dtype == dtype and got.shape == (rows, n)
    for i in range(rows):   # inexact values: the row property in earnest
        assert torch.equal(got[i:i + 1], ops.panel_linear(x[i:i + 1], panels, bias))
    # float32 accumulation over k terms, then one rounding to the dtype
    terms = (x.double().abs() @ weight.double().abs().T + bias.double().abs())
    bound = terms * k * 2**-24 + expected.abs() * torch.finfo(dtype).eps / 2
    assert ((got.double() - expected).abs() <= bound + 1e-30).all()
    assert torch.equal(ops.panel_linear(x, panels), ops.panel_linear(x, panels, None))


def test_panels_hold_the_weight_columns_in_blocks_of_16():
    weight = torch.arange(32 * 3.0).view(32, 3)
    panels = ops.to_panels(weight)
    assert panels.shape == (2, 3, 16) and panels[1, 2, 5] == weight[21, 2]
    assert torch.equal(reference.from_panels(panels), weight)
    with pytest.raises(ValueError, match="weight has 30 rows, expected a multiple of 16"):
        ops.to_panels(weight[:30])


def test_pair_panels_hold_each_columns_weights_in_pairs():
    weight = torch.arange(32 * 4.0).view(32, 4).bfloat16()
    pairs = ops.to_pair_panels(weight)
    assert pairs.shape == (2, 2, 16, 2)
    assert pairs[1, 1, 5, 0] == weight[21, 2] and pairs[1, 1, 5, 1] == weight[21, 3]
    assert torch.equal(reference.from_panels(pairs), weight)
    for bad in (weight[:30], weight[:, :3], weight.float()):
        with pytest.raises(ValueError, match="expected bfloat16 with a multiple of 16 rows and "
                                             "an even column count"):
            ops.to_pair_panels(bad)


@pytest.mark.parametrize("rows", [1, 2, 3, 8, 13])
def test_pair_panels_sum_exact_products_exactly(rows):
    """Exact values: the dot-product path (or its float32 stand-in) must give the reference's
    every bit."""
    args = panel_linear_inputs(torch.bfloat16, rows=rows, k=38, pairs=True)
    assert torch.equal(ops.panel_linear(**args), reference.panel_linear(**args))


def test_panel_linear_of_no_rows_is_empty():
    args = panel_linear_inputs(rows=0)
    assert ops.panel_linear(**args).shape == (0, 48)


def test_panel_linear_takes_leading_dims_and_strided_x():
    args = panel_linear_inputs(rows=6)
    x = args["x"].view(2, 3, -1)
    out = ops.panel_linear(x.transpose(0, 1), args["weight_panels"], args["bias"])
    assert out.shape == (3, 2, 48)
    assert torch.equal(out, reference.panel_linear(x.transpose(0, 1), args["weight_panels"],
                                                   args["bias"]))


def _bad_inputs():
    """(op, message pattern, changed arguments)."""
    r, a, s = rms_norm_inputs(), add_rms_norm_inputs(), silu_and_mul_inputs()
    p, q, w = rope_inputs(), qkv_rope_cache_inputs(), panel_linear_inputs()
    pairs = panel_linear_inputs(torch.bfloat16, k=38, pairs=True)
    ql = quant_linear_inputs()
    return [
        ("rms_norm", "x has dtype torch.int64", {"x": r["x"].long()}),
        ("rms_norm", "weight has shape \\[95\\], expected size 96", {"weight": r["weight"][:-1]}),
        ("rms_norm", "x has shape \\[5, 0\\], its last dim is empty", {"x": r["x"][:, :0]}),
        ("rms_norm", "eps must be non-negative, got -1", {"eps": -1.0}),
        ("add_rms_norm", "residual has dtype torch.float16", {"residual": a["residual"].half()}),
        ("add_rms_norm", "residual has shape \\[4, 96\\]", {"residual": a["residual"][:4]}),
        ("silu_and_mul", "its last dim \\(gate \\| up\\) must be even", {"x": s["x"][:, :-1]}),
        ("rope", "x must be 3-D", {"x": p["x"][0]}),
        ("rope", "head_dim 31 must be positive and even", {"x": p["x"][..., :31]}),
        ("qkv_rope_cache", "head_dim 0 must be positive and even",
         {"key_cache": q["key_cache"][..., :0], "value_cache": q["value_cache"][..., :0]}),
        ("rope", "cos_sin has shape \\[4, 32\\], expected size 5 in dim 0",
         {"cos_sin": p["cos_sin"][:4]}),
        ("rope", "cos_sin has dtype torch.bfloat16", {"cos_sin": p["cos_sin"].bfloat16()}),
        ("qkv_rope_cache", "num_heads 3 must be a positive multiple of the caches' 2 kv heads",
         {"num_heads": 3}),
        # (num_heads + 2 kv heads) * head_dim would wrap a 64-bit integer to qkv's own width
        ("qkv_rope_cache", "num_heads 576460752303423492 must be a positive multiple of the "
                           "caches' 2 kv heads, at most 2\\*\\*31 - 1",
         {"num_heads": 2**59 + 4}),
        ("qkv_rope_cache", "qkv has shape \\[5, 255\\], expected size 256 in dim 1",
         {"qkv": q["qkv"][:, :-1]}),
        ("qkv_rope_cache", "qkv has dtype torch.bfloat16", {"qkv": q["qkv"].bfloat16()}),
        ("qkv_rope_cache", "k_norm_weight has shape \\[31\\]",
         {"k_norm_weight": q["k_norm_weight"][:-1]}),
        ("qkv_rope_cache", "value_cache has shape", {"value_cache": q["value_cache"][:2]}),
        ("qkv_rope_cache", "slot_mapping has dtype torch.int32",
         {"slot_mapping": q["slot_mapping"].int()}),
        ("qkv_rope_cache", "slot_mapping\\[2\\] = 12 is out of range for a cache of 3 blocks x 4 "
                           "slots \\(valid: -1 to 11\\)",
         {"slot_mapping": q["slot_mapping"].index_fill(0, torch.tensor([2]), 12)}),
        ("qkv_rope_cache", "slot_mapping\\[0\\] = -2 is out of range",
         {"slot_mapping": q["slot_mapping"].index_fill(0, torch.tensor([0]), -2)}),
        ("qkv_rope_cache", "cos_sin has shape \\[5, 30\\]", {"cos_sin": q["cos_sin"][:, :30]}),
        ("panel_linear", "weight_panels has shape \\[3, 36, 16\\], expected size 37 in dim 1",
         {"weight_panels": w["weight_panels"][:, :36]}),
        ("panel_linear", "weight_panels must be 3-D", {"weight_panels": w["weight_panels"][0]}),
        ("panel_linear", "weight_panels has shape \\[3, 37, 8\\], expected size 16 in dim 2",
         {"weight_panels": w["weight_panels"][..., :8]}),
        ("panel_linear", "bias has dtype torch.int64", {"bias": w["bias"].long()}),
        ("panel_linear", "weight_panels has dtype torch.bfloat16",
         {"weight_panels": w["weight_panels"].bfloat16()}),
        ("panel_linear", "bias has shape \\[47\\], expected size 48", {"bias": w["bias"][:-1]}),
        ("panel_linear", "x has shape \\[5, 0\\], its last dim is empty", {"x": w["x"][:, :0]}),
        ("panel_linear", "pair panels \\(4-D weight_panels\\) hold bfloat16 weights only, got "
                         "torch.float32", {"x": pairs["x"].float(),
                                           "weight_panels": pairs["weight_panels"].float()}),
        ("panel_linear", "pair panels need an even K, x has 39 columns",
         {"x": torch.ones(5, 39, dtype=torch.bfloat16), "weight_panels": pairs["weight_panels"]}),
        ("panel_linear", "weight_panels has shape \\[3, 19, 16, 2\\], expected size 18 in dim 1",
         {"x": pairs["x"][:, :36], "weight_panels": pairs["weight_panels"]}),
        ("quant_linear", "x has 48 columns; quantized weights need a multiple of 32",
         {"x": ql["x"][:, :48]}),
        ("quant_linear", "weight has dtype torch.int8, expected torch.uint8",
         {"weight": ql["weight"].to(torch.int8)}),
        ("quant_linear", "weight has shape \\[3, 8, 16, 4\\], expected size 16 in dim 1",
         {"weight": ql["weight"][:, :8]}),
        ("quant_linear", "scales has shape \\[3, 1, 16\\], expected size 2 in dim 1",
         {"scales": ql["scales"][:, :1]}),
        ("quant_linear", "scales has dtype torch.float32", {"scales": ql["scales"].float()}),
        ("quant_linear", "bias has shape \\[47\\], expected size 48", {"bias": ql["bias"][:-1]}),
    ]


@pytest.mark.parametrize("impl", ["reference", "torch.ops"])
@pytest.mark.parametrize("op, pattern, change", _bad_inputs())
def test_bad_input_raises_clear_error_before_writing(op, pattern, change, impl):
    fn = getattr(reference, op) if impl == "reference" else getattr(torch.ops.dflash, op)
    args = {**INPUTS[op](), **change}
    caches = [args[k].clone() for k in ("key_cache", "value_cache") if k in args]
    with pytest.raises(ValueError, match=f"^{op}: .*{pattern}"):
        fn(**args)
    for before, name in zip(caches, ("key_cache", "value_cache")):
        assert torch.equal(before, args[name])


@pytest.mark.parametrize("op", INPUTS)
def test_opcheck(op):
    torch.library.opcheck(getattr(torch.ops.dflash, op), (), INPUTS[op]())


def test_opcheck_pair_panels():
    torch.library.opcheck(torch.ops.dflash.panel_linear, (),
                          panel_linear_inputs(torch.bfloat16, k=38, pairs=True))


def test_every_layer_op_has_inputs_and_a_kernel():
    assert set(INPUTS) == set(registry.LAYER_OPS)
    for op in registry.LAYER_OPS:
        assert ops.implementation(op).startswith("kernel"), op


@pytest.mark.parametrize("bits", [8, 4])
def test_an_empty_batch_is_served_by_the_reference_as_by_the_kernel(bits):
    """Zero rows: the reference (the op on every device without a kernel) returns what the CPU
    kernel returns, empty results of the right shapes, instead of failing."""
    a = quant_linear_inputs(bits=bits)
    args = (a["x"][:0], a["weight"], a["scales"], a.get("mins"), None)
    assert reference.quant_linear(*args).shape == ops.quant_linear(*args).shape == (0, 48)
    q = qkv_rope_cache_inputs()
    q.update(qkv=q["qkv"][:0], cos_sin=q["cos_sin"][:0], slot_mapping=q["slot_mapping"][:0])
    keys = q["key_cache"].clone()
    kernel, ref = torch.ops.dflash.qkv_rope_cache(**q), reference.qkv_rope_cache(**q)
    assert [t.shape for t in kernel] == [t.shape for t in ref]
    assert torch.equal(q["key_cache"], keys)
