"""Building blocks shared by the target and the draft: norms, RoPE, attention metadata, GEMMs."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from .. import host, ops
from ..ops import reference, registry
from ..ops.packing import GROUP, PANEL
from .config import AttentionConfig


@dataclass
class AttentionMetadata:
    """Where a batch of new tokens sits in the paged caches (docs/design.md 3.2): the step plan
    every layer's attention and cache writes read.

    Sequence b owns rows [cu_query_lens[b], cu_query_lens[b+1]) of the flattened tokens; its
    context_lens[b] cached tokens are read through block_table[b].
    """

    positions: torch.Tensor       # [T] int64 absolute positions
    slot_mapping: torch.Tensor    # [T] int64 cache slots the new tokens' K/V are written to
    block_table: torch.Tensor     # [B, max_blocks] int32
    context_lens: torch.Tensor    # [B] int32
    cu_query_lens: torch.Tensor   # [B + 1] int32
    # True when build_metadata checked every index against the caches' block count on the host:
    # the ops then skip their own value checks (on an NPU each is a device-to-host copy)
    checked: bool = False
    # [T, W] uint8 when the new tokens of each sequence form a tree (paged_attention's tree_mask:
    # a token attends to its context, its ancestors and itself); None: causal
    tree_mask: torch.Tensor | None = None
    # For graph capture: preallocated attention outputs [T, heads, head_dim] by (heads, head_dim);
    # every layer of that shape writes into its buffer (paged_attention.out), read by its output
    # projection before the next layer writes. None: each call allocates its output.
    attention_out: dict[tuple[int, int], torch.Tensor] | None = None

    def attention_output(self, heads: int, head_dim: int) -> torch.Tensor | None:
        return None if self.attention_out is None else self.attention_out[(heads, head_dim)]


def build_metadata(block_tables: list[list[int]], starts: list[int], lengths: list[int],
                   kv_block_size: int, device=None, num_blocks: int | None = None,
                   parents: list[list[int]] | None = None) -> AttentionMetadata:
    """Metadata for `lengths[b]` new tokens of sequence b at positions starts[b].., whose logical
    cache block i is physical block block_tables[b][i].

    Built and checked on the host from the scheduler's lists, then uploaded in one copy. With
    `num_blocks` (the caches' block count) every block a sequence reads or writes must lie in
    [0, num_blocks), and the result is marked `checked`.

    With `parents` (per sequence, the parent of each new token among its new tokens, -1 for
    the root, parents before children) the new tokens form trees: a token's position is start +
    its depth, its slot still start + its index (siblings need their own), and `tree_mask` says
    which new tokens each one sees."""
    if not len(block_tables) == len(starts) == len(lengths):
        raise ValueError(f"build_metadata: {len(block_tables)} block tables, {len(starts)} starts "
                         f"and {len(lengths)} lengths; need one of each per sequence")
    # host arithmetic in numpy: a step builds this twice, and each torch call on tensors this
    # small costs several times a numpy one
    width = max(len(t) for t in block_tables)
    table = np.zeros((len(block_tables), width), dtype=np.int64)
    for b, t in enumerate(block_tables):
        table[b, :len(t)] = t
    starts_n, lengths_n = np.asarray(starts, dtype=np.int64), np.asarray(lengths, dtype=np.int64)
    used = -(-(starts_n + lengths_n) // kv_block_size)   # blocks each sequence reads or writes
    sizes = np.fromiter((len(t) for t in block_tables), dtype=np.int64, count=len(block_tables))
    for b in np.flatnonzero((starts_n < 0) | (lengths_n < 0) | (used > sizes)):
        raise ValueError(f"build_metadata: sequence {b} (start {starts[b]}, {lengths[b]} new "
                         f"tokens) needs start, length >= 0 and {int(used[b])} cache blocks; its "
                         f"block table has {len(block_tables[b])}")
    if num_blocks is not None:
        in_use = np.arange(width)[None] < used[:, None]
        bad = np.argwhere(in_use & ((table < 0) | (table >= num_blocks)))
        if len(bad):
            b, i = (int(x) for x in bad[0])
            raise ValueError(f"build_metadata: block_tables[{b}][{i}] = {int(table[b, i])} is out "
                             f"of range for {num_blocks} cache blocks")
    cu = np.zeros(len(block_tables) + 1, dtype=np.int64)
    cu[1:] = np.cumsum(lengths_n)
    seq = np.repeat(np.arange(len(block_tables)), lengths_n)
    positions = np.arange(cu[-1]) - cu[seq] + starts_n[seq]
    slots = table[seq, positions // kv_block_size] * kv_block_size + positions % kv_block_size
    parts = [positions, slots, table.ravel(), starts_n, cu]
    mask_width = 0
    if parents is not None:
        depths, mask = _tree_rows(parents, lengths)
        positions = parts[0] = starts_n[seq] + depths
        mask_width = mask.shape[1]
        parts.append(mask.ravel().astype(np.int64))
    flat = torch.from_numpy(np.concatenate(parts)).to(device)   # the one upload
    positions, slots, table_d, starts_d, cu_d, *mask_d = flat.split([len(p) for p in parts])
    return AttentionMetadata(positions=positions, slot_mapping=slots,
                             block_table=table_d.view(table.shape).to(torch.int32),
                             context_lens=starts_d.to(torch.int32),
                             cu_query_lens=cu_d.to(torch.int32), checked=num_blocks is not None,
                             tree_mask=mask_d[0].view(-1, mask_width).to(torch.uint8)
                             if mask_d else None)


def _tree_rows(parents: list[list[int]], lengths: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Depths [T] and tree_mask bits [T, W] (each row: its ancestors and itself)."""
    if [len(p) for p in parents] != list(lengths):
        raise ValueError(f"build_metadata: parents of {[len(p) for p in parents]} tokens for "
                         f"{list(lengths)} new tokens")
    width = max(1, (max(lengths, default=0) + 7) // 8)
    total = sum(lengths)
    depths = np.zeros(total, dtype=np.int64)
    bits = np.zeros((total, 8 * width), dtype=bool)
    row = 0
    for par in parents:
        for i, p in enumerate(par):
            if not -1 <= p < i or (p == -1) != (i == 0):
                raise ValueError(f"build_metadata: token {i} of a tree has parent {p}; a tree's "
                                 "first token is its root and every parent comes before")
            if p >= 0:
                bits[row + i] = bits[row + p]
                depths[row + i] = depths[row + p] + 1
            bits[row + i, i] = True
        row += len(par)
    return depths, np.packbits(bits, axis=1, bitorder="little")


def prefill_metadata(lengths: list[int], kv_block_size: int, device=None) -> AttentionMetadata:
    """Fresh sequences of `lengths` tokens, each in its own run of consecutive cache blocks."""
    tables, first = [], 0
    for n in lengths:
        count = -(-n // kv_block_size)
        tables.append(list(range(first, first + count)))
        first += count
    return build_metadata(tables, [0] * len(lengths), lengths, kv_block_size, device)


# Above this many rows (long prefills) MKL's blocked GEMM beats panel_linear's weight streaming,
# even counting the copy back to [N, K] (the crossover on SmolLM2's gate_up and down shapes lies
# between 512 and 2048 rows).
PANEL_MAX_ROWS = 1024


# weight formats a target's GEMM weights may be quantized to on load (docs/design.md 4.7)
QUANTIZATIONS = ("int8", "int4")


@dataclass(frozen=True)
class QuantizedWeight:
    """A linear weight for `ops.quant_linear`: 8 bits from `ops.quantize_int8` (uint8 quad panels
    [N / 16, K / 4, 16, 4] of int8 values + 128, float16 scales [N / 16, K / 32, 16], mins None)
    or 4 bits from `ops.quantize_int4` (nibble panels [N / 16, K / 8, 16, 4], float16 scales and
    mins [N / 16, K / 32, 16])."""

    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.codes, self.scales, self.mins) if t is not None)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the weight, dequantized to float32 [len(ids), K]."""
        return ops.dequantize_rows(self.codes, self.scales, self.mins, ids)


def linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None):
    """F.linear that also takes weights re-laid out by `pack_linear_weight` (inference only:
    packed and quantized weights have no backward). csrc/decoder_layer.cpp tells the forms apart
    the same way."""
    if isinstance(weight, QuantizedWeight):
        return ops.quant_linear(x, weight.codes, weight.scales, weight.mins, bias)
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    if is_panels(weight):
        if x.numel() > PANEL_MAX_ROWS * x.shape[-1]:
            return _long_linear(x, weight, bias)
        return ops.panel_linear(x, weight, bias)
    return torch.nn.functional.linear(x, weight, bias)


def _long_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """`linear` of a panel weight over more than PANEL_MAX_ROWS rows (long prefills): torch's
    blocked GEMM on the weight copied back to [N, K]. Pair panels, which only a CPU with bf16
    units gets, multiply in bf16; column panels in float32, as panel_linear does, rounded once:
    a bf16 weight in column panels means a CPU without bf16 units, whose bf16 GEMM emulates them
    (on an AVX2 CPU about 6x as long as the float32 one for 2048 rows of the bundled target's
    gate_up)."""
    dense = ops.from_panels(weight)
    if weight.dim() == 4:
        return torch.nn.functional.linear(x, dense, bias)
    return torch.nn.functional.linear(x.float(), dense.float(), None if bias is None else
                                      bias.float()).to(x.dtype)


def linear_parts(weight) -> tuple:
    """(weight, scales, mins) as `ops.decoder_layer` takes a linear weight: a quantized one's
    codes, scales and mins (None for 8 bits), any other weight with None, None."""
    if isinstance(weight, QuantizedWeight):
        return weight.codes, weight.scales, weight.mins
    return weight, None, None


def is_panels(weight: torch.Tensor) -> bool:
    """Whether `weight` is a linear weight in one of `panel_linear`'s layouts: column panels
    [N / 16, K, 16] or pair panels [N / 16, K / 2, 16, 2]."""
    return (weight.dim() == 3 and weight.shape[-1] == PANEL) or \
        (weight.dim() == 4 and tuple(weight.shape[-2:]) == (PANEL, 2))


def quantize_linear_weight(weight: torch.Tensor, quantization: str) -> QuantizedWeight | None:
    """`weight` [N, K] in the format `quantization` names (QUANTIZATIONS: "int8",
    `ops.quantize_int8`; "int4", `ops.quantize_int4`), or None where the format cannot hold it
    (N not a multiple of 16, K not of 32, not on CPU, no CPU kernel)."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {list(QUANTIZATIONS)}, "
                         f"got {quantization!r}")
    n, k = weight.shape
    if n % PANEL or k % GROUP or weight.device.type != "cpu" or \
            not registry.has_kernel("quant_linear"):
        return None
    quantize = ops.quantize_int8 if quantization == "int8" else ops.quantize_int4
    return QuantizedWeight(*quantize(weight))


