"""Views of a framework's paged KV cache in the layout `context_kv` takes.

`context_kv` writes token `t`'s head `h` at `cache[slot // block_size, slot % block_size, h, :]` of
4-D caches [num_blocks, block_size, Hkv, D] with any strides. A framework's cache is usually one
tensor per layer holding K and V of every block, in a layout its attention kernel reads (vLLM's CPU
backend: [num_blocks, Hkv, block_size, 2 * D] with K transposed inside each block). Rather than
hard-coding such layouts, `probe` asks the framework's own cache-write function where it puts
each element of a labelled K/V on a two-block scratch cache, and returns the strides when every
element lands at an affine offset; `views` then applies those strides to the real cache, so the
op writes where the framework would, without copying the cache.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

# labels are small integers: exact in bfloat16 up to 256
MAX_LABEL = 256


@dataclass(frozen=True)
class Layout:
    """Element offsets of K and V in a block-major cache tensor (dim 0 = blocks)."""

    key_offset: int
    value_offset: int
    key_strides: tuple[int, int, int, int]     # block, slot in block, kv head, dim
    value_strides: tuple[int, int, int, int]


def probe(write: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None],
          block_shape: tuple[int, ...], block_size: int, num_kv_heads: int, head_dim: int,
          dtype: torch.dtype) -> Layout | None:
    """The layout `write(key, value, cache, slot_mapping)` uses on caches [num_blocks,
    *block_shape], or None when some element does not land at an affine offset.

    key, value: [T, num_kv_heads, head_dim]; slot = block * block_size + offset."""
    if max(block_size, num_kv_heads, head_dim) >= MAX_LABEL:
        return None
    cache = torch.zeros((2, *block_shape), dtype=dtype)
    n = 2 * block_size
    labels = [torch.arange(n)[:, None, None] // block_size,
              torch.arange(n)[:, None, None] % block_size,
              torch.arange(num_kv_heads)[None, :, None], torch.arange(head_dim)[None, None, :]]
    shape = (n, num_kv_heads, head_dim)
    seen = []
    for label in labels:   # one write per coordinate: K holds label + 1, V holds -(label + 1)
        cache.zero_()
        value = (label.expand(shape) + 1).to(dtype)
        write(value, -value, cache, torch.arange(n))
        seen.append(cache.flatten().float().clone())   # float() of float32 is no copy
    found = []
    for sign in (1, -1):
        where = (seen[0] * sign > 0).nonzero()[:, 0]
        if len(where) != n * num_kv_heads * head_dim:
            return None
        coords = torch.stack([(s[where] * sign).round().long() - 1 for s in seen], 1)
        first = where[(coords == 0).all(1)]
        if len(first) != 1:
            return None
        strides = []
        for axis in range(4):
            hit = where[(coords == torch.eye(4, dtype=torch.long)[axis]).all(1)]
            strides.append(int(hit[0] - first[0]) if len(hit) else 0)
        if not torch.equal(where, int(first[0]) + coords @ torch.tensor(strides)):
            return None   # not affine: a tiled or packed layout
        found.append((int(first[0]), tuple(strides)))
    (k_off, k_str), (v_off, v_str) = found
    return Layout(k_off, v_off, k_str, v_str)


def views(cache: torch.Tensor, layout: Layout, block_size: int, num_kv_heads: int,
          head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of a contiguous block-major `cache` as views [num_blocks, block_size, Hkv, D]."""
    if not cache.is_contiguous():
        raise ValueError(f"the KV cache has strides {cache.stride()}; a contiguous, block-major "
                         "cache is needed to view it in place")
    per_block = cache[0].numel()
    if layout.key_strides[0] != per_block or layout.value_strides[0] != per_block:
        raise ValueError("the probed layout's block stride does not match the KV cache's")
    size = (cache.shape[0], block_size, num_kv_heads, head_dim)
    offset = cache.storage_offset()
    return (cache.as_strided(size, layout.key_strides, offset + layout.key_offset),
            cache.as_strided(size, layout.value_strides, offset + layout.value_offset))
