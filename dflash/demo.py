"""`dflash demo`: the bundled pair (SmolLM2-135M-Instruct + its trained DFlash draft) on a few
GSM8K-style questions written for the demo, with DFlash and with target-only decoding."""

from __future__ import annotations

import sys

from . import assets, host
from .engine import LLM
from .engine.detokenizer import decode
from .sampling import SamplingParams

QUESTIONS = [
    "A baker makes 24 muffins in the morning and 18 in the afternoon. She sells 30 of them. "
    "How many muffins are left?",
    "Tom reads 15 pages of a book every day. The book has 240 pages. How many days does he "
    "need to finish the book?",
    "A farmer has 7 rows of apple trees with 12 trees in each row. Each tree gives 20 apples. "
    "How many apples does the farmer get in total?",
    "Maria buys 3 notebooks for $4 each and a pen for $2. She pays with a $20 bill. How much "
    "change does she get?",
    "A train travels 60 miles per hour for 3 hours and then 40 miles per hour for 2 hours. "
    "How far does it travel in total?",
]


def run(dtype: str = "auto", max_tokens: int = 256, speculation: str = "adaptive",
        recalibrate: bool = False, quantization: str | None = None, out=sys.stdout) -> dict:
    """Both engines with the same settings; with dtype "auto" each takes the dtype that decodes
    fastest for it on this host (target-only decoding is compared at its best)."""
    target = assets.smollm2_target()
    draft = assets.bundled_draft()
    sp = SamplingParams(max_tokens=max_tokens)
    spec = LLM(target, draft, dtype=dtype, max_num_seqs=1, speculation=speculation,
               recalibrate=recalibrate, quantization=quantization)
    base = LLM(target, dtype=dtype, max_num_seqs=1, recalibrate=recalibrate,
               quantization=quantization)
    prompts = [spec.chat_prompt(q) for q in QUESTIONS]
    for llm in (spec, base):   # warm-up (first-call allocations, thread pools)
        llm.generate(prompts[0], SamplingParams(max_tokens=8))
        llm.reset_metrics()
    matches = 0
    for question, prompt in zip(QUESTIONS, prompts):
        print(f"\nQ: {question}\nA: ", end="", file=out, flush=True)
        printed = [0]
        tokens: list[int] = []

        def stream(_, new, tokens=tokens, printed=printed):
            tokens.extend(new)
            text = decode(spec.tokenizer, tokens)
            out.write(text[printed[0]:])
            out.flush()
            printed[0] = len(text)

        fast = spec.generate(prompt, sp, on_tokens=stream)[0]
        slow = base.generate(prompt, sp)[0]
        matches += fast.token_ids == slow.token_ids
        m = fast.metrics
        print(f"\n  [tau {m.mean_acceptance_length:.2f}, {m.generated_tokens} tokens]", file=out)
    s, b = spec.metrics(), base.metrics()
    dtypes = [str(llm.dtype).removeprefix("torch.") for llm in (spec, base)]
    summary = {
        "dtype": dtypes[0], "target_only_dtype": dtypes[1], "speculation": speculation,
        "quantization": quantization,
        "prompts": len(QUESTIONS), "identical_outputs": matches,
        "tau": s["mean_acceptance_length"], "draft_acceptance_rate": s["draft_acceptance_rate"],
        "dflash_tok_s": s["throughput_tok_s"], "target_only_tok_s": b["throughput_tok_s"],
        "speedup": s["throughput_tok_s"] / b["throughput_tok_s"],
    }
    print(f"\nDFlash: tau {summary['tau']:.2f}, draft accept rate "
          f"{summary['draft_acceptance_rate']:.1%}, {summary['dflash_tok_s']:.1f} tok/s | "
          f"target only: {summary['target_only_tok_s']:.1f} tok/s | speedup "
          f"{summary['speedup']:.2f}x | identical outputs: {matches}/{len(QUESTIONS)} "
          f"(DFlash {dtypes[0]}, {speculation}; target only {dtypes[1]}; target weights "
          f"{quantization or dtypes[0]}"
          f"{'; bf16 rounding can flip near-ties' if _row_dependent(dtypes) else ''})",
          file=out)
    return summary


def _row_dependent(dtypes: list[str]) -> bool:
    """Whether a dtype's GEMMs may round a row differently by the rows beside it: oneDNN's bf16
    (on CPUs with AMX; elsewhere bf16 goes through panel_linear) and float16."""
    return any(d == "float16" or (d == "bfloat16" and host.bf16_gemm() == "onednn")
               for d in dtypes)