def pack_linear_weight(weight, rows_hint: int = 16):
    """A CPU weight [N, K] re-laid out for the few rows of decoding, else the weight unchanged
    (a quantized one, `QuantizedWeight`, too). Packed weights serve inference only (`linear`), with
    the same float32 accumulation.

    On CPU, torch's GEMMs are slow for small row counts (1-16 rows per sequence). Float32
    weights, and bfloat16 ones as `host.bf16_gemm` says, go to:
    * column panels for `ops.panel_linear` (float32, and bfloat16 on CPUs without bf16 units),
      which streams the weight once per call (bf16 weights widened as they load);
    * pair panels for `ops.panel_linear` (bfloat16 with AVX512-BF16, no AMX; K even): the
      bf16 dot-product instruction;
    * oneDNN's blocked layout (bfloat16 with AMX; `rows_hint` only tunes the layout).
    Both panel layouts compute each row alone, so a row's result does not depend on the rows
    beside it; oneDNN's may. Their times against MKL / oneDNN: docs/performance.md
    (bench/bench_panel_linear.py).
    """
    if isinstance(weight, QuantizedWeight) or weight.device.type != "cpu" or weight.is_mkldnn or \
            weight.dim() != 2:
        return weight
    if weight.dtype not in (torch.float32, torch.bfloat16):
        return weight
    path = host.bf16_gemm() if weight.dtype == torch.bfloat16 else "panels"
    if path == "onednn":
        return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), rows_hint)
    if weight.shape[0] % PANEL or not registry.has_kernel("panel_linear"):
        return weight
    if path == "pairs" and weight.shape[1] % 2 == 0:
        return ops.to_pair_panels(weight)
    return ops.to_panels(weight)


