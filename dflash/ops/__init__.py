"""Thin Python wrappers over `torch.ops.dflash.*` (docs/design.md section 3): the three ops, the
sampling noise and the decoder layer's small ops (the last two: CPU kernels; the PyTorch
reference on other devices), and `decoder_layer`, a target layer composed of those ops.

Each op checks its inputs itself (shape, dtype, device, index ranges, probability values) and
raises ValueError naming the problem, whichever implementation serves it; these wrappers add the
documentation and Python defaults. Which implementation serves CPU calls is reported by
`dflash.ops.implementation(name)`: a compiled kernel, or the PyTorch reference as a fallback.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import npu_attention, registry
from .packing import (  # noqa: F401  (the layouts panel_linear and quant_linear take)
    dequantize_int4,
    dequantize_int8,
    dequantize_rows,
    from_panels,
    quantize_int4,
    quantize_int8,
    to_pair_panels,
    to_panels,
)


def implementation(op: str) -> str:
    """'kernel (<capability>)' or 'reference' for the CPU implementation of `op`."""
    if op not in registry.OPS:
        raise ValueError(f"unknown dflash op {op!r}; known: {', '.join(registry.OPS)}")
    return f"kernel ({registry.CPU_CAPABILITY})" if registry.has_kernel(op) else "reference"


def context_kv(hidden: torch.Tensor, fc_weight: torch.Tensor | None,
               hidden_norm_weight: torch.Tensor, kv_weight: torch.Tensor,
               kv_bias: torch.Tensor | None, k_norm_weight: torch.Tensor,
               positions: torch.Tensor, cos_sin_cache: torch.Tensor, slot_mapping: torch.Tensor,
               key_caches: Sequence[torch.Tensor], value_caches: Sequence[torch.Tensor],
               eps: float = 1e-6, check: bool = True) -> None:
    """Materialize the draft's context K/V for N committed tokens into every layer's paged cache.

    c = rms_norm(hidden @ fc_weight.T, hidden_norm_weight); kv = c @ kv_weight.T (+ kv_bias);
    per layer l: K = rope(rms_norm_per_head(k_l, k_norm_weight[l]), positions), V = v_l; both are
    scattered to slot_mapping (slot -1 = skip).

    Args:
        hidden: [N, D_in] target features (float32 / bfloat16 / float16; sets the dtype of all).
        fc_weight: [H, D_in], or None when `hidden` is already [N, H].
        hidden_norm_weight: [H].
        kv_weight: [L * 2 * Hkv * D, H], layer-major: layer l's k_proj rows, then its v_proj rows.
        kv_bias: [L * 2 * Hkv * D] or None.
        k_norm_weight: [L, D].
        positions: [N] int64 absolute positions (index into cos_sin_cache).
        cos_sin_cache: [max_pos, D] float32, rows [cos(D/2) | sin(D/2)].
        slot_mapping: [N] int64, slot = block * block_size + offset, or -1.
        key_caches, value_caches: L tensors [num_blocks, block_size, Hkv, D], written in place.
        check: True checks that every position indexes cos_sin_cache and every slot a cache
            block (a bad one raises a ValueError naming it). On an NPU that reads positions and
            slot_mapping back to the host; False, for a caller whose step plan already checked
            them (`AttentionMetadata.checked`, the engine), skips that copy. The CPU kernels
            read the indices anyway and always check them.
    """
    torch.ops.dflash.context_kv(hidden, fc_weight, hidden_norm_weight, kv_weight, kv_bias,
                                k_norm_weight, positions, cos_sin_cache, slot_mapping,
                                list(key_caches), list(value_caches), eps, check)


def paged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_table: torch.Tensor, context_lens: torch.Tensor,
                    cu_query_lens: torch.Tensor, scale: float, causal: bool,
                    check: bool = True, tree_mask: torch.Tensor | None = None,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of every sequence's new tokens over its paged context plus its new tokens.

    Args:
        query: [Tq, Hq, D]; rows [cu_query_lens[b], cu_query_lens[b+1]) belong to sequence b.
        key, value: [Tq, Hkv, D], the new tokens' own K/V (Hq % Hkv == 0; query head h uses
            kv head h // (Hq / Hkv)).
        key_cache, value_cache: [num_blocks, block_size, Hkv, D].
        block_table: [B, max_blocks] int32; context_lens: [B] int32 (may be 0);
        cu_query_lens: [B + 1] int32, starting at 0 and ending at Tq.
        scale: softmax scale (usually D ** -0.5).
        causal: False: every new token sees all keys of its sequence (DFlash draft block);
            True: new token i sees the context and new tokens 0..i (prefill, decode, verify).
        check: True checks cu_query_lens, context_lens and every block the sequences read
            (as context_kv's `check`: on an NPU a device-to-host copy, skipped with False for
            a checked step plan; the CPU kernels always check).
        tree_mask: None, or [Tq, W] uint8 with causal=True (verifying a tree of drafts): new
            token i of a sequence sees its context and the new tokens j whose bit is set in its
            row (bit j % 8 of byte j // 8, least significant first; 8 W >= the longest
            sequence's new tokens). A row sees itself and only earlier rows of its sequence
            (its ancestors), a subset of the causal mask; with `check` that is checked.

        out: None, or where to write the result ([Tq, Hq, D], the query's dtype and device,
            contiguous; `paged_attention.out`): the op then allocates nothing, as a captured
            graph needs (on an NPU, while `capturing`, an allocating call is refused).

    Returns:
        [Tq, Hq, D] in the query dtype (`out` when given); softmax in float32.

    On an Ascend NPU, `DFLASH_NPU_ATTENTION=fused_infer` serves this call with torch_npu's
    `npu_fused_infer_attention_score` instead of dflash's kernel (see `dflash.ops.npu_attention`).
    """
    return npu_attention.paged_attention(query, key, value, key_cache, value_cache, block_table,
                                         context_lens, cu_query_lens, scale, causal, check,
                                         tree_mask, out)


