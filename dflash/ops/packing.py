"""Weight layouts of `panel_linear` (column panels, bfloat16 pair panels) and of `quant_linear`
(int8 quad panels with group scales), the layouts csrc/cpu/panel_linear.cpp and
csrc/cpu/quant_linear.cpp read."""

from __future__ import annotations

import torch

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


def quantize_groups(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """values [R, K] (K a multiple of 32) -> (q int8 [R, K], scale float32 [R, K / 32]) with
    values ~ q * scale per group of 32: scale = max|v| / 127, q = round(v * (1 / scale)) (ties to
    even; all zero for a zero group), all in float32 as llama.cpp's Q8_0 quantizer computes it.
    A group holding inf or NaN gets scale NaN (and q 0): what it multiplies becomes NaN."""
    r, k = values.shape
    v = values.float().reshape(r, k // GROUP, GROUP)
    amax = v.abs().amax(-1)
    bad = ~torch.isfinite(amax)
    scale = amax / 127
    inverse = torch.where(scale != 0, 1 / scale, torch.zeros_like(scale))
    q = torch.round(v * inverse[..., None]).masked_fill(bad[..., None], 0)
    return q.to(torch.int8).reshape(r, k), scale.masked_fill(bad, float("nan"))


def to_quad_panels(q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An int8 weight q [N, K] with group scales [N, K / 32] (N a multiple of 16) in
    `quant_linear`'s layout: uint8 quad panels [N / 16, K / 4, 16, 4] holding q + 128,
    quads[p, i, j, t] = q[16 p + j, 4 i + t] + 128 (AVX512-VNNI's unsigned operand, as stored),
    and float32 scales [N / 16, K / 32, 16]."""
    n, k = q.shape
    if n % PANEL or k % GROUP or q.dtype != torch.int8:
        raise ValueError(f"to_quad_panels: weight is {q.dtype} [{n}, {k}], expected int8 with a "
                         f"multiple of {PANEL} rows and of {GROUP} columns")
    codes = (q.to(torch.int16) + 128).to(torch.uint8)
    quads = codes.reshape(n // PANEL, PANEL, k // QUAD, QUAD).transpose(1, 2).contiguous()
    return quads, scale.float().reshape(n // PANEL, PANEL, k // GROUP).transpose(1, 2).contiguous()


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A linear weight [N, K] (N a multiple of 16, K of 32) quantized to 8 bits for
    `quant_linear`: (uint8 quad panels [N / 16, K / 4, 16, 4] holding q + 128, float32 scales
    [N / 16, K / 32, 16]), q and one scale per output column and group of 32 inputs as
    `quantize_groups` gives them."""
    n, k = weight.shape
    if n % PANEL or k % GROUP:
        raise ValueError(f"quantize_int8: weight has shape [{n}, {k}], expected a multiple of "
                         f"{PANEL} rows and of {GROUP} columns")
    return to_quad_panels(*quantize_groups(weight))


def dequantize_int8(weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The float32 weight [N, K] that `quant_linear`'s (weight, scales) stand for:
    (code - 128) * scale."""
    p, quads, _, _ = weight.shape
    q = weight.transpose(1, 2).reshape(p * PANEL, quads * QUAD).float() - 128
    s = scales.transpose(1, 2).reshape(p * PANEL, -1)
    return (q.view(p * PANEL, -1, GROUP) * s[..., None]).reshape(q.shape)
