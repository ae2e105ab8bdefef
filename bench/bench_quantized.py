"""Decoding speed of the bundled target with 16-bit against 8- and 4-bit weights, target-only
and DFlash, in one run (engines alternate every round, so drift weighs on all alike).

    python bench/bench_quantized.py            # writes bench/results/quantized.json
    ATEN_CPU_CAPABILITY=avx2 python bench/bench_quantized.py   # the AVX2 kernels: quantized_avx2

Each engine decodes the held-out GSM8K questions one at a time (concurrency 1), greedy; the
texts of DFlash and target-only decoding of the same weights must be equal (checked). Prefill
is excluded from tok/s, as in `dflash bench`. How far a quantized target's text follows the
bf16 one: the mean length of their common prefix, and its top-1 agreement with the bf16 target
on the bf16 texts (teacher-forced: each position's argmax given the bf16 prefix). The bundled
target ships as GGUF Q4_1, so int4 holds exactly the file's weights.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.common import build_suffix, write  # noqa: E402
from dflash import LLM, SamplingParams, assets  # noqa: E402
from dflash.bench import load_dataset  # noqa: E402
from dflash.models.layers import prefill_metadata  # noqa: E402

FORMATS = {"bf16": None, "int8": "int8", "int4": "int4"}


def decode(llm: LLM, prompts: list[str], max_tokens: int) -> tuple[list, float, float]:
    """(token ids per prompt, decode seconds, tau: tokens committed per verification that
    carried drafts)."""
    llm.reset_metrics()
    prefill = llm.worker.prefill_seconds
    start = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens))
    seconds = time.perf_counter() - start - (llm.worker.prefill_seconds - prefill)
    drafts = sum(o.metrics.num_drafts for o in outs)
    tau = 1 + sum(o.metrics.num_accepted_tokens for o in outs) / drafts if drafts else 1.0
    return [o.token_ids for o in outs], seconds, tau


@torch.inference_mode()
def argmax_tokens(llm: LLM, sequences: list[list[int]]) -> list[torch.Tensor]:
    """The target's argmax after every prefix of each sequence (one prefill each)."""
    target = llm.target
    out = []
    for ids in sequences:
        meta = prefill_metadata([len(ids)], 16)
        cache = torch.zeros(target.kv_cache_shape(-(-len(ids) // 16), 16), dtype=llm.dtype)
        hidden, _ = target(torch.tensor(ids), meta, cache)
        out.append(target.logits(hidden).argmax(-1))
    return out


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dataset", default=str(ROOT / "runs" / "gsm8k-heldout.jsonl"))
    p.add_argument("--num-prompts", type=int, default=12)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--dtype", default="bfloat16")
    args = p.parse_args(argv)
    target, draft = assets.smollm2_target(), assets.bundled_draft()
    engines = {(fmt, spec): LLM(target, draft if spec else None, dtype=args.dtype,
                                max_num_seqs=1, quantization=q)
               for fmt, q in FORMATS.items() for spec in (False, True)}
    questions = load_dataset(args.dataset, args.num_prompts)
    totals = {key: [0, 0.0, 0.0] for key in engines}   # tokens, seconds, tau sum
    texts = {}
    order = list(engines)
    for r in range(args.rounds):
        for key in order if r % 2 == 0 else order[::-1]:
            llm = engines[key]
            prompts = [llm.chat_prompt(q) for q in questions]
            llm.generate(prompts[0], SamplingParams(max_tokens=8))   # warm-up
            ids, seconds, tau = decode(llm, prompts, args.max_tokens)
            texts.setdefault(key, ids)
            totals[key][0] += sum(len(t) for t in ids)
            totals[key][1] += seconds
            totals[key][2] += tau / args.rounds
    base = totals[("bf16", False)][0] / totals[("bf16", False)][1]
    rows = []
    for fmt in FORMATS:
        plain, spec = (totals[(fmt, s)] for s in (False, True))
        rate, spec_rate = plain[0] / plain[1], spec[0] / spec[1]
        rows.append({"weights": fmt, "target-only tok/s": rate, "DFlash tok/s": spec_rate,
                     "DFlash / target-only": spec_rate / rate, "tau": spec[2],
                     "target-only vs bf16": rate / base, "DFlash vs bf16 target-only":
                     spec_rate / base,
                     "texts equal target-only": texts[(fmt, True)] == texts[(fmt, False)]})
    base_llm = engines[("bf16", False)]
    reference = texts[("bf16", False)]
    prompts = [base_llm.encode(base_llm.chat_prompt(q)) for q in questions]
    sequences = [p + t for p, t in zip(prompts, reference)]
    base_argmax = argmax_tokens(base_llm, sequences)
    for fmt in FORMATS:
        if FORMATS[fmt] is None:
            continue
        quantized = texts[(fmt, False)]
        prefix = sum(map(common_prefix, quantized, reference)) / len(reference)
        agree = total = 0
        for seq, p, a, b in zip(sequences, prompts, base_argmax,
                                argmax_tokens(engines[(fmt, False)], sequences)):
            decoded = slice(len(p) - 1, len(seq) - 1)   # the positions that predicted the output
            agree += int((a[decoded] == b[decoded]).sum())
            total += decoded.stop - decoded.start
        rows.append({"weights": f"{fmt} against bf16: common prefix {prefix:.0f} tokens on "
                                f"average ({sum(a == b for a, b in zip(quantized, reference))} "
                                f"of {len(reference)} texts equal); teacher-forced top-1 "
                                f"agreement {agree / total:.1%} of {total} positions"})
    write("quantized" + build_suffix(), rows, list(rows[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
