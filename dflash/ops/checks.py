"""Input checks shared by the reference ops and the fake (meta) implementations.

`*_meta` functions look only at shapes, dtypes and devices, so they also run on fake tensors.
`*_values` functions read index and probability values; they run before an op writes anything, so
an op that rejects its input leaves every output and cache untouched. The C++ and Ascend C kernels
perform the same checks with the same message fragments (the bad-input tests are shared).

Every failure raises ValueError with a message that starts with the op name.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def fail(op: str, message: str) -> None:
    raise ValueError(f"{op}: {message}")


def require(cond: bool, op: str, message: str) -> None:
    if not cond:
        fail(op, message)


def _shape(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def number(x: float) -> str:
    """A float in messages: 9 significant digits (round-trips a float32); csrc/checks.h writes
    the same."""
    return "nan" if x != x else f"{x:.9g}"


def check_tensor(op: str, name: str, t, dtypes, dim: int, shape: Sequence[int | None] | None = None,
           device: torch.device | None = None) -> None:
    """`t` is a tensor of rank `dim`, one of `dtypes`, sizes `shape` (None = any), on `device`."""
    require(isinstance(t, torch.Tensor), op, f"{name} must be a tensor, got {type(t).__name__}")
    dtypes = dtypes if isinstance(dtypes, tuple) else (dtypes,)
    require(t.dtype in dtypes, op,
            f"{name} has dtype {t.dtype}, expected {' or '.join(str(d) for d in dtypes)}")
    require(t.dim() == dim, op, f"{name} must be {dim}-D, got shape {_shape(t)}")
    if shape is not None:
        for i, (got, want) in enumerate(zip(t.shape, shape)):
            require(want is None or got == want, op,
                    f"{name} has shape {_shape(t)}, expected size {want} in dim {i}")
    if device is not None:
        require(t.device == device, op, f"{name} is on {t.device}, expected {device}")


# ---------------------------------------------------------------------------------------------
# philox_bits
# ---------------------------------------------------------------------------------------------

def philox_bits_meta(seeds, offsets, stream, rows, n) -> None:
    """seeds int64 [S, 2] (a 64-bit seed's low and high 32-bit words), offsets int64 [S];
    stream in [0, 2**32), rows and n non-negative."""
    op = "philox_bits"
    check_tensor(op, "seeds", seeds, torch.int64, 2, (None, 2))
    check_tensor(op, "offsets", offsets, torch.int64, 1, (seeds.shape[0],), seeds.device)
    require(0 <= stream < 2**32, op, f"stream must be in [0, 2**32), got {stream}")
    require(rows >= 0 and n >= 0, op, f"rows and n must be non-negative, got {rows} and {n}")
    require(rows <= 2**32 and n <= 2**34, op,   # counter words 3 and 0 (four elements a word)
            f"rows must be at most 2**32 and n at most 2**34, got {rows} and {n}")


def philox_bits_values(seeds, offsets) -> None:
    """Every seed word and offset is a 32-bit word (reads the values)."""
    op = "philox_bits"
    for name, t in (("seeds", seeds), ("offsets", offsets)):
        bad = t[(t < 0) | (t >= 2**32)]
        if bad.numel():
            fail(op, f"{name} must hold 32-bit words in [0, 2**32), got {int(bad[0])}")


# ---------------------------------------------------------------------------------------------
# context_kv
# ---------------------------------------------------------------------------------------------

def context_kv_meta(hidden, fc_weight, hidden_norm_weight, kv_weight, kv_bias, k_norm_weight,
                    positions, cos_sin_cache, slot_mapping, key_caches, value_caches, eps) -> None:
    op = "context_kv"
    check_tensor(op, "hidden", hidden, FLOAT_DTYPES, 2)
    dtype, dev = hidden.dtype, hidden.device
    n, d_in = hidden.shape
    if fc_weight is not None:
        check_tensor(op, "fc_weight", fc_weight, dtype, 2, (None, d_in), dev)
        h = fc_weight.shape[0]
    else:
        h = d_in
    check_tensor(op, "hidden_norm_weight", hidden_norm_weight, dtype, 1, (h,), dev)
    check_tensor(op, "k_norm_weight", k_norm_weight, dtype, 2, device=dev)
    layers, d = k_norm_weight.shape
    require(d % 2 == 0, op, f"head_dim {d} must be even for rotate-half RoPE")
    require(len(key_caches) == layers and len(value_caches) == layers, op,
            f"expected {layers} key and value caches (one per layer of k_norm_weight), "
            f"got {len(key_caches)} key and {len(value_caches)} value caches")
    require(layers > 0, op, "k_norm_weight must describe at least one layer")
    check_tensor(op, "key_caches[0]", key_caches[0], dtype, 4, device=dev)
    cache_shape = tuple(key_caches[0].shape)
    hkv = cache_shape[2]
    require(cache_shape[3] == d, op,
            f"key_caches[0] has head_dim {cache_shape[3]}, k_norm_weight has {d}")
    for name, caches in (("key_caches", key_caches), ("value_caches", value_caches)):
        for i, c in enumerate(caches):
            check_tensor(op, f"{name}[{i}]", c, dtype, 4, cache_shape, dev)
    rows = layers * 2 * hkv * d
    check_tensor(op, "kv_weight", kv_weight, dtype, 2, device=dev)
    require(kv_weight.shape[0] == rows and kv_weight.shape[1] == h, op,
            f"kv_weight has shape {_shape(kv_weight)}, expected [{rows}, {h}] "
            f"(L={layers} x 2 x Hkv={hkv} x D={d} rows, hidden {h})")
    if kv_bias is not None:
        check_tensor(op, "kv_bias", kv_bias, dtype, 1, (rows,), dev)
    check_tensor(op, "positions", positions, torch.int64, 1, (n,), dev)
    check_tensor(op, "slot_mapping", slot_mapping, torch.int64, 1, (n,), dev)
    check_tensor(op, "cos_sin_cache", cos_sin_cache, torch.float32, 2, (None, d), dev)
    require(eps >= 0, op, f"eps must be non-negative, got {number(eps)}")


def context_kv_values(positions, cos_sin_cache, slot_mapping, key_caches) -> None:
    op = "context_kv"
    max_pos = cos_sin_cache.shape[0]
    bad = ((positions < 0) | (positions >= max_pos)).nonzero()
    if len(bad):
        t = int(bad[0])
        fail(op, f"positions[{t}] = {int(positions[t])} is out of range for a cos_sin_cache "
                 f"of {max_pos} positions")
    slot_mapping_values(op, slot_mapping, key_caches[0])


def slot_mapping_values(op: str, slot_mapping, cache) -> None:
    """Every slot is -1 (skip) or a slot of `cache` [num_blocks, block_size, ...]."""
    num_slots = cache.shape[0] * cache.shape[1]
    bad = ((slot_mapping < -1) | (slot_mapping >= num_slots)).nonzero()
    if len(bad):
        t = int(bad[0])
        fail(op, f"slot_mapping[{t}] = {int(slot_mapping[t])} is out of range for a cache of "
                 f"{cache.shape[0]} blocks x {cache.shape[1]} slots "
                 f"(valid: -1 to {num_slots - 1})")


# ---------------------------------------------------------------------------------------------
# paged_attention
# ---------------------------------------------------------------------------------------------

def paged_attention_meta(query, key, value, key_cache, value_cache, block_table, context_lens,
                         cu_query_lens, scale, causal, tree_mask=None) -> None:
    op = "paged_attention"
    check_tensor(op, "query", query, FLOAT_DTYPES, 3)
    dtype, dev = query.dtype, query.device
    tq, hq, d = query.shape
    check_tensor(op, "key", key, dtype, 3, (tq, None, d), dev)
    hkv = key.shape[1]
    check_tensor(op, "value", value, dtype, 3, (tq, hkv, d), dev)
    require(hkv > 0 and hq % hkv == 0, op,
            f"query heads {hq} must be a multiple of kv heads {hkv}")
    check_tensor(op, "key_cache", key_cache, dtype, 4, (None, None, hkv, d), dev)
    check_tensor(op, "value_cache", value_cache, dtype, 4, tuple(key_cache.shape), dev)
    check_tensor(op, "block_table", block_table, torch.int32, 2, device=dev)
    b = block_table.shape[0]
    check_tensor(op, "context_lens", context_lens, torch.int32, 1, (b,), dev)
    check_tensor(op, "cu_query_lens", cu_query_lens, torch.int32, 1, (b + 1,), dev)
    require(scale == scale and abs(scale) != float("inf"), op,
            f"scale must be finite, got {number(scale)}")
    if tree_mask is not None:
        require(causal, op, "tree_mask needs causal=True (a tree is a subset of the causal mask)")
        check_tensor(op, "tree_mask", tree_mask, torch.uint8, 2, (tq, None), dev)


def paged_attention_out(query, out) -> None:
    """paged_attention.out's `out`: the output's shape, dtype and device, contiguous."""
    op = "paged_attention"
    check_tensor(op, "out", out, query.dtype, 3, tuple(query.shape), query.device)
    require(out.is_contiguous(), op, "out must be contiguous")


def paged_attention_values(query, key_cache, block_table, context_lens, cu_query_lens,
                           tree_mask=None) -> None:
    op = "paged_attention"
    tq = query.shape[0]
    num_blocks, block_size = key_cache.shape[:2]
    cu = cu_query_lens.tolist()
    require(cu[0] == 0, op, f"cu_query_lens must start at 0, got {cu[0]}")
    require(cu[-1] == tq, op, f"cu_query_lens must end at the {tq} query rows, got {cu[-1]}")
    for b in range(len(cu) - 1):
        require(cu[b] <= cu[b + 1], op, f"cu_query_lens is not monotone at sequence {b}: "
                                        f"{cu[b]} > {cu[b + 1]}")
    max_blocks = block_table.shape[1]
    for b, ctx in enumerate(context_lens.tolist()):
        require(0 <= ctx <= max_blocks * block_size, op,
                f"context_lens[{b}] = {ctx} is out of range: the block table covers "
                f"{max_blocks} blocks x {block_size} tokens")
        used = block_table[b, : -(-ctx // block_size) if ctx else 0]   # block_size may be 0
        bad = ((used < 0) | (used >= num_blocks)).nonzero()
        if len(bad):
            j = int(bad[0])
            fail(op, f"block_table[{b}, {j}] = {int(used[j])} is out of range for "
                     f"{num_blocks} cache blocks")
    if tree_mask is not None:
        tree_mask_values(tree_mask, cu)


def tree_mask_values(tree_mask: torch.Tensor, cu: list[int]) -> None:
    """Row i of a sequence sees itself and only earlier rows of its sequence (docs/design.md
    3.2): its bits are a subset of the causal mask's, with bit i set."""
    op = "paged_attention"
    width = tree_mask.shape[1]
    longest = max((cu[b + 1] - cu[b] for b in range(len(cu) - 1)), default=0)
    require(8 * width >= longest, op, f"tree_mask has {width} bytes per row, too few for a "
                                      f"sequence of {longest} new tokens")
    bits = ((tree_mask.cpu()[:, :, None].int() >> torch.arange(8)) & 1).flatten(1).bool()
    for b in range(len(cu) - 1):
        for i in range(cu[b + 1] - cu[b]):
            row = bits[cu[b] + i]
            require(bool(row[i]), op, f"tree_mask row {cu[b] + i} (sequence {b}, new token "
                                      f"{i}) does not see itself")
            beyond = row[i + 1:].nonzero()
            if len(beyond):
                fail(op, f"tree_mask row {cu[b] + i} (sequence {b}, new token {i}) sees new token "
                         f"{i + 1 + int(beyond[0])}, which is not before it")


# ---------------------------------------------------------------------------------------------
# rejection_sample
# ---------------------------------------------------------------------------------------------

def rejection_sample_meta(draft_token_ids, draft_probs, target_probs, is_greedy, uniform,
                          exponential) -> None:
    op = "rejection_sample"
    check_tensor(op, "draft_token_ids", draft_token_ids, torch.int64, 2)
    dev = draft_token_ids.device
    bs, k = draft_token_ids.shape
    check_tensor(op, "target_probs", target_probs, torch.float32, 3, (bs, k + 1, None), dev)
    v = target_probs.shape[2]
    require(v > 0, op, "target_probs has an empty vocabulary")
    if draft_probs is not None:
        check_tensor(op, "draft_probs", draft_probs, torch.float32, 3, (bs, k, v), dev)
    check_tensor(op, "is_greedy", is_greedy, torch.bool, 1, (bs,), dev)
    check_tensor(op, "uniform", uniform, torch.float32, 2, (bs, k), dev)
    check_tensor(op, "exponential", exponential, torch.float32, 2, (bs, v), dev)


def rejection_sample_out(draft_token_ids, output_token_ids, num_accepted) -> None:
    """rejection_sample.out's outputs: int64 [bs, k + 1] and [bs] on the inputs' device,
    contiguous."""
    op = "rejection_sample"
    bs, k = draft_token_ids.shape
    dev = draft_token_ids.device
    check_tensor(op, "output_token_ids", output_token_ids, torch.int64, 2, (bs, k + 1), dev)
    check_tensor(op, "num_accepted", num_accepted, torch.int64, 1, (bs,), dev)
    require(output_token_ids.is_contiguous() and num_accepted.is_contiguous(), op,
            "output_token_ids and num_accepted must be contiguous")


def _check_probs(op: str, name: str, probs: torch.Tensor) -> None:
    """Every row of `probs [Bs, R, V]` is finite and non-negative."""
    bad_rows = (~torch.isfinite(probs) | (probs < 0)).any(-1).nonzero()
    if len(bad_rows):
        b, i = (int(x) for x in bad_rows[0])
        row = probs[b, i]
        what = "NaN/Inf" if not torch.isfinite(row).all() else "negative"
        fail(op, f"{name} row (sequence {b}, position {i}) has {what} probabilities")


def rejection_sample_values(draft_token_ids, draft_probs, target_probs, uniform,
                            exponential) -> None:
    op = "rejection_sample"
    v = target_probs.shape[2]
    bad = ((draft_token_ids < 0) | (draft_token_ids >= v)).nonzero()
    if len(bad):
        b, i = (int(x) for x in bad[0])
        fail(op, f"draft_token_ids[{b}, {i}] = {int(draft_token_ids[b, i])} is outside the "
                 f"vocabulary of {v}")
    _check_probs(op, "target_probs", target_probs)
    if draft_probs is not None:
        _check_probs(op, "draft_probs", draft_probs)
    bad = (~((uniform >= 0) & (uniform < 1))).nonzero()
    if len(bad):
        b, i = (int(x) for x in bad[0])
        fail(op, f"uniform[{b}, {i}] = {number(float(uniform[b, i]))} is outside [0, 1)")
    bad = (~((exponential > 0) & torch.isfinite(exponential))).any(-1).nonzero()
    if len(bad):
        fail(op, f"exponential row {int(bad[0])} must be positive and finite (Exp(1) noise)")


# ---------------------------------------------------------------------------------------------
# layer ops: rms_norm, add_rms_norm, silu_and_mul, rope, qkv_rope_cache, panel_linear,
# quant_linear; and top_k, which reads rows as they do
# ---------------------------------------------------------------------------------------------

def _rows_input(op: str, x) -> None:
    """`x` [..., H] is a float tensor of rank >= 1 with a non-empty last dim."""
    check_tensor(op, "x", x, FLOAT_DTYPES, max(x.dim(), 1) if isinstance(x, torch.Tensor) else 1)
    require(x.shape[-1] > 0, op, f"x has shape {_shape(x)}, its last dim is empty")


def top_k_meta(x, k) -> None:
    """x [..., V] floats; 1 <= k <= V."""
    op = "top_k"
    _rows_input(op, x)
    require(1 <= k <= x.shape[-1], op, f"k must be in [1, {x.shape[-1]}] (x's last dim), got {k}")


def rms_norm_meta(x, weight, eps, op: str = "rms_norm") -> None:
    _rows_input(op, x)
    check_tensor(op, "weight", weight, FLOAT_DTYPES, 1, (x.shape[-1],), x.device)
    require(eps >= 0, op, f"eps must be non-negative, got {number(eps)}")


def add_rms_norm_meta(x, residual, weight, eps) -> None:
    op = "add_rms_norm"
    rms_norm_meta(x, weight, eps, op)
    check_tensor(op, "residual", residual, x.dtype, x.dim(), tuple(x.shape), x.device)


def silu_and_mul_meta(x) -> None:
    op = "silu_and_mul"
    _rows_input(op, x)
    require(x.shape[-1] % 2 == 0, op,
            f"x has shape {_shape(x)}, its last dim (gate | up) must be even")


def panel_linear_meta(x, weight_panels, bias) -> None:
    """weight_panels [N / 16, K, 16] (`ops.to_panels`) in x's dtype, or bfloat16 pair panels
    [N / 16, K / 2, 16, 2] (`ops.to_pair_panels`, K even); bias [N]."""
    op = "panel_linear"
    _rows_input(op, x)
    k = x.shape[-1]
    if isinstance(weight_panels, torch.Tensor) and weight_panels.dim() == 4:
        check_tensor(op, "weight_panels", weight_panels, x.dtype, 4, (None, k // 2, 16, 2),
                     x.device)
        require(x.dtype == torch.bfloat16, op, "pair panels (4-D weight_panels) hold bfloat16 "
                f"weights only, got {x.dtype}")
        require(k % 2 == 0, op, f"pair panels need an even K, x has {k} columns")
    else:
        check_tensor(op, "weight_panels", weight_panels, x.dtype, 3, (None, k, 16), x.device)
    if bias is not None:
        check_tensor(op, "bias", bias, FLOAT_DTYPES, 1, (weight_panels.shape[0] * 16,), x.device)


def quant_linear_meta(x, weight, scales, mins, bias) -> None:
    """8 bits: weight [N / 16, K / 4, 16, 4] uint8 quad panels (`ops.quantize_int8`), no mins;
    4 bits: weight [N / 16, K / 8, 16, 4] uint8 nibble panels (`ops.quantize_int4`) and mins;
    scales [N / 16, K / 32, 16] float16 (and 4 bits, mins alike); K a multiple of 32; bias
    [N]."""
    op = "quant_linear"
    _rows_input(op, x)
    k = x.shape[-1]
    require(k % 32 == 0, op, f"x has {k} columns; quantized weights need a multiple of 32 (one "
            "scale per group of 32)")
    per_vector = 4 if mins is None else 8   # inputs per 64-byte vector of a panel
    check_tensor(op, "weight", weight, torch.uint8, 4, (None, k // per_vector, 16, 4), x.device)
    check_tensor(op, "scales", scales, torch.float16, 3, (weight.shape[0], k // 32, 16), x.device)
    if mins is not None:
        check_tensor(op, "mins", mins, torch.float16, 3, tuple(scales.shape), x.device)
    if bias is not None:
        check_tensor(op, "bias", bias, FLOAT_DTYPES, 1, (weight.shape[0] * 16,), x.device)


def qkv_rope_cache_meta(qkv, q_norm_weight, k_norm_weight, cos_sin, key_cache, value_cache,
                        slot_mapping, num_heads, eps) -> None:
    op = "qkv_rope_cache"
    check_tensor(op, "key_cache", key_cache, FLOAT_DTYPES, 4)
    dtype, dev = key_cache.dtype, key_cache.device
    hkv, d = key_cache.shape[2:]
    require(d > 0 and d % 2 == 0, op,
            f"head_dim {d} must be positive and even for rotate-half RoPE")
    check_tensor(op, "value_cache", value_cache, dtype, 4, tuple(key_cache.shape), dev)
    # bounded: a larger count would overflow the width below in the C++ kernels' int64
    require(hkv > 0 and 0 < num_heads <= 2**31 - 1 and num_heads % hkv == 0, op,
            f"num_heads {num_heads} must be a positive multiple of the caches' {hkv} kv heads, "
            "at most 2**31 - 1")
    check_tensor(op, "qkv", qkv, dtype, 2, (None, (num_heads + 2 * hkv) * d), dev)
    t = qkv.shape[0]
    for name, w in (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
        if w is not None:
            check_tensor(op, name, w, FLOAT_DTYPES, 1, (d,), dev)
    check_tensor(op, "cos_sin", cos_sin, torch.float32, 2, (t, d), dev)
    check_tensor(op, "slot_mapping", slot_mapping, torch.int64, 1, (t,), dev)
    require(eps >= 0, op, f"eps must be non-negative, got {number(eps)}")


def rope_meta(x, cos_sin) -> None:
    op = "rope"
    check_tensor(op, "x", x, FLOAT_DTYPES, 3)
    d = x.shape[2]
    require(d > 0 and d % 2 == 0, op,
            f"head_dim {d} must be positive and even for rotate-half RoPE")
    check_tensor(op, "cos_sin", cos_sin, torch.float32, 2, (x.shape[0], d), x.device)
