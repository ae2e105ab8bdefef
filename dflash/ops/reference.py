"""Pure-PyTorch reference implementations of the dflash operators (docs/design.md section 3): the
three of sections 3.1-3.3, the sampling noise's `philox_bits`, `top_k` and the decoder layer's
small ops (rms_norm, add_rms_norm, silu_and_mul, rope, qkv_rope_cache, panel_linear, quant_linear).

This module is the executable specification: every kernel (C++ CPU, Ascend C under emulation, NPU)
is tested against it. It is written to be obviously right, not fast: explicit per-sequence loops,
float32 math, no fusion.

Precision contract shared by all implementations:
  * GEMMs run in the input dtype through `torch.nn.functional.linear` (float32 accumulation,
    one rounding to the dtype), exactly as the model's own projections do.
  * RMSNorm, softmax and RoPE compute in float32; results are rounded to the output dtype once,
    with round-to-nearest-even.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from . import checks
from .packing import GROUP, from_panels, quantize_activations


def rms_norm_float32(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim in float32; returns float32."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float()


def rope_neox(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE. x [..., T, Hx, D] float32; cos_sin [T, D] = [cos(D/2) | sin(D/2)]."""
    half = x.shape[-1] // 2
    cos, sin = cos_sin[:, None, :half].float(), cos_sin[:, None, half:].float()
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def context_kv(hidden, fc_weight, hidden_norm_weight, kv_weight, kv_bias, k_norm_weight,
               positions, cos_sin_cache, slot_mapping, key_caches, value_caches, eps,
               check: bool = True) -> None:
    """Write the draft's context K/V of N tokens into each layer's paged cache (design 3.1).

    The specification checks every index whatever `check` says (it reads them anyway)."""
    checks.context_kv_meta(hidden, fc_weight, hidden_norm_weight, kv_weight, kv_bias,
                           k_norm_weight, positions, cos_sin_cache, slot_mapping, key_caches,
                           value_caches, eps)
    checks.context_kv_values(positions, cos_sin_cache, slot_mapping, key_caches)
    dtype = hidden.dtype
    x = hidden if fc_weight is None else F.linear(hidden, fc_weight)
    c = rms_norm_float32(x, hidden_norm_weight, eps).to(dtype)
    kv = F.linear(c, kv_weight, kv_bias)

    layers, head_dim = k_norm_weight.shape
    num_blocks, block_size, hkv, _ = key_caches[0].shape
    kv = kv.view(kv.shape[0], layers, 2, hkv, head_dim)   # rows explicit: hkv may be 0
    cos_sin = cos_sin_cache[positions]
    for layer in range(layers):
        k = rms_norm_float32(kv[:, layer, 0], k_norm_weight[layer], eps)
        k = rope_neox(k, cos_sin).to(dtype)
        v = kv[:, layer, 1]
        for t, slot in enumerate(slot_mapping.tolist()):
            if slot == -1:
                continue
            key_caches[layer][slot // block_size, slot % block_size] = k[t]
            value_caches[layer][slot // block_size, slot % block_size] = v[t]


def gather_context(cache: torch.Tensor, block_table_row: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` tokens of one sequence from a paged cache: [length, Hkv, D]."""
    block_size = cache.shape[1]
    if length == 0:   # also where blocks hold no token (block_size 0)
        return cache.new_empty(0, *cache.shape[2:])
    num_blocks = (length + block_size - 1) // block_size
    blocks = cache[block_table_row[:num_blocks].long()]
    return blocks.reshape(-1, *cache.shape[2:])[:length]


def paged_attention(query, key, value, key_cache, value_cache, block_table, context_lens,
                    cu_query_lens, scale, causal, check: bool = True,
                    tree_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of each sequence's new tokens over its cached context plus the new tokens.

    Returns [Tq, Hq, D] in the query dtype (docs/design.md 3.2). Every index is checked whatever
    `check` says, as in context_kv.
    """
    checks.paged_attention_meta(query, key, value, key_cache, value_cache, block_table,
                                context_lens, cu_query_lens, scale, causal, tree_mask)
    checks.paged_attention_values(query, key_cache, block_table, context_lens, cu_query_lens,
                                  tree_mask)
    bits = None if tree_mask is None else \
        ((tree_mask[:, :, None].int() >> torch.arange(8, device=tree_mask.device)) & 1) \
        .flatten(1).bool().cpu()
    out = torch.empty_like(query)
    group = query.shape[1] // key.shape[1]
    cu = cu_query_lens.tolist()
    for b, ctx in enumerate(context_lens.tolist()):
        start, end = cu[b], cu[b + 1]
        if start == end:
            continue
        keys = torch.cat([gather_context(key_cache, block_table[b], ctx), key[start:end]])
        values = torch.cat([gather_context(value_cache, block_table[b], ctx), value[start:end]])
        keys = keys.float().repeat_interleave(group, dim=1)      # [S, Hq, D]
        values = values.float().repeat_interleave(group, dim=1)
        q = query[start:end].float()                             # [n, Hq, D]
        scores = torch.einsum("nhd,shd->hns", q, keys) * scale   # [Hq, n, S]
        if causal:
            n, s = end - start, ctx + end - start
            # new token i sees the context and new tokens 0..i (with a tree: those its bits name)
            visible = torch.arange(s)[None, :] <= ctx + torch.arange(n)[:, None]
            if bits is not None:
                visible[:, ctx:] = bits[start:end, :n]
            scores = scores.masked_fill(~visible.to(scores.device), float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[start:end] = torch.einsum("hns,shd->nhd", probs, values).to(query.dtype)
    return out


def paged_attention_out(query, key, value, key_cache, value_cache, block_table, context_lens,
                        cu_query_lens, scale, causal, check: bool = True,
                        tree_mask: torch.Tensor | None = None, *, out: torch.Tensor) -> None:
    """`paged_attention` written into `out` ([Tq, Hq, D], the query's dtype, contiguous)."""
    checks.paged_attention_meta(query, key, value, key_cache, value_cache, block_table,
                                context_lens, cu_query_lens, scale, causal, tree_mask)
    checks.paged_attention_out(query, out)
    out.copy_(paged_attention(query, key, value, key_cache, value_cache, block_table,
                              context_lens, cu_query_lens, scale, causal, check, tree_mask))


def _noisy_argmax(weights: torch.Tensor, exponential: torch.Tensor) -> int:
    """argmax_v weights[v] / exponential[v] (float32 division, first index on ties).

    With exponential ~ Exp(1) this is a draw from weights / sum(weights) (exponential race).
    """
    return int(torch.argmax(weights / exponential))


def rejection_sample(draft_token_ids, draft_probs, target_probs, is_greedy, uniform,
                     exponential, check: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative-decoding acceptance for a batch of drafts (docs/design.md 3.3).

    Returns (output_token_ids [Bs, K+1] int64 padded with -1, num_accepted [Bs] int64). The
    specification checks every value whatever `check` says (kernels may check only the values
    they read when it is False).
    """
    checks.rejection_sample_meta(draft_token_ids, draft_probs, target_probs, is_greedy, uniform,
                                 exponential)
    checks.rejection_sample_values(draft_token_ids, draft_probs, target_probs, uniform,
                                   exponential)
    bs, k = draft_token_ids.shape
    out = torch.full((bs, k + 1), -1, dtype=torch.int64, device=draft_token_ids.device)
    num_accepted = torch.zeros(bs, dtype=torch.int64, device=draft_token_ids.device)
    for b in range(bs):
        drafts = draft_token_ids[b].tolist()
        p = target_probs[b]
        if bool(is_greedy[b]):
            targets = p.argmax(-1).tolist()  # torch.argmax returns the first maximal index
            a = 0
            while a < k and drafts[a] == targets[a]:
                a += 1
            final = targets[a]
        else:
            a = 0
            while a < k:
                x = drafts[a]
                # float32 product, as every kernel computes it (q = 1 for one-hot proposals)
                coin = uniform[b, a] if draft_probs is None else \
                    uniform[b, a] * draft_probs[b, a, x]
                if bool(coin < p[a, x]):
                    a += 1
                else:
                    break
            if a < k:  # rejected at position a: resample from the residual
                if draft_probs is None:
                    residual = p[a].clone()
                    residual[drafts[a]] = 0
                else:
                    residual = (p[a] - draft_probs[b, a]).clamp(min=0)
                # empty: no value reaches the smallest normal float (hardware that flushes
                # subnormals, as Ascend's vector unit does, sees no mass below it)
                if not bool((residual >= torch.finfo(torch.float32).tiny).any()):
                    residual = p[a]
                final = _noisy_argmax(residual, exponential[b])
            else:  # every draft accepted: the bonus token comes from p_K
                final = _noisy_argmax(p[k], exponential[b])
        out[b, :a] = torch.tensor(drafts[:a], dtype=torch.int64)
        out[b, a] = final
        num_accepted[b] = a
    return out, num_accepted


def rejection_sample_out(draft_token_ids, draft_probs, target_probs, is_greedy, uniform,
                         exponential, check: bool = True, *, output_token_ids: torch.Tensor,
                         num_accepted: torch.Tensor) -> None:
    """`rejection_sample` written into `output_token_ids` [Bs, K+1] and `num_accepted` [Bs]
    (int64, contiguous)."""
    checks.rejection_sample_meta(draft_token_ids, draft_probs, target_probs, is_greedy, uniform,
                                 exponential)
    checks.rejection_sample_out(draft_token_ids, output_token_ids, num_accepted)
    ids, n = rejection_sample(draft_token_ids, draft_probs, target_probs, is_greedy, uniform,
                              exponential, check)
    output_token_ids.copy_(ids)
    num_accepted.copy_(n)


# ---------------------------------------------------------------------------------------------
# philox_bits: Philox4x32-10 in plain tensor ops, which every device has. The 32-bit words live
# in int64 tensors and every product is split so that no intermediate exceeds 2**63: int64
# overflow is not defined behaviour for every backend.
# ---------------------------------------------------------------------------------------------

_M0, _M1 = 0xD2511F53, 0xCD9E8D57          # Philox4x32 multipliers
_W0, _W1 = 0x9E3779B9, 0xBB67AE85          # Weyl key increments
_MASK32 = 0xFFFFFFFF
_ROUNDS = 10


def _mulhilo_(a: torch.Tensor, m: int, t: torch.Tensor, hi: torch.Tensor) -> None:
    """a * m for 32-bit words a and a 32-bit constant m: the low words replace a, the high words
    go to hi (t: scratch). With m = mh * 2**16 + ml, a * m = p * 2**16 + t for p = a * mh and
    t = a * ml, both below 2**48, so hi = (p + (t >> 16)) >> 16 and
    lo = ((p mod 2**16) * 2**16 + t) mod 2**32."""
    torch.mul(a, m & 0xFFFF, out=t)
    a.mul_(m >> 16)
    torch.bitwise_right_shift(t, 16, out=hi).add_(a).bitwise_right_shift_(16)
    a.bitwise_and_(0xFFFF).bitwise_left_shift_(16).add_(t).bitwise_and_(_MASK32)


def philox4x32(counter: Sequence[torch.Tensor | int], key: Sequence[torch.Tensor | int]
               ) -> tuple[torch.Tensor, ...]:
    """Philox4x32-10 of the 32-bit words counter (c0, c1, c2, c3) under key (k0, k1): four
    32-bit words (int64 tensors of the broadcast shape of the inputs).

    Every round works in place on seven buffers of that shape: the four words, two for the high
    products and one scratch; the buffers of the words a round replaces take the next round's
    high products. (Fresh tensors per operation would cost a page-faulting allocation each.)"""
    counter = [torch.as_tensor(c, dtype=torch.int64) for c in counter]
    k0, k1 = (torch.as_tensor(k, dtype=torch.int64) for k in key)
    shape = torch.broadcast_shapes(*(c.shape for c in counter), k0.shape, k1.shape)
    c0, c1, c2, c3 = (c.expand(shape).clone(memory_format=torch.contiguous_format)
                      for c in counter)
    t, hi0, hi2 = (torch.empty_like(c0) for _ in range(3))
    for _ in range(_ROUNDS):
        _mulhilo_(c0, _M0, t, hi0)
        _mulhilo_(c2, _M1, t, hi2)
        # c0' = hi(c2 * M1) ^ c1 ^ k0, c1' = lo(c2 * M1), c2' = hi(c0 * M0) ^ c3 ^ k1,
        # c3' = lo(c0 * M0)
        hi2.bitwise_xor_(c1).bitwise_xor_(k0)
        hi0.bitwise_xor_(c3).bitwise_xor_(k1)
        c0, c1, c2, c3, hi0, hi2 = hi2, c2, hi0, c0, c1, c3
        k0, k1 = (k0 + _W0) & _MASK32, (k1 + _W1) & _MASK32
    return c0, c1, c2, c3


def philox_bits(seeds, offsets, stream, rows, n, check=True):
    """Words [S, rows, n] (int64): element e of row j for sequence i is word e % 4 of
    Philox4x32-10 of counter (e // 4, offsets[i], stream, j) under key (seeds[i, 0],
    seeds[i, 1])."""
    checks.philox_bits_meta(seeds, offsets, stream, rows, n)
    if check:   # reads the values: a device-to-host copy on an accelerator
        checks.philox_bits_values(seeds, offsets)
    device = seeds.device
    row = torch.arange(rows, device=device).view(1, -1, 1)
    element = torch.arange(-(-n // 4), device=device).view(1, 1, -1)
    lanes = philox4x32((element, offsets.view(-1, 1, 1), stream, row),
                       (seeds[:, 0].view(-1, 1, 1), seeds[:, 1].view(-1, 1, 1)))
    return torch.stack(lanes, -1).flatten(-2)[..., :n].contiguous()


# ---------------------------------------------------------------------------------------------
# top_k: a stable sort, whose order among equal values is the index order.
# ---------------------------------------------------------------------------------------------

def top_k(x: torch.Tensor, k: int, probs: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's k largest entries of x [..., V], largest first and lower index first among
    equal ones, NaN above every number (torch.sort's order, and torch.max's): (float32 values
    [..., k], int64 indices [..., k]). With `probs` the values are the entries' softmax
    probabilities over the whole row (float32)."""
    checks.top_k_meta(x, k)
    y = x.float()
    values, indices = torch.sort(y, dim=-1, descending=True, stable=True)
    values, indices = values[..., :k], indices[..., :k]
    if probs:
        values = torch.softmax(y, dim=-1).gather(-1, indices)
    return values.contiguous(), indices.contiguous()


# ---------------------------------------------------------------------------------------------
# The decoder layer's small ops: float32 math, one rounding to x's dtype per output.
# ---------------------------------------------------------------------------------------------

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of x [..., H] (weight [H], any float dtype)."""
    checks.rms_norm_meta(x, weight, eps)
    return rms_norm_float32(x, weight, eps).to(x.dtype).contiguous()


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + x), residual + x); the sum is rounded to the dtype before the norm."""
    checks.add_rms_norm_meta(x, residual, weight, eps)
    total = (residual + x).contiguous()
    return rms_norm_float32(total, weight, eps).to(x.dtype), total


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2I] = [gate | up] -> silu(gate) * up [..., I]."""
    checks.silu_and_mul_meta(x)
    gate, up = x.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(x.dtype).contiguous()


def rope(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """NeoX RoPE of x [T, H, D] by cos_sin [T, D] = [cos(D/2) | sin(D/2)] (float32)."""
    checks.rope_meta(x, cos_sin)
    return rope_neox(x.float(), cos_sin).to(x.dtype)


def qkv_rope_cache(qkv: torch.Tensor, q_norm_weight: torch.Tensor | None,
                   k_norm_weight: torch.Tensor | None, cos_sin: torch.Tensor,
                   key_cache: torch.Tensor, value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                   num_heads: int, eps: float, check: bool = True
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split qkv [T, (Hq + 2 Hkv) D] into q [T, Hq, D], k, v [T, Hkv, D]; q and k heads are
    RMSNormed (when a weight is given) and rotated in float32, rounded once; K and V are written
    to the caches [num_blocks, block_size, Hkv, D] at slot_mapping (-1: skip; of tokens sharing a
    slot, the last one's K/V stay). This function serves the op on every device without a
    kernel, so `check=False` (a checked step plan) skips the slot check: on a device it is a
    device-to-host copy per layer."""
    checks.qkv_rope_cache_meta(qkv, q_norm_weight, k_norm_weight, cos_sin, key_cache, value_cache,
                               slot_mapping, num_heads, eps)
    if check:
        checks.slot_mapping_values("qkv_rope_cache", slot_mapping, key_cache)
    t, (hkv, d) = qkv.shape[0], key_cache.shape[2:]
    q, k, v = qkv.view(t, num_heads + 2 * hkv, d).split([num_heads, hkv, hkv], dim=1)

    def norm_rope(x, weight):
        x = x.float() if weight is None else rms_norm_float32(x, weight, eps)
        return rope_neox(x, cos_sin).to(qkv.dtype)

    q, k, v = norm_rope(q, q_norm_weight), norm_rope(k, k_norm_weight), v.clone()
    # tokens are written in order: of tokens sharing a slot the last one wins
    slots, order = slot_mapping.sort(stable=True)
    last = torch.ones_like(slots, dtype=torch.bool)
    last[:-1] = slots[1:] != slots[:-1]
    tokens = order[last & (slots != -1)]
    block = slot_mapping[tokens].div(key_cache.shape[1], rounding_mode="floor")
    offset = slot_mapping[tokens] % key_cache.shape[1]
    key_cache[block, offset], value_cache[block, offset] = k[tokens], v[tokens]
    return q, k, v


def panel_linear(x: torch.Tensor, weight_panels: torch.Tensor,
                 bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] @ W.T + bias -> [..., N] for W = from_panels(weight_panels), float32 math,
    rounded once to x's dtype."""
    checks.panel_linear_meta(x, weight_panels, bias)
    out = F.linear(x.float(), from_panels(weight_panels).float(),
                   None if bias is None else bias.float())
    return out.to(x.dtype)


def quant_linear(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor,
                 mins: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] @ W.T + bias -> [..., N] for the 8-bit W of `quantize_int8` (weight, scales)
    or the 4-bit W of `quantize_int4` (weight, scales, mins): x quantized per row and group of 32
    (`quantize_activations`), each group's integer dot product with the int8 values or the 4-bit
    codes, then per group in order acc += sum * (w_scale * x_scale) (4 bits: then acc += min *
    (x_scale * sum(x))) in float32, plus the bias, rounded once to x's dtype. (The kernel fuses
    those multiply-adds; the sums are the same integers.)"""
    checks.quant_linear_meta(x, weight, scales, mins, bias)
    k = x.shape[-1]
    xq, xs = quantize_activations(x.reshape(-1, k))
    if mins is None:
        wq = weight.transpose(1, 2).reshape(-1, k).float() - 128   # the codes hold q + 128
    else:
        b = weight.transpose(1, 2)
        wq = torch.stack([b & 15, b >> 4], dim=3).reshape(-1, k).float()
    ws = scales.transpose(1, 2).reshape(wq.shape[0], -1).float()
    wm = None if mins is None else mins.transpose(1, 2).reshape(wq.shape[0], -1).float()
    acc = wq.new_zeros(xq.shape[0], wq.shape[0])
    for g in range(k // GROUP):
        cols = slice(g * GROUP, (g + 1) * GROUP)
        # integers below 2^24 at every step: exact in float32 in any order
        sums = xq[:, cols].float() @ wq[:, cols].T
        acc = acc + sums * (ws[None, :, g] * xs[:, g, None])
        if wm is not None:
            acc = acc + wm[None, :, g] * (xs[:, g, None] * xq[:, cols].sum(-1, keepdim=True))
    if bias is not None:
        acc = acc + bias.float()
    return acc.to(x.dtype).reshape(*x.shape[:-1], wq.shape[0])
