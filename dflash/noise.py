"""Counter-based sampling noise: Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy
as 1, 2, 3", SC 2011) in plain tensor ops, so the noise is computed on the device that holds the
probabilities and each value is a pure function of where it is used.

A value is keyed by the request's 64-bit seed (the Philox key) and counted by (element index,
offset, stream, row): `offset` is the position of the first token the call decides, so it grows
with every decoded token and a request's draws never repeat; `stream` separates the coins, the
target's race and the draft's race; `row` is the draft position within a block. Each counter
gives four 32-bit words, used for four consecutive elements.

The 32-bit words live in int64 tensors and every product is split so that no intermediate
exceeds 2**63: int64 overflow is not defined behaviour for every backend.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence

import torch

COINS, TARGET_RACE, DRAFT_RACE = 0, 1, 2   # the noise streams

_M0, _M1 = 0xD2511F53, 0xCD9E8D57          # Philox4x32 multipliers
_W0, _W1 = 0x9E3779B9, 0xBB67AE85          # Weyl key increments
_MASK32 = 0xFFFFFFFF
_ROUNDS = 10


def fresh_seed() -> int:
    """A random 64-bit seed (for requests that set none)."""
    return secrets.randbits(64)


def _mulhilo(a: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """High and low 32-bit words of a * m for 32-bit words a and m: a * m is summed from
    a * (16-bit halves of m), each below 2**48."""
    p1 = a * (m >> 16)
    t = (a * (m & 0xFFFF)).add_((p1 & 0xFFFF).bitwise_left_shift_(16))
    return (t >> 32).add_(p1.bitwise_right_shift_(16)), t.bitwise_and_(_MASK32)


def philox4x32(counter: Sequence[torch.Tensor | int], key: Sequence[torch.Tensor | int]
               ) -> tuple[torch.Tensor, ...]:
    """Philox4x32-10 of the 32-bit words counter (c0, c1, c2, c3) under key (k0, k1): four
    32-bit words (int64 tensors, broadcast over the inputs' shapes).

    The words are held as two stacks, (c0, c2) which are multiplied and (c1, c3) which are
    mixed in, so each round is one pass of tensor ops over both lanes (fewer, larger ops)."""
    c0, c1, c2, c3 = torch.broadcast_tensors(
        *(torch.as_tensor(c, dtype=torch.int64) for c in counter))
    multiplied, mixed = torch.stack([c0, c2]), torch.stack([c1, c3])
    key = torch.stack(torch.broadcast_tensors(*(torch.as_tensor(k, dtype=torch.int64)
                                                for k in key)))
    lanes = (2,) + (1,) * (multiplied.dim() - 1)          # the stack dim leads, then broadcast
    key = key.view((2,) + (1,) * (multiplied.dim() - key.dim()) + key.shape[1:])
    m = torch.tensor([_M0, _M1], device=multiplied.device).view(lanes)
    w = torch.tensor([_W0, _W1], device=multiplied.device).view(lanes)
    for _ in range(_ROUNDS):
        hi, lo = _mulhilo(multiplied, m)
        # c0' = hi(c2 * M1) ^ c1 ^ k0, c2' = hi(c0 * M0) ^ c3 ^ k1, c1' = lo(c2 * M1),
        # c3' = lo(c0 * M0)
        multiplied, mixed = hi.flip(0).bitwise_xor_(mixed).bitwise_xor_(key), lo.flip(0)
        key = (key + w) & _MASK32
    return multiplied[0], mixed[0], multiplied[1], mixed[1]


def bits(seeds: Sequence[int], offsets: Sequence[int], stream: int, rows: int, n: int,
         device) -> torch.Tensor:
    """Random 32-bit words [len(seeds), rows, n] (int64): element e of row j for request i is
    counted by (e // 4, offsets[i], stream, j) under key seeds[i]."""
    if len(seeds) != len(offsets):
        raise ValueError(f"expected one offset per seed, got {len(seeds)} seeds and "
                         f"{len(offsets)} offsets")
    bad = [s for s in seeds if not 0 <= s < 2**64] + [o for o in offsets if not 0 <= o < 2**32]
    if bad:
        raise ValueError(f"seeds must be in [0, 2**64) and offsets in [0, 2**32), got {bad[0]}")
    keys = torch.tensor([[s & _MASK32, s >> 32] for s in seeds], dtype=torch.int64,
                        device=device).view(-1, 2, 1, 1)
    offset = torch.tensor(offsets, dtype=torch.int64, device=device).view(-1, 1, 1)
    row = torch.arange(rows, device=device).view(1, -1, 1)
    element = torch.arange(-(-n // 4), device=device).view(1, 1, -1)
    words = philox4x32((element, offset, stream, row), (keys[:, 0], keys[:, 1]))
    words = torch.broadcast_tensors(*words)
    return torch.stack(words, -1).flatten(-2)[..., :n]


def uniform(seeds: Sequence[int], offsets: Sequence[int], stream: int, rows: int, n: int,
            device) -> torch.Tensor:
    """float32 [len(seeds), rows, n] uniform on [0, 1) in steps of 2**-24 (exact in float32)."""
    return (bits(seeds, offsets, stream, rows, n, device) >> 8).float() * 2.0 ** -24


def exponential(seeds: Sequence[int], offsets: Sequence[int], stream: int, rows: int, n: int,
                device) -> torch.Tensor:
    """float32 [len(seeds), rows, n] Exp(1) noise, never 0 (a 0 would win the race outright)."""
    return exponential_of(bits(seeds, offsets, stream, rows, n, device))


def exponential_of(words: torch.Tensor) -> torch.Tensor:
    """Exp(1) values of 32-bit words: E = -log(1 - w) with w = (words + 1/2) / 2**32. Small E,
    the values that decide the race, keep the resolution of 32 bits (the smallest is 2**-33 > 0);
    w is capped below 1 (float32 rounds the largest words up to 1, whose E would be infinite)."""
    w = (words.float() + 0.5) * 2.0 ** -32
    return -torch.log1p(-w.clamp_max_(1 - 2.0 ** -24))
