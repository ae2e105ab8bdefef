"""Weight layouts of `panel_linear`: column panels and bfloat16 pair panels, the layouts
csrc/cpu/panel_linear.cpp reads."""

from __future__ import annotations

import torch

PANEL = 16   # output columns per panel of a panel_linear weight


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
