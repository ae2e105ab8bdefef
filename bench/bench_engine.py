"""Engine cost on the bundled SmolLM2 target, per dtype, all in one run:
- target-only decode tok/s vs Hugging Face `generate` (same prompt, batch 1, 64 tokens);
- one target forward of 16 vs 1 new tokens, lm_head included (what speculation can gain);
- the draft step (block forward + lm_head rows + argmax) vs the 16-token verify forward.

    python bench/bench_engine.py [--draft DIR]     # default: the bundled draft
"""

import argparse
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import timeit, write  # noqa: E402
from dflash import LLM, SamplingParams, assets  # noqa: E402
from dflash.engine.request import Request  # noqa: E402

QUESTION = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many "
            "clips in May. How many clips did Natalia sell altogether in April and May?")
CONTEXT = 100   # cached tokens before the timed forwards


def tokens_per_second(generate, n: int = 64) -> float:
    generate(4)   # warm-up
    start = time.perf_counter()
    generate(n)
    return n / (time.perf_counter() - start)


def step_costs(llm: LLM) -> dict:
    """Milliseconds of the worker stages for one sequence with CONTEXT cached tokens."""
    worker, b = llm.worker, llm.worker.block_size
    request = Request(0, list(range(1, CONTEXT + 1)), SamplingParams(), 0, frozenset())
    request.block_table = list(range(-(-(CONTEXT + b) // worker.kv_block_size)))
    request.num_cached, request.output_ids = CONTEXT, [1]
    drafts = torch.randint(0, 1000, (1, b - 1))
    costs = {"verify_ms": timeit(lambda: worker.verify([request], [b - 1], drafts,
                                                             None)) * 1e3}
    if worker.draft is not None:
        inputs = worker.block_inputs([request])
        costs["draft_ms"] = timeit(lambda: worker.draft_forward(inputs)) * 1e3
    return costs


def measure(path, draft, dtype: str) -> dict:
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                              dtype=getattr(torch, dtype))
    hf.generation_config.eos_token_id = None
    with LLM(path, dtype=dtype, max_num_seqs=1) as target_only:
        prompt = target_only.chat_prompt(QUESTION)
        ids = torch.tensor([target_only.tokenizer.encode(prompt, add_special_tokens=False)])
        with torch.no_grad():
            hf_tok_s = tokens_per_second(
                lambda n: hf.generate(ids, max_new_tokens=n, do_sample=False))
        ours = tokens_per_second(lambda n: target_only.generate(
            prompt, SamplingParams(max_tokens=n, ignore_eos=True)))
        one = step_costs(target_only)["verify_ms"]
    with LLM(path, draft, dtype=dtype, max_num_seqs=1, speculation="fixed") as dflash:
        block = step_costs(dflash)
    return {"dtype": dtype, "HF generate tok/s": hf_tok_s, "dflash target-only tok/s": ours,
            "ratio": ours / hf_tok_s, "t(1) ms": one, "t(16) ms": block["verify_ms"],
            "t(16)/t(1)": block["verify_ms"] / one, "draft step ms": block["draft_ms"],
            "draft / t(16)": block["draft_ms"] / block["verify_ms"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--draft", default=None, help="draft directory (default: bundled)")
    args = parser.parse_args()
    path = assets.smollm2_target()
    draft = args.draft or assets.bundled_draft()
    rows = [measure(path, draft, dtype) for dtype in ("float32", "bfloat16")]
    write("engine", rows, list(rows[0]))


if __name__ == "__main__":
    main()