def rejection_sample(draft_token_ids: torch.Tensor, draft_probs: torch.Tensor | None,
                     target_probs: torch.Tensor, is_greedy: torch.Tensor, uniform: torch.Tensor,
                     exponential: torch.Tensor, check: bool = True,
                     out: tuple[torch.Tensor, torch.Tensor] | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept the longest valid prefix of each draft and emit one correction or bonus token.

    Greedy rows accept while draft[i] == argmax target_probs[i]. Sampling rows accept x_i while
    uniform[i] * q_i(x_i) < p_i(x_i); at the first rejection j they emit
    argmax_v max(p_j - q_j, 0)[v] / exponential[v] (p_j if that residual is all zero); with no
    rejection the bonus is argmax_v p_K[v] / exponential[v]. Given the same noise, every
    implementation returns identical tokens.

    Args:
        draft_token_ids: [Bs, K] int64.
        draft_probs: [Bs, K, V] float32 dense proposal probabilities, or None for one-hot
            proposals (argmax drafts, q(x) = 1).
        target_probs: [Bs, K + 1, V] float32, already temperature / top-k / top-p processed.
        is_greedy: [Bs] bool.
        uniform: [Bs, K] float32 in [0, 1), acceptance coins.
        exponential: [Bs, V] float32 Exp(1) noise for the one resampled token per row.
        check: True checks every token id, probability and noise value first (a bad one
            raises a ValueError naming it); False, for a caller that built them itself (the
            engine), checks only the ids, the coins and the values sampling reads (p and q at the
            drafts up to the first rejection, then the rows that token is drawn from), with the
            same messages. Shapes, dtypes and devices are always checked.
        out: None, or (output_token_ids, num_accepted) to write the results into (int64,
            contiguous; `rejection_sample.out`), as for paged_attention's `out`.

    Returns:
        output_token_ids [Bs, K + 1] int64 (emitted tokens, then -1) and num_accepted [Bs] int64
        (`out` when given).
    """
    args = (draft_token_ids, draft_probs, target_probs, is_greedy, uniform, exponential, check)
    if out is None:
        return torch.ops.dflash.rejection_sample(*args)
    torch.ops.dflash.rejection_sample.out(*args, output_token_ids=out[0], num_accepted=out[1])
    return out


def philox_bits(seeds: torch.Tensor, offsets: torch.Tensor, stream: int, rows: int,
                n: int, check: bool = True) -> torch.Tensor:
    """Counter-based random words: Philox4x32-10 (Salmon et al., SC 2011), each a pure function
    of its key and counter, so a seeded request draws the same noise wherever it runs.

    Args:
        seeds: int64 [S, 2], each sequence's 64-bit key as its low and high 32-bit words.
        offsets: int64 [S] in [0, 2**32), each sequence's counter word 1 (the engine: the
            position of the first token the call decides).
        stream: counter word 2, in [0, 2**32) (which use the noise is for).
        rows, n: the output's last two sizes; counter word 3 is the row.
        check: check that every seed word and offset is in [0, 2**32) (a ValueError names the
            first that is not). False, for a caller that built them from checked integers (the
            sampling noise), skips that read of the values on other devices; the CPU kernel reads
            them anyway and always checks them.

    Returns:
        int64 [S, rows, n] of 32-bit words: element e of row j of sequence i is word e % 4 of the
        output for counter (e // 4, offsets[i], stream, j) under key (seeds[i, 0], seeds[i, 1]).
    """
    return torch.ops.dflash.philox_bits(seeds, offsets, stream, rows, n, check)


def top_k(x: torch.Tensor, k: int, probs: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's k largest entries of x [..., V] (float32 / bfloat16 / float16), largest first
    and lower index first among equal ones, NaN above every number (as torch.sort and torch.max
    rank it).

    Returns (values, indices): float32 [..., k], the entries or, with `probs`, their softmax
    probabilities over the whole row (computed in float32); int64 [..., k]. k = 1 is the first
    argmax."""
    return torch.ops.dflash.top_k(x, k, probs)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim in float32, rounded once: x [..., H] -> [..., H] in x's dtype.

    weight: [H], any float dtype."""
    return torch.ops.dflash.rms_norm(x, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A residual add and the next norm in one pass: (rms_norm(residual + x), residual + x).

    x, residual: [..., H], one dtype; the sum is rounded to it before it is normalized (as
    `residual + x` would be). weight: [H], any float dtype."""
    return torch.ops.dflash.add_rms_norm(x, residual, weight, eps)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Gated MLP activation: x [..., 2I] = [gate | up] -> silu(gate) * up [..., I], float32 math."""
    return torch.ops.dflash.silu_and_mul(x)


def rope(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """NeoX (rotate-half) RoPE: x [T, H, D] -> [T, H, D] in x's dtype, float32 math.

    cos_sin: [T, D] float32, token t's rows [cos(D/2) | sin(D/2)] (the model's table indexed by
    the tokens' positions)."""
    return torch.ops.dflash.rope(x, cos_sin)


def qkv_rope_cache(qkv: torch.Tensor, q_norm_weight: torch.Tensor | None,
                   k_norm_weight: torch.Tensor | None, cos_sin: torch.Tensor,
                   key_cache: torch.Tensor, value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                   num_heads: int, eps: float = 1e-6, check: bool = True
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The attention's input in one pass: heads out of the fused QKV projection, the optional
    per-head q/k RMSNorm (Qwen3), RoPE, and the new tokens' K/V written to the paged caches.

    Args:
        qkv: [T, (Hq + 2 * Hkv) * D], each token's q heads, then k heads, then v heads.
        q_norm_weight, k_norm_weight: [D] (any float dtype) or None for no norm.
        cos_sin: [T, D] float32, token t's rows [cos(D/2) | sin(D/2)].
        key_cache, value_cache: [num_blocks, block_size, Hkv, D] in qkv's dtype, written in place.
        slot_mapping: [T] int64, slot = block * block_size + offset, or -1 (not stored).
        num_heads: Hq.
        check: True checks every slot; False, for a checked step plan, skips that where it
            costs a device-to-host copy (the PyTorch reference, which serves other devices).

    Returns:
        q [T, Hq, D], k [T, Hkv, D] (normed and rotated, float32 math rounded once) and v
        [T, Hkv, D], contiguous, in qkv's dtype.
    """
    return torch.ops.dflash.qkv_rope_cache(qkv, q_norm_weight, k_norm_weight, cos_sin, key_cache,
                                           value_cache, slot_mapping, num_heads, eps, check)


def panel_linear(x: torch.Tensor, weight_panels: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """A linear layer for the few rows of decoding: x [..., K] -> x @ W.T + bias [..., N].

    weight_panels: W [N, K] in column panels, `to_panels(W)`: [N / 16, K, 16] in x's dtype (each
    weight element is read once per call, however many rows x has); or, bfloat16 with K even,
    in pair panels, `to_pair_panels(W)`: [N / 16, K / 2, 16, 2], multiplied with AVX512-BF16's
    dot products where the CPU has them. bias: [N] or None.
    Float32 sums, one rounding to x's dtype; a row's result does not depend on the other rows.
    """
    return torch.ops.dflash.panel_linear(x, weight_panels, bias)


def quant_linear(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor,
                 mins: torch.Tensor | None = None, bias: torch.Tensor | None = None
                 ) -> torch.Tensor:
    """A linear layer over an 8- or 4-bit weight: x [..., K] (K a multiple of 32) -> x @ W.T +
    bias [..., N].

    8 bits, (weight, scales) = `quantize_int8(W)`: weight [N / 16, K / 4, 16, 4] uint8 quad panels
    holding q + 128 for int8 values q, scales [N / 16, K / 32, 16] float16, one per output column
    and group of 32 inputs, W ~ q * scale (`dequantize_int8`; llama.cpp's Q8_0); mins None.
    4 bits, (weight, scales, mins) = `quantize_int4(W)`: weight [N / 16, K / 8, 16, 4] uint8
    nibble panels of codes c in 0..15, scales and mins [N / 16, K / 32, 16] float16, W ~ c * scale
    + min (`dequantize_int4`; llama.cpp's Q4_1). bias: [N] or None.

    x is quantized per row and group of 32 as llama.cpp's Q8_0 does: each group's dot product is
    an exact integer, summed in float32 group by group with both scales (4 bits: plus min * the
    group's sum of x), one rounding to x's dtype. A row's result does not depend on the other
    rows, so DFlash's verification rows equal one-token decodes bit for bit.
    """
    return torch.ops.dflash.quant_linear(x, weight, scales, mins, bias)


def decoder_layer(x: torch.Tensor, residual: torch.Tensor | None, input_norm: torch.Tensor,
                  post_norm: torch.Tensor, qkv: torch.Tensor, qkv_scales: torch.Tensor | None,
                  qkv_mins: torch.Tensor | None, qkv_bias: torch.Tensor | None,
                  q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, o: torch.Tensor,
                  o_scales: torch.Tensor | None, o_mins: torch.Tensor | None,
                  o_bias: torch.Tensor | None, gate_up: torch.Tensor,
                  gate_up_scales: torch.Tensor | None, gate_up_mins: torch.Tensor | None,
                  down: torch.Tensor, down_scales: torch.Tensor | None,
                  down_mins: torch.Tensor | None, cos_sin: torch.Tensor, key_cache: torch.Tensor,
                  value_cache: torch.Tensor, slot_mapping: torch.Tensor, block_table: torch.Tensor,
                  context_lens: torch.Tensor, cu_query_lens: torch.Tensor,
                  tree_mask: torch.Tensor | None, num_heads: int, scale: float, eps: float,
                  check: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """A dense target decoder layer (pre-norm attention, then a gated MLP) as one call of the ops
    above, in this order: (add_)rms_norm, the QKV projection, qkv_rope_cache, paged_attention
    (causal, `tree_mask` as there), the output projection, add_rms_norm, the gate-up projection,
    silu_and_mul, the down projection. The results equal those of the same calls made one by one.

    Args:
        x: [T, H], the previous layer's output, or the embeddings when `residual` is None.
        residual: [T, H], the residual stream x adds to, or None before the first layer.
        input_norm, post_norm: [H], the norms before the attention and before the MLP.
        qkv, o, gate_up, down: the linear weights ([N, K] as `F.linear` takes them, in column or
            pair panels for `panel_linear`, in oneDNN's layout, or quantized codes for
            `quant_linear`, then with their `*_scales` and, 4 bits, `*_mins`; else those None).
        qkv_bias, o_bias: [N] or None. q_norm, k_norm: [D] (Qwen3) or None.
        cos_sin ... cu_query_lens, tree_mask, num_heads, eps, check: as `qkv_rope_cache` and
            `paged_attention` take them; scale: the attention's (head_dim ** -0.5).

    Returns:
        (the MLP's output [T, H], the residual stream [T, H] it adds to).
    """
    return torch.ops.dflash.decoder_layer(
        x, residual, input_norm, post_norm, qkv, qkv_scales, qkv_mins, qkv_bias, q_norm, k_norm,
        o, o_scales, o_mins, o_bias, gate_up, gate_up_scales, gate_up_mins, down, down_scales,
        down_mins, cos_sin, key_cache, value_cache, slot_mapping, block_table, context_lens,
        cu_query_lens, tree_mask, num_heads, scale, eps, check)
