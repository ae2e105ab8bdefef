"""Micro-benchmark of the sampling noise (dflash/noise.py) against torch's own Exp(1) draws.

The Exp(1) noise of one exponential race per sequence, [batch, V] float32, every row with its
own seed: `noise.exponential` (Philox4x32-10 through `ops.philox_bits`, computed where the
probabilities live; on CPU its kernel), the same words from the op's reference (the tensor ops
other devices run), and `torch.empty(batch, V).exponential_()` (torch's CPU generator, what a
host-side draw costs before any copy to a device), at SmolLM2's and Qwen3's vocabularies, with
1 thread and with torch's default thread count; each figure is the fastest of several runs in the
same process.

    python bench/bench_noise.py [--threads N]   # from the repository root
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # this tree's dflash

import torch  # noqa: E402
from common import run_thread_cases  # noqa: E402

from dflash.engine.cost_model import fastest_seconds  # noqa: E402
from dflash.ops import reference  # noqa: E402
from dflash.sampling import noise  # noqa: E402

SHAPES = [(4, 49152), (16, 151936)]


def case(batch: int, v: int, threads: int) -> dict:
    torch.set_num_threads(threads)
    seeds, offsets = list(range(batch)), [1] * batch
    philox = fastest_seconds(
        lambda: noise.exponential(seeds, offsets, noise.TARGET_RACE, 1, v, "cpu"), 25)
    keys = torch.tensor([[s, 0] for s in seeds])
    counters = torch.tensor(offsets)
    ref = fastest_seconds(lambda: noise.exponential_of(
        reference.philox_bits(keys, counters, noise.TARGET_RACE, 1, v)), 25)
    torch_s = fastest_seconds(lambda: torch.empty(batch, v).exponential_(), 25)
    return {"shape": f"[{batch}, {v}]", "threads": threads, "noise.exponential ms": philox * 1e3,
            "reference ms": ref * 1e3, "exponential_ ms": torch_s * 1e3,
            "ratio": philox / torch_s}


def main() -> None:
    run_thread_cases("noise", __doc__.split("\n")[0], case, SHAPES)


if __name__ == "__main__":
    main()
