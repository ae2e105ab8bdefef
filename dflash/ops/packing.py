"""Weight layouts of `panel_linear` (column panels, bfloat16 pair panels) and of `quant_linear`
(8-bit quad panels with group scales, 4-bit nibble panels with group scales and minimums), the
layouts csrc/cpu/panel_linear.cpp and csrc/cpu/quant_linear.cpp read, and the quantizers."""

from __future__ import annotations

import torch

FLOAT16_MAX = 65504.0   # the largest float16: weight scales (and int4's minimums) are float16
PANEL = 16   # output columns per panel of a panel_linear or quant_linear weight
QUAD = 4     # inputs per 32-bit lane of a quad panel
GROUP = 32   # inputs per int8 scale (llama.cpp's Q8_0 block)


def to_panels(weight: torch.Tensor) -> torch.Tensor:
    """A linear weight [N, K] (N a multiple of 16) in column panels [N / 16, K, 16]:
    panels[p, k, j] = weight[16 p + j, k]."""
    n, k = weight.shape
    if n % PANEL:
        raise ValueError(f"to_panels: weight has {n} rows, expected a multiple of {PANEL}")
    return weight.reshape(n // PANEL, PANEL, k).transpose(1, 2).contiguous()


def to_pair_panels(weight: torch.Tensor) -> torch.Tensor:
    """A bfloat16 linear weight [N, K] (N a multiple of 16, K even) in pair panels
    [N / 16, K / 2, 16, 2]: pairs[p, i, j, t] = weight[16 p + j, 2 i + t], the operand layout of
    AVX512-BF16's dot-product instruction."""
    n, k = weight.shape
    if n % PANEL or k % 2 or weight.dtype != torch.bfloat16:
        raise ValueError(f"to_pair_panels: weight is {weight.dtype} [{n}, {k}], expected "
                         f"bfloat16 with a multiple of {PANEL} rows and an even column count")
    return weight.reshape(n // PANEL, PANEL, k // 2, 2).transpose(1, 2).contiguous()


def from_panels(weight_panels: torch.Tensor) -> torch.Tensor:
    """The [N, K] weight of `to_panels`' or `to_pair_panels`' layout."""
    if weight_panels.dim() == 4:
        p, half, _, _ = weight_panels.shape
        return weight_panels.transpose(1, 2).reshape(p * PANEL, 2 * half)
    p, k, _ = weight_panels.shape
    return weight_panels.transpose(1, 2).reshape(p * PANEL, k)


def _groups(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """values [R, K] -> (groups [R, K / 32, 32] float32, max |v| per group, non-finite groups)."""
    r, k = values.shape
    v = values.float().reshape(r, k // GROUP, GROUP)
    amax = v.abs().amax(-1)
    return v, amax, ~torch.isfinite(amax)


def _codes(v, inverse, bad) -> torch.Tensor:
    return torch.round(v * inverse[..., None]).masked_fill(bad[..., None], 0).to(torch.int8) \
        .flatten(1)


def quantize_groups(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """values [R, K] (K a multiple of 32) -> (q int8 [R, K], scale float32 [R, K / 32]) with
    values ~ q * scale per group of 32: scale = max|v| / 127, q = round(v * (1 / scale)) (ties to
    even; all zero for a zero group), in float32 (llama.cpp's Q8_0 quantizer, which then stores
    the scale in float16, as `quantize_int8` does). A group holding inf or NaN gets scale NaN
    (and q 0): what it multiplies becomes NaN."""
    v, amax, bad = _groups(values)
    scale = amax / 127
    inverse = torch.where(scale != 0, 1 / scale, torch.zeros_like(scale))
    return _codes(v, inverse, bad), scale.masked_fill(bad, float("nan"))


def quantize_activations(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quant_linear`'s input rows [R, K] quantized as llama.cpp quantizes a Q8_0 matmul's input
    on x86: q = round(v * (127 / max|v|)) (ties to even), scale = max|v| / 127 rounded to float16,
    as its Q8_0 blocks store it (kept in float32 where float16 would overflow, above 65504).
    Non-finite groups as in `quantize_groups`."""
    v, amax, bad = _groups(values)
    # a tensor quotient: `127 / amax` would be reciprocal(amax) * 127, rounded twice
    inverse = torch.where(amax != 0, torch.full_like(amax, 127) / amax, torch.zeros_like(amax))
    scale = amax / 127
    half = scale.half().float()
    scale = torch.where(torch.isinf(half), scale, half)
    return _codes(v, inverse, bad), scale.masked_fill(bad, float("nan"))


def to_quad_panels(q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An int8 weight q [N, K] with group scales [N, K / 32] (N a multiple of 16) in
    `quant_linear`'s layout: uint8 quad panels [N / 16, K / 4, 16, 4] holding q + 128,
    quads[p, i, j, t] = q[16 p + j, 4 i + t] + 128 (AVX512-VNNI's unsigned operand, as stored),
    and float16 scales [N / 16, K / 32, 16] (Q8_0's block field; values beyond float16's
    become inf)."""
    n, k = q.shape
    if n % PANEL or k % GROUP or q.dtype != torch.int8:
        raise ValueError(f"to_quad_panels: weight is {q.dtype} [{n}, {k}], expected int8 with a "
                         f"multiple of {PANEL} rows and of {GROUP} columns")
    codes = (q.to(torch.int16) + 128).to(torch.uint8)
    quads = codes.reshape(n // PANEL, PANEL, k // QUAD, QUAD).transpose(1, 2).contiguous()
    return quads, _group_rows(scale, torch.float16)


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A linear weight [N, K] (N a multiple of 16, K of 32) quantized to 8 bits for
    `quant_linear`, as llama.cpp's Q8_0: (uint8 quad panels [N / 16, K / 4, 16, 4] holding
    q + 128, float16 scales [N / 16, K / 32, 16]), q and one scale per output column and group of
    32 inputs as `quantize_groups` gives them, the scale then rounded to float16 as Q8_0's blocks
    store it (34 bytes per 32 weights). A GGUF Q8_0 tensor's values quantize back to its own codes
    and scales. A group whose scale float16 cannot hold (max |w| / 127 beyond 65504) raises a
    ValueError."""
    n, k = weight.shape
    _check_quantizable("quantize_int8", n, k)
    q, scale = quantize_groups(weight)
    if bool((torch.isfinite(scale) & torch.isinf(scale.half())).any()):
        raise ValueError(f"quantize_int8: the weight holds {float(weight.abs().max()):g}; its "
                         f"float16 scales hold max |w| / 127 up to {FLOAT16_MAX:g} (keep it "
                         "in float)")
    return to_quad_panels(q, scale)


def dequantize_int8(weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The float32 weight [N, K] that `quant_linear`'s (weight, scales) stand for:
    (code - 128) * scale."""
    p, quads, _, _ = weight.shape
    q = weight.transpose(1, 2).reshape(p * PANEL, quads * QUAD).float() - 128
    s = scales.transpose(1, 2).reshape(p * PANEL, -1).float()
    return (q.view(p * PANEL, -1, GROUP) * s[..., None]).reshape(q.shape)


def _check_quantizable(what: str, n: int, k: int) -> None:
    if n % PANEL or k % GROUP:
        raise ValueError(f"{what}: weight has shape [{n}, {k}], expected a multiple of {PANEL} "
                         f"rows and of {GROUP} columns")


def _group_rows(t: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[N, K / 32] per-group values -> [N / 16, K / 32, 16] in `dtype` (the panels' order)."""
    n, groups = t.shape
    return t.to(dtype).reshape(n // PANEL, PANEL, groups).transpose(1, 2).contiguous()


def quantize_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A linear weight [N, K] (N a multiple of 16, K of 32) quantized to 4 bits for
    `quant_linear`, as llama.cpp's Q4_1: per output column and group of 32 inputs, min = the
    smallest value, scale = (largest - min) / 15, code = trunc((w - min) / scale + 0.5) capped at
    15 (0 for a constant group), scale and min then rounded to float16 as Q4_1 stores them; W ~
    code * scale + min. A weight whose values are exactly Q4_0's (scale * (code - 8), the
    scale a float16: a GGUF Q4_0 tensor) keeps that form instead (min = -8 * scale). Returns
    (uint8 nibble panels [N / 16, K / 8, 16, 4], scales, mins [N / 16, K / 32, 16] float16).
    A GGUF Q4_0 or Q4_1 tensor's values quantize back to its own codes and scales. Values beyond
    float16's range (or NaN) raise a ValueError: no float16 minimum holds them."""
    n, k = weight.shape
    _check_quantizable("quantize_int4", n, k)
    v = weight.float().reshape(n, k // GROUP, GROUP)
    largest = float(v.abs().max()) if v.numel() else 0.0
    if not largest <= FLOAT16_MAX:   # NaN too
        raise ValueError(f"quantize_int4: the weight holds {largest:g}; its float16 scales and "
                         f"minimums hold values up to {FLOAT16_MAX:g} (keep it in int8 or float)")
    symmetric = _q4_0_form(v)
    if symmetric is not None:
        codes, scale = symmetric
        return to_nibble_panels(codes.reshape(n, k), scale, -8 * scale)
    low, high = v.amin(-1), v.amax(-1)
    scale = (high - low) / 15
    inverse = torch.where(scale != 0, 1 / scale, torch.zeros_like(scale))
    codes = ((v - low[..., None]) * inverse[..., None] + 0.5).trunc().clamp(0, 15)
    return to_nibble_panels(codes.to(torch.uint8).reshape(n, k), scale.half().float(),
                            low.half().float())


def _q4_0_form(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(codes [N, G, 32] uint8, scales [N, G]) if every group of v [N, G, 32] is exactly
    scale * (code - 8) with a float16 scale, as llama.cpp's Q4_0 dequantizes (its largest
    magnitude is -8 * scale), else None."""
    largest = v.gather(-1, v.abs().argmax(-1, keepdim=True)).squeeze(-1)
    scale = largest / -8
    inverse = torch.where(scale != 0, 1 / scale, torch.zeros_like(scale))
    codes = (v * inverse[..., None] + 8).round().clamp(0, 15)
    exact = torch.equal((codes - 8) * scale[..., None], v) and \
        torch.equal(scale.half().float(), scale)
    return (codes.to(torch.uint8), scale) if exact else None


def to_nibble_panels(codes: torch.Tensor, scale: torch.Tensor, low: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """4-bit codes [N, K] (uint8, 0..15) with group scales and minimums [N, K / 32] in
    `quant_linear`'s layout: uint8 nibble panels [N / 16, K / 8, 16, 4], byte [p, i, j, t] =
    codes[16 p + j, 8 i + t] | codes[16 p + j, 8 i + 4 + t] << 4, and float16 scales and mins
    [N / 16, K / 32, 16] (Q4_1's block fields; values beyond float16's become inf)."""
    n, k = codes.shape
    _check_quantizable("to_nibble_panels", n, k)
    c = codes.reshape(n // PANEL, PANEL, k // 8, 2, QUAD).to(torch.uint8)
    packed = c[:, :, :, 0] | (c[:, :, :, 1] << 4)          # [P, 16, K / 8, 4]
    return (packed.transpose(1, 2).contiguous(), _group_rows(scale, torch.float16),
            _group_rows(low, torch.float16))


def dequantize_int4(weight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor
                    ) -> torch.Tensor:
    """The float32 weight [N, K] that `quant_linear`'s 4-bit (weight, scales, mins) stand for:
    code * scale + min."""
    p, vectors, _, _ = weight.shape
    b = weight.transpose(1, 2)                                  # [P, 16, K / 8, 4]
    codes = torch.stack([b & 15, b >> 4], dim=3).reshape(p * PANEL, vectors * 8).float()
    s = scales.transpose(1, 2).reshape(p * PANEL, -1).float()
    m = mins.transpose(1, 2).reshape(p * PANEL, -1).float()
    return (codes.view(p * PANEL, -1, GROUP) * s[..., None] + m[..., None]).reshape(codes.shape)


def dequantize_rows(weight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                    ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` [n] of the float32 weight [N, K] that `quant_linear`'s (weight, scales[, mins])
    stand for (8 bits without mins, 4 bits with): [n, K], without dequantizing the rest (an
    embedding lookup through a quantized tied lm_head)."""
    panel, column = ids // PANEL, ids % PANEL
    lanes = weight[panel, :, column]                       # [n, K / 4 or K / 8, 4]
    s = scales[panel, :, column].float()                   # [n, K / 32]
    n = ids.shape[0]
    if mins is None:
        q = lanes.reshape(n, -1).float() - 128
        return (q.view(n, -1, GROUP) * s[..., None]).view(n, -1)
    codes = torch.stack([lanes & 15, lanes >> 4], dim=2).reshape(n, -1).float()
    m = mins[panel, :, column].float()
    return (codes.view(n, -1, GROUP) * s[..., None] + m[..., None]).view(n, -1)
