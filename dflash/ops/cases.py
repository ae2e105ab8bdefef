"""Random, valid inputs for the three ops (tests mutate them to build bad cases).

Shared by the reference tests, the kernel tests and the benchmarks so every implementation is
exercised on the same cases.
"""

from __future__ import annotations

import random

import torch

from . import packing


def rope_cache(max_pos: int, head_dim: int, theta: float = 1e6) -> torch.Tensor:
    """[max_pos, D] float32 rows [cos(D/2) | sin(D/2)] for NeoX RoPE."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.cat([angles.cos(), angles.sin()], dim=-1).float()


def context_kv_inputs(n=5, d_in=48, h=32, layers=2, hkv=2, d=16, num_blocks=6, block_size=4,
                      with_fc=True, with_bias=False, dtype=torch.float32, stacked=False,
                      skip_every=0, seed=0) -> dict:
    """Caches hold NaN; `stacked`: False = one tensor per cache, True = views of one
    [2, L, num_blocks, ...] tensor, "block_major" = views of one [num_blocks, L, 2, ...] tensor,
    "vllm_cpu" = per layer views of one [num_blocks, Hkv, 2 * block_size, D] tensor with K
    transposed inside each block (head_dim stride block_size), as vLLM's CPU attention keeps it."""
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    rows = layers * 2 * hkv * d
    slots = torch.randperm(num_blocks * block_size, generator=g)[:n]
    if skip_every:
        slots[::skip_every] = -1
    cache_shape = (num_blocks, block_size, hkv, d)
    if stacked == "vllm_cpu":
        kv = [torch.full((num_blocks, hkv, 2, block_size * d), float("nan"), dtype=dtype)
              for _ in range(layers)]
        key_caches = [c[:, :, 0].view(num_blocks, hkv, d, block_size).permute(0, 3, 1, 2)
                      for c in kv]
        value_caches = [c[:, :, 1].view(num_blocks, hkv, block_size, d).transpose(1, 2)
                        for c in kv]
    elif stacked == "block_major":   # [num_blocks, L, 2, ...]: each cache is a strided view
        kv = torch.full((num_blocks, layers, 2, *cache_shape[1:]), float("nan"), dtype=dtype)
        key_caches, value_caches = list(kv[:, :, 0].unbind(1)), list(kv[:, :, 1].unbind(1))
    elif stacked:                  # [2, L, ...]: each cache is a contiguous slice
        kc, vc = torch.full((2, layers, *cache_shape), float("nan"), dtype=dtype).unbind(0)
        key_caches, value_caches = list(kc.unbind(0)), list(vc.unbind(0))
    else:
        key_caches = [torch.full(cache_shape, float("nan"), dtype=dtype) for _ in range(layers)]
        value_caches = [torch.full(cache_shape, float("nan"), dtype=dtype) for _ in range(layers)]
    return dict(
        hidden=rnd(n, d_in if with_fc else h),
        fc_weight=rnd(h, d_in) / d_in**0.5 if with_fc else None,
        hidden_norm_weight=1 + 0.1 * rnd(h),
        kv_weight=rnd(rows, h) / h**0.5,
        kv_bias=0.1 * rnd(rows) if with_bias else None,
        k_norm_weight=1 + 0.1 * rnd(layers, d),
        positions=torch.randint(0, 64, (n,), generator=g),
        cos_sin_cache=rope_cache(64, d),
        slot_mapping=slots.long(),
        key_caches=key_caches,
        value_caches=value_caches,
        eps=1e-6,
    )


