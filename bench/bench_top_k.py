"""Micro-benchmark of `ops.top_k` against the torch calls it replaces in the engine.

The engine takes every verified row's greedy token (first argmax; torch: `x.max(-1).indices`)
and the draft tree's candidates (the top 8 tokens of each block position with their softmax
probabilities; torch: `torch.softmax(x.float(), -1).topk(8)`) from bfloat16 logits as wide as the
vocabulary. Rows: one decode step, a 16-row verification and 64 rows (concurrency 16), at
SmolLM2's and Qwen3's vocabularies; 1 thread and torch's default thread count, each figure the
fastest of several runs timed in turn.

    python bench/bench_top_k.py [--threads N]   # from the repository root
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # this tree's dflash

import torch  # noqa: E402
from common import run_thread_cases  # noqa: E402

from dflash import ops  # noqa: E402
from dflash.engine.cost_model import fastest_each  # noqa: E402

SHAPES = [(1, 49152), (16, 49152), (64, 49152), (16, 151936)]
CANDIDATES = 8


def case(rows: int, v: int, threads: int) -> dict:
    torch.set_num_threads(threads)
    x = torch.randn(rows, v, generator=torch.Generator().manual_seed(0)).bfloat16()
    s = fastest_each({
        "argmax": lambda: ops.top_k(x, 1),
        "torch argmax": lambda: x.max(-1).indices,
        "candidates": lambda: ops.top_k(x, CANDIDATES, probs=True),
        "torch candidates": lambda: torch.softmax(x.float(), -1).topk(CANDIDATES, dim=-1),
    }, 25)
    return {"shape": f"[{rows}, {v}]", "threads": threads,
            "top_k(1) us": s["argmax"] * 1e6, "max(-1) us": s["torch argmax"] * 1e6,
            "argmax speedup": s["torch argmax"] / s["argmax"],
            f"top_k({CANDIDATES}, probs) us": s["candidates"] * 1e6,
            f"softmax.topk({CANDIDATES}) us": s["torch candidates"] * 1e6,
            "candidates speedup": s["torch candidates"] / s["candidates"]}


def main() -> None:
    run_thread_cases("top_k", __doc__.split("\n")[0], case, SHAPES)


if __name__ == "__main__":
    main()
