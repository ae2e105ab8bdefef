"""`dflash demo`: the bundled pair (SmolLM2-135M-Instruct + its trained DFlash draft) on a few
GSM8K-style questions written for the demo, with DFlash and with target-only decoding."""

from __future__ import annotations

import sys

from . import assets, host
from .engine import LLM
from .engine.detokenizer import decode
from .engine.speculation import expected_rate
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
        recalibrate: bool = False, quantization: str | None = "auto",
        draft_quantization: str | None = None, out=sys.stdout) -> dict:
    """Both engines with the same settings; with dtype "auto" each takes the dtype that decodes
    fastest for it on this host (target-only decoding is compared at its best), and DFlash's
    texts are compared with target-only decoding in DFlash's own dtype. quantization "auto":
    `choose_weights`; draft_quantization: the DFlash engine's draft weights."""
    target = assets.smollm2_target()
    draft = assets.bundled_draft()
    sp = SamplingParams(max_tokens=max_tokens)

    def engine(q):
        return LLM(target, draft, dtype=dtype, max_num_seqs=1, speculation=speculation,
                   recalibrate=recalibrate, quantization=q,
                   draft_quantization=draft_quantization)

    if quantization == "auto":
        quantization, spec, rates = choose_weights(engine)
    else:
        spec, rates = engine(quantization), {}
    base = LLM(target, dtype=dtype, max_num_seqs=1, recalibrate=recalibrate,
               quantization=quantization)
    # the speed is compared with target-only decoding at its best dtype, the texts with
    # target-only decoding in DFlash's (another dtype rounds differently: its texts may differ)
    same = base if base.dtype == spec.dtype else \
        LLM(target, dtype=spec.dtype, max_num_seqs=1, quantization=quantization)
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
        exact = slow if same is base else same.generate(prompt, sp)[0]
        matches += fast.token_ids == exact.token_ids
        m = fast.metrics
        print(f"\n  [tau {m.mean_acceptance_length:.2f}, {m.generated_tokens} tokens]", file=out)
    s, b = spec.metrics(), base.metrics()
    if same is not base:
        same.close()
    dtypes = [str(llm.dtype).removeprefix("torch.") for llm in (spec, base)]
    summary = {
        "dtype": dtypes[0], "target_only_dtype": dtypes[1], "speculation": speculation,
        "quantization": quantization, "expected_tok_s_by_weights": rates,
        "prompts": len(QUESTIONS), "identical_outputs": matches,
        "tau": s["mean_acceptance_length"], "draft_acceptance_rate": s["draft_acceptance_rate"],
        "dflash_tok_s": s["throughput_tok_s"], "target_only_tok_s": b["throughput_tok_s"],
        "speedup": s["throughput_tok_s"] / b["throughput_tok_s"],
    }
    print(f"\nDFlash: tau {summary['tau']:.2f}, draft accept rate "
          f"{summary['draft_acceptance_rate']:.1%}, {summary['dflash_tok_s']:.1f} tok/s | "
          f"target only: {summary['target_only_tok_s']:.1f} tok/s | speedup "
          f"{summary['speedup']:.2f}x | outputs identical to target-only {dtypes[0]}: "
          f"{matches}/{len(QUESTIONS)} (DFlash {dtypes[0]}, {speculation}; target only "
          f"{dtypes[1]}; target weights: "
          f"{_weights(quantization, dtypes[0], rates)}"
          f"{'; bf16 rounding can flip near-ties' if _row_dependent(dtypes[0]) else ''})",
          file=out)
    return summary


# the bundled target's file holds its layers in Q4_1 and its embedding in Q8_0: "int4" serves
# exactly those weights (docs/design.md 4.7); None their rounding to the engine's dtype
SHIPPED = "int4"


def choose_weights(engine) -> tuple[str | None, LLM, dict]:
    """(quantization, DFlash engine, expected tok/s by weights): the bundled target's shipped
    4-bit weights or their rounding to the dtype, whichever the engines' measured cost models
    expect to decode faster with DFlash at concurrency 1 (the shipped ones when no cost model
    decides: fixed speculation). `engine(quantization)` builds a DFlash engine."""
    shipped = engine(SHIPPED)
    if shipped.cost_model is None:
        return SHIPPED, shipped, {}
    unquantized = engine(None)
    engines = {SHIPPED: shipped, "none": unquantized}
    rates = {name: expected_rate(e.cost_model, e.block_size, 1)[0] for name, e in engines.items()}
    best = max(rates, key=rates.get)
    engines["none" if best == SHIPPED else SHIPPED].close()
    return (None if best == "none" else SHIPPED), engines[best], rates


def _weights(quantization: str | None, dtype: str, rates: dict) -> str:
    """How the output line names the target's weights."""
    name = "the shipped Q4_1 (int4)" if quantization == SHIPPED else \
        quantization or f"rounded to {dtype}"
    if rates:
        name += ", chosen by expected DFlash tok/s: " + ", ".join(
            f"{w} {r:.1f}" for w, r in rates.items())
    return name


def _row_dependent(dtype: str) -> bool:
    """Whether the dtype's GEMMs may round a row differently by the rows beside it, so that
    DFlash's texts and target-only decoding's in that dtype may differ: oneDNN's bf16 (on CPUs
    with AMX; elsewhere bf16 goes through panel_linear) and float16."""
    return dtype == "float16" or (dtype == "bfloat16" and host.bf16_gemm() == "onednn")