def unpacked(weight: torch.Tensor | QuantizedWeight) -> torch.Tensor:
    """The plain [N, K] tensor of a weight, packed by `pack_linear_weight` or not (a quantized
    one dequantized to float32)."""
    if isinstance(weight, QuantizedWeight):
        return ops.dequantize_int8(weight.codes, weight.scales) if weight.mins is None else \
            ops.dequantize_int4(weight.codes, weight.scales, weight.mins)
    if weight.is_mkldnn:
        return weight.to_dense()
    return ops.from_panels(weight) if is_panels(weight) else weight


def inference_weight(weight: torch.Tensor, quantization: str | None = None):
    """A linear weight [N, K] in the form inference multiplies: quantized to `quantization`
    (`quantize_linear_weight`) where that format holds it, else packed (`pack_linear_weight`)."""
    quantized = None if quantization is None else quantize_linear_weight(weight, quantization)
    return pack_linear_weight(weight) if quantized is None else quantized


def pack_parameter(module: torch.nn.Module, name: str) -> None:
    """Replace the weight parameter `name` of `module` by its packed form (`pack_linear_weight`;
    a quantized weight, an attribute rather than a parameter, stays as it is)."""
    weight = getattr(module, name)
    if isinstance(weight, torch.Tensor):
        packed = pack_linear_weight(weight.data)
        module._parameters[name] = torch.nn.Parameter(packed, requires_grad=False)