def paged_attention_inputs(context_lens=(3, 0, 9), query_lens=(2, 1, 4), hq=4, hkv=2, d=8,
                           block_size=4, extra_blocks=2, causal=False, dtype=torch.float32,
                           seed=0) -> dict:
    """A ragged batch whose sequences own shuffled, non-contiguous cache blocks."""
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    blocks_per_seq = [(c + block_size - 1) // block_size for c in context_lens]
    max_blocks = max(max(blocks_per_seq), 1)
    num_blocks = sum(blocks_per_seq) + extra_blocks
    order = torch.randperm(num_blocks, generator=g)
    block_table = torch.zeros(len(context_lens), max_blocks, dtype=torch.int32)
    used = 0
    for b, nb in enumerate(blocks_per_seq):
        block_table[b, :nb] = order[used : used + nb].int()
        used += nb
    tq = sum(query_lens)
    cu = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    return dict(
        query=rnd(tq, hq, d),
        key=rnd(tq, hkv, d),
        value=rnd(tq, hkv, d),
        key_cache=rnd(num_blocks, block_size, hkv, d),
        value_cache=rnd(num_blocks, block_size, hkv, d),
        block_table=block_table,
        context_lens=torch.tensor(context_lens, dtype=torch.int32),
        cu_query_lens=cu,
        scale=d**-0.5,
        causal=causal,
    )


TREE_SHAPES = ("chain", "star", "deep", "bushy", "random")


def tree_parents(n: int, shape: str, seed: int = 0) -> list[int]:
    """Parents of an n-node tree in topological order (node 0 is the root, parent -1): a chain,
    a star (every node a child of the root), deep (each node's parent among the last two),
    bushy (each node's parent among the first few) or random."""
    rng = random.Random(seed)
    pick = {"chain": lambda i: i - 1, "star": lambda i: 0,
            "deep": lambda i: max(0, i - rng.randint(1, 2)),
            "bushy": lambda i: rng.randint(0, min(i - 1, 3)),
            "random": lambda i: rng.randint(0, i - 1)}[shape]
    return ([-1] + [pick(i) for i in range(1, n)])[:n]


def tree_mask(parents: list[list[int]], width: int | None = None) -> torch.Tensor:
    """The tree_mask of paged_attention (docs/design.md 3.2) for sequences whose new tokens form
    trees given by their parents (-1 for a root): each row sees itself and its ancestors."""
    longest = max((len(p) for p in parents), default=0)
    width = width or max(1, (longest + 7) // 8)
    rows = []
    for par in parents:
        for i in range(len(par)):
            bits = torch.zeros(8 * width, dtype=torch.bool)
            j = i
            while j >= 0:
                bits[j] = True
                j = par[j]
            rows.append(bits)
    if not rows:
        return torch.zeros(0, width, dtype=torch.uint8)
    bits = torch.stack(rows).view(-1, width, 8).int()
    return (bits << torch.arange(8)).sum(-1).to(torch.uint8)


def top_k_inputs(dtype=torch.float32, rows=6, v=1000, k=8, probs=True):
    """Rows of logits with what ranks them the hard way: a row of integers (many ties at the top),
    a NaN (ranked first; NaN probabilities), +inf, a row of -inf (NaN probabilities) and an
    increasing row (each entry beats the ones before)."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(rows, v, generator=g) * 4
    x[0] = x[0].round()
    x[1, v // 2], x[1, -1] = float("nan"), float("inf")
    x[2] = float("-inf")
    x[3] = torch.arange(v)
    return {"x": x.to(dtype), "k": k, "probs": probs}


def philox_bits_inputs(sequences=3, stream=1, rows=2, n=4099):
    """Keys and offsets at the words' extremes (0 and 2**32 - 1) and between; n not a multiple of
    4, so the last counter is cut."""
    g = torch.Generator().manual_seed(5)
    seeds = torch.randint(0, 2**32, (sequences, 2), generator=g)
    offsets = torch.randint(0, 2**32, (sequences,), generator=g)
    seeds[:1], offsets[:1] = 0, 0
    seeds[1:2], offsets[1:2] = 2**32 - 1, 2**32 - 1
    return {"seeds": seeds, "offsets": offsets, "stream": stream, "rows": rows, "n": n}


def rejection_sample_inputs(bs=4, k=3, v=11, dense=True, greedy_every=2, seed=0,
                            peaked=True, draft_noise=1.0) -> dict:
    """Target/draft distributions where drafts are often, but not always, accepted.

    draft_noise scales the draft's logit noise: 0 makes q equal p (nearly everything accepted).
    """
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(bs, k + 1, v, generator=g) * (3.0 if peaked else 1.0)
    target_probs = torch.softmax(logits, -1)
    draft_logits = logits[:, :k] + draft_noise * torch.randn(bs, k, v, generator=g)
    draft_probs = torch.softmax(draft_logits, -1)
    draft_token_ids = torch.multinomial(draft_probs.view(-1, v), 1, generator=g).view(bs, k)
    is_greedy = torch.zeros(bs, dtype=torch.bool)
    if greedy_every:
        is_greedy[::greedy_every] = True
    return dict(
        draft_token_ids=draft_token_ids,
        draft_probs=draft_probs if dense else None,
        target_probs=target_probs,
        is_greedy=is_greedy,
        uniform=torch.rand(bs, k, generator=g),
        exponential=torch.empty(bs, v).exponential_(generator=g),
    )


# ------------------------------------------------------------------ tiny random checkpoints

# Inputs of the decoder layer's small ops (small shapes; caches hold 12 slots).

def _randn(*shape, dtype=torch.float32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def rms_norm_inputs(dtype=torch.float32, shape=(5, 96)):
    return {"x": _randn(*shape, dtype=dtype, scale=3), "eps": 1e-6,
            "weight": (_randn(shape[-1], seed=1) * 0.5 + 1).to(dtype)}


def add_rms_norm_inputs(dtype=torch.float32, shape=(5, 96)):
    return {**rms_norm_inputs(dtype, shape), "residual": _randn(*shape, dtype=dtype, seed=2)}


def silu_and_mul_inputs(dtype=torch.float32, shape=(5, 2 * 80)):
    return {"x": _randn(*shape, dtype=dtype, scale=3)}


def _cos_sin(t, d, seed=3):
    angles = _randn(t, d // 2, seed=seed, scale=10)
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


def rope_inputs(dtype=torch.float32, shape=(5, 6, 32)):
    return {"x": _randn(*shape, dtype=dtype), "cos_sin": _cos_sin(shape[0], shape[2])}


def qkv_rope_cache_inputs(dtype=torch.float32, t=5, hq=4, hkv=2, d=32, norm=True):
    cache = (3, 4, hkv, d)   # 12 slots
    return {"qkv": _randn(t, (hq + 2 * hkv) * d, dtype=dtype),
            "q_norm_weight": _randn(d, seed=4).to(dtype) if norm else None,
            "k_norm_weight": _randn(d, seed=5).to(dtype) if norm else None,
            "cos_sin": _cos_sin(t, d), "key_cache": _randn(*cache, dtype=dtype, seed=6),
            "value_cache": _randn(*cache, dtype=dtype, seed=7),
            "slot_mapping": torch.tensor([5, -1, 11, 0, 6])[:t], "num_heads": hq, "eps": 1e-6}


def panel_linear_inputs(dtype=torch.float32, rows=5, n=48, k=37, bias=True, pairs=False):
    """Small integers over powers of two: every product and sum is exact in float32, so any
    summation order gives the same result. pairs: the weight in pair panels (bfloat16, k even)."""
    g = torch.Generator().manual_seed(8)
    weight = torch.randint(-8, 9, (n, k), generator=g) / 16
    layout = packing.to_pair_panels if pairs else packing.to_panels
    return {"x": torch.randint(-8, 9, (rows, k), generator=g).to(dtype),
            "weight_panels": layout(weight.to(dtype)),
            "bias": torch.randint(-8, 9, (n,), generator=g).to(dtype) / 4 if bias else None}


def quant_linear_inputs(dtype=torch.float32, rows=5, n=48, k=64, bias=True, bits=8):
    """Every value exact: each x group holds a +-127 multiple of a power of two (so it quantizes
    without rounding), the weight scales and 4-bit minimums are powers of two, so every product
    and sum is exact in float32 and any order of the float32 arithmetic gives the same result."""
    g = torch.Generator().manual_seed(9)
    x = torch.randint(-127, 128, (rows, k), generator=g)
    x[:, ::32] = 127   # each group's maximum: its scale is exactly 2^e
    scale = 2.0 ** torch.randint(-6, -2, (n, k // 32), generator=g)
    if bits == 8:
        q = torch.randint(-127, 128, (n, k), generator=g).to(torch.int8)
        (weight, scales), mins = packing.to_quad_panels(q, scale), None
    else:
        codes = torch.randint(0, 16, (n, k), generator=g).to(torch.uint8)
        low = -(2.0 ** torch.randint(-4, 0, (n, k // 32), generator=g))
        weight, scales, mins = packing.to_nibble_panels(codes, scale, low)
    return {"x": (x / 64).to(dtype), "weight": weight, "scales": scales, "mins": mins,
            "bias": torch.randint(-8, 9, (n,), generator=g).to(dtype) / 4 if bias else None}


LAYER_OP_INPUTS = {"rms_norm": rms_norm_inputs, "add_rms_norm": add_rms_norm_inputs,
                   "silu_and_mul": silu_and_mul_inputs, "rope": rope_inputs,
                   "qkv_rope_cache": qkv_rope_cache_inputs, "panel_linear": panel_linear_inputs,
                   "quant_linear": quant_linear_inputs}
