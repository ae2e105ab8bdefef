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

COINS, TARGET_RACE, DRAFT_RACE, TREE_COINS = 0, 1, 2, 3   # the noise streams

_M0, _M1 = 0xD2511F53, 0xCD9E8D57          # Philox4x32 multipliers
_W0, _W1 = 0x9E3779B9, 0xBB67AE85          # Weyl key increments
_MASK32 = 0xFFFFFFFF
_ROUNDS = 10


def fresh_seed() -> int:
    """A random 64-bit seed (for requests that set none)."""
    return secrets.randbits(64)


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


def _lanes(seeds: Sequence[int], offsets: Sequence[int], stream: int, rows: int, n: int,
           device) -> tuple[torch.Tensor, ...]:
    """The four Philox words [len(seeds), rows, ceil(n / 4)] of `bits`, not yet interleaved."""
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
    return philox4x32((element, offset, stream, row), (keys[:, 0], keys[:, 1]))


def _interleave(lanes: Sequence[torch.Tensor], n: int) -> torch.Tensor:
    """Element e of the result is element e // 4 of lane e % 4 (the first n elements)."""
    return torch.stack(lanes, -1).flatten(-2)[..., :n]


def bits(seeds: Sequence[int], offsets: Sequence[int], stream: int, rows: int, n: int,
         device) -> torch.Tensor:
    """Random 32-bit words [len(seeds), rows, n] (int64): element e of row j for request i is
    word e % 4 of the Philox output for counter (e // 4, offsets[i], stream, j) under key
    seeds[i]."""
    return _interleave(_lanes(seeds, offsets, stream, rows, n, device), n)


def uniform(seeds: Sequence[int], offsets: Sequence[int], stream: int, rows: int, n: int,
            device) -> torch.Tensor:
    """float32 [len(seeds), rows, n] uniform on [0, 1) in steps of 2**-24 (exact in float32)."""
    return (bits(seeds, offsets, stream, rows, n, device) >> 8).float() * 2.0 ** -24


def exponential(seeds: Sequence[int], offsets: Sequence[int], stream: int, rows: int, n: int,
                device) -> torch.Tensor:
    """float32 [len(seeds), rows, n] Exp(1) noise of `bits`' words, never 0 (a 0 would win the
    race outright). Converted lane by lane, so the interleaving moves float32, not int64."""
    lanes = _lanes(seeds, offsets, stream, rows, n, device)
    return _interleave([exponential_of(w) for w in lanes], n)


def exponential_of(words: torch.Tensor) -> torch.Tensor:
    """Exp(1) values of 32-bit words: E = -log(1 - w) with w = (words + 1/2) / 2**32. Small E,
    the values that decide the race, keep the resolution of 32 bits (the smallest is 2**-33 > 0);
    w is capped below 1 (float32 rounds the largest words up to 1, whose E would be infinite)."""
    w = words.to(torch.float32, copy=True).add_(0.5).mul_(2.0 ** -32).clamp_max_(1 - 2.0 ** -24)
    return w.neg_().log1p_().neg_()