def quantize_parameter(module: torch.nn.Module, name: str, quantization: str,
                       dtype: torch.dtype, value: torch.Tensor | None = None) -> None:
    """Replace the weight parameter `name` of `module` by an attribute holding it quantized
    (`quantize_linear_weight`), or, where the format cannot hold it, by the weight in `dtype`.
    `value`: the weight's values, when the parameter does not hold them (yet)."""
    weight = getattr(module, name).data if value is None else value
    quantized = quantize_linear_weight(weight, quantization)
    if quantized is None:
        module._parameters[name] = torch.nn.Parameter(weight.to(dtype), requires_grad=False)
    else:
        delattr(module, name)
        setattr(module, name, quantized)


def use_fused_ops(*tensors: torch.Tensor) -> bool:
    """Whether the fused layer ops (`dflash.ops`) may serve this call: they have no backward, so
    training takes the PyTorch path, which computes the same float32 math. (Under autocast both
    take the dtypes they are given.)"""
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in float32, rounded once to x's dtype."""
    if use_fused_ops(x, weight):
        return ops.rms_norm(x, weight, eps)
    return reference.rms_norm_float32(x, weight, eps).to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + x), residual + x): a residual add and the following norm."""
    if use_fused_ops(x, residual, weight) and x.dtype == residual.dtype:
        return ops.add_rms_norm(x, residual, weight, eps)
    total = residual + x
    return rms_norm(total, weight, eps), total


# positions a RoPE table covers when its user names no longer served length
DEFAULT_ROPE_POSITIONS = 32768


def rope_positions(cfg: AttentionConfig, max_positions: int | None) -> int:
    """Rows of a model's RoPE table: the served length, never more than the model's
    max_position_embeddings (a 1M-context config must not allocate a 1M-row table at load)."""
    return min(cfg.max_position_embeddings, max_positions or DEFAULT_ROPE_POSITIONS)


def rope_cos_sin(cfg: AttentionConfig, max_positions: int) -> torch.Tensor:
    """[max_positions, D] float32 rows [cos(D/2) | sin(D/2)] (NeoX layout), with Llama-3 scaling."""
    d = cfg.head_dim
    inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    if cfg.rope_scaling is not None:
        inv_freq = llama3_scaling(inv_freq, **cfg.rope_scaling)
    angles = torch.arange(max_positions, dtype=torch.float64)[:, None] * inv_freq[None]
    return torch.cat([angles.cos(), angles.sin()], dim=-1).float()


def llama3_scaling(inv_freq, factor, low_freq_factor, high_freq_factor,
                   original_max_position_embeddings):
    """Llama 3.1 frequency scaling: long wavelengths slowed by `factor`, short ones kept, a smooth
    blend in between."""
    low_wavelen = original_max_position_embeddings / low_freq_factor
    high_wavelen = original_max_position_embeddings / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (original_max_position_embeddings / wavelen - low_freq_factor) / \
        (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    return torch.where(wavelen > low_wavelen, inv_freq / factor,
                       torch.where(wavelen < high_wavelen, inv_freq, blended))


def rope(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] -> NeoX-rotated by cos_sin [T, D], float32 math, rounded once to x's dtype."""
    if use_fused_ops(x):
        return ops.rope(x, cos_sin)
    return reference.rope_neox(x.float(), cos_sin).to(x.dtype)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    if use_fused_ops(gate_up):
        return ops.silu_and_mul(gate_up)
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(gate_up.dtype)
