"""Sampled DFlash decoding on the bundled pair (temperature 0.7, fixed blocks): tok/s and tau at
concurrency 1 and 4, and the share of the decode time spent in rejection sampling, alone
(`dflash.ops.rejection_sample`) and with the noise it consumes (`dflash.sampling.rejection_sample`).

    python bench/bench_sampled.py [--num-prompts 8] [--max-tokens 128] [--dtype auto]

Prompts: the last questions of data/gsm8k/train.jsonl (held out from the bundled draft's
training). Writes bench/results/sampled.{md,json}; `--name` picks another file name.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # this tree's dflash

from common import write  # noqa: E402

from dflash import LLM, SamplingParams, assets, ops, sampling  # noqa: E402
from dflash.train.data import load_prompts  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


class Stopwatch:
    """Wraps `module.name` so that the seconds spent inside it add up in `seconds`."""

    def __init__(self, module, name: str):
        self.seconds, inner = 0.0, getattr(module, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
        setattr(module, name, timed)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--name", default="sampled")
    args = p.parse_args()

    llm = LLM(assets.smollm2_target(), assets.bundled_draft(), dtype=args.dtype,
              speculation="fixed")
    questions = load_prompts(ROOT / "data" / "gsm8k" / "train.jsonl")[-args.num_prompts:]
    prompts = [llm.chat_prompt(q) for q in questions]
    with_noise = Stopwatch(sampling, "rejection_sample")
    op = Stopwatch(ops, "rejection_sample")
    rows = []
    for concurrency in (1, 4):
        llm.engine.max_num_seqs = concurrency
        params = [SamplingParams(temperature=0.7, max_tokens=args.max_tokens, seed=i)
                  for i in range(len(prompts))]
        llm.generate(prompts[:2], SamplingParams(temperature=0.7, max_tokens=32))   # warm-up
        llm.reset_metrics()
        llm.worker.prefill_seconds = with_noise.seconds = op.seconds = 0.0
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
        decode = time.perf_counter() - start - llm.worker.prefill_seconds
        tokens = sum(len(o.token_ids) for o in outputs)
        rows.append({"concurrency": concurrency,
                     "dtype": str(llm.dtype).removeprefix("torch."), "tokens": tokens,
                     "tau": llm.metrics()["mean_acceptance_length"],
                     "decode_tok_s": tokens / decode,
                     "rejection_op_share": op.seconds / decode,
                     "rejection_with_noise_share": with_noise.seconds / decode})
    write(args.name, rows, ["concurrency", "dtype", "tokens", "tau", "decode_tok_s",
                            "rejection_op_share", "rejection_with_noise_share"])


if __name__ == "__main__":
    main()
