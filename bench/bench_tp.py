"""Tensor parallelism on CPU: decode throughput of TP=2 (two processes, gloo) against TP=1 on the
same cores, for a small random Qwen3 target (float32, greedy), target-only and with a DFlash draft.

On one CPU host TP buys no bandwidth (the ranks share memory and cores); the figure of interest is
the cost of the collectives per step, which is what TP on NPUs pays on top of the split GEMMs.

    python bench/bench_tp.py [--tokens 64]   # from the repository root
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # this tree's dflash
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))   # its tiny-model helpers

from common import write  # noqa: E402

from dflash import LLM, SamplingParams  # noqa: E402

from helpers import make_tiny_draft, make_tiny_target  # noqa: E402

SHAPE = dict(vocab_size=16000, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
             num_attention_heads=8, num_key_value_heads=4, head_dim=64)
PROMPTS = [[(7 * i + 3 * j) % 15000 + 1 for j in range(32)] for i in range(4)]


def run(target, draft, tp: int, threads: int, tokens: int) -> dict:
    torch.set_num_threads(threads)
    with LLM(target, draft, dtype="float32", max_num_seqs=len(PROMPTS), tp_size=tp) as llm:
        sp = SamplingParams(max_tokens=tokens, ignore_eos=True)
        llm.generate(PROMPTS, SamplingParams(max_tokens=4, ignore_eos=True))   # warm-up
        llm.reset_metrics()
        start = time.perf_counter()
        llm.generate(PROMPTS, sp)
        seconds = time.perf_counter() - start
        m = llm.metrics()
    # every request decodes in every step; the first token comes from the prefill
    steps = m["num_drafts"] / len(PROMPTS) if draft else tokens - 1
    return {"tp": tp, "threads per rank": max(1, threads // tp),
            "draft": "dflash" if draft else "none", "tok/s": m["generated_tokens"] / seconds,
            "ms/step": 1e3 * seconds / steps, "tau": m["mean_acceptance_length"]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    cores = torch.get_num_threads()
    with tempfile.TemporaryDirectory() as tmp:
        target, draft = Path(tmp) / "target", Path(tmp) / "draft"
        make_tiny_target(target, "qwen3", **SHAPE)
        make_tiny_draft(draft, target, block_size=8, mask_token_id=15999)
        rows = []
        for d in (None, draft):
            rows.append(run(target, d, 1, 1, args.tokens))
            rows.append(run(target, d, 1, cores, args.tokens))
            rows.append(run(target, d, 2, cores, args.tokens))
    write("tp", rows, ["draft", "tp", "threads per rank", "tok/s", "ms/step", "tau"])


if __name__ == "__main__":
    main()
