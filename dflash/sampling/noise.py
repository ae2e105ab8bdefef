"""Counter-based sampling noise: Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy
as 1, 2, 3", SC 2011; `ops.philox_bits`), computed on the device that holds the probabilities, so
each value is a pure function of where it is used.

A value is keyed by the request's 64-bit seed (the Philox key) and counted by (element index,
offset, stream, row): `offset` is the position of the first token the call decides, so it grows
with every decoded token and a request's draws never repeat; `stream` separates the coins, the
target's race and the draft's race; `row` is the draft position within a block. Each counter
gives four 32-bit words (held in int64 tensors), used for four consecutive elements.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence

import torch

from .. import ops

COINS, TARGET_RACE, DRAFT_RACE, TREE_COINS = 0, 1, 2, 3   # the noise streams

_MASK32 = 0xFFFFFFFF


def fresh_seed() -> int:
    """A random 64-bit seed (for requests that set none)."""
    return secrets.randbits(64)


def bits(seeds: Sequence[int], offsets: Sequence[int], stream: int, rows: int, n: int,
         device) -> torch.Tensor:
    """Random 32-bit words [len(seeds), rows, n] (int64): element e of row j for request i is
    word e % 4 of the Philox output for counter (e // 4, offsets[i], stream, j) under key
    seeds[i] (`ops.philox_bits`)."""
    if len(seeds) != len(offsets):
        raise ValueError(f"expected one offset per seed, got {len(seeds)} seeds and "
                         f"{len(offsets)} offsets")
    bad = [s for s in seeds if not 0 <= s < 2**64] + [o for o in offsets if not 0 <= o < 2**32]
    if bad:
        raise ValueError(f"seeds must be in [0, 2**64) and offsets in [0, 2**32), got {bad[0]}")
    keys = torch.tensor([[s & _MASK32, s >> 32] for s in seeds], dtype=torch.int64,
                        device=device).view(-1, 2)
    offset = torch.tensor(offsets, dtype=torch.int64, device=device)
    return ops.philox_bits(keys, offset, stream, rows, n, check=False)   # checked above


def uniform(seeds: Sequence[int], offsets: Sequence[int], stream: int, rows: int, n: int,
            device) -> torch.Tensor:
    """float32 [len(seeds), rows, n] uniform on [0, 1) in steps of 2**-24 (exact in float32)."""
    return (bits(seeds, offsets, stream, rows, n, device) >> 8).float() * 2.0 ** -24


def exponential(seeds: Sequence[int], offsets: Sequence[int], stream: int, rows: int, n: int,
                device) -> torch.Tensor:
    """float32 [len(seeds), rows, n] Exp(1) noise of `bits`' words, never 0 (a 0 would win the
    race outright)."""
    return exponential_of(bits(seeds, offsets, stream, rows, n, device))


def exponential_of(words: torch.Tensor) -> torch.Tensor:
    """Exp(1) values of 32-bit words: E = -log(1 - w) with w = (words + 1/2) / 2**32. Small E,
    the values that decide the race, keep the resolution of 32 bits (the smallest is 2**-33 > 0);
    w is capped below 1 (float32 rounds the largest words up to 1, whose E would be infinite)."""
    w = words.to(torch.float32, copy=True).add_(0.5).mul_(2.0 ** -32).clamp_max_(1 - 2.0 ** -24)
    return w.neg_().log1p_().neg_()
