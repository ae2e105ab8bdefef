"""Render docs/performance.md from the benchmark results in bench/results/*.json.

Every figure of the documentation lives in those JSON files, written by the benchmarks
(`dflash bench`, bench/bench_*.py); this script turns them into tables, each with the host line
the JSON records (`dflash.host.summary`) and the command that produced it, and renders the
README's one results table between its two marker lines. Prose elsewhere links to
docs/performance.md instead of copying numbers; tests/test_performance_doc.py fails when a
committed file differs from what this script renders.

    python bench/render.py            # rewrites docs/performance.md and the README's results table
    python bench/render.py --check    # exit status 1 if either is out of date
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))   # this checkout's dflash and bench

from bench.bench_serve import markdown as serve_table  # noqa: E402
from bench.common import RESULTS, _fmt  # noqa: E402
from dflash import host  # noqa: E402

OUT = ROOT / "docs" / "performance.md"
README = ROOT / "README.md"
# the README's results tables sit between these lines, rendered by readme_table() and
# tree_sizes_table()
BEGIN = "<!-- results table: rendered by python bench/render.py from bench/results -->"
END = "<!-- end of results table -->"
TREES_BEGIN = "<!-- tree sizes table: rendered by python bench/render.py from bench/results -->"
TREES_END = "<!-- end of tree sizes table -->"
TREE_SIZES = "tree_sizes"
HELD_OUT = "mkdir -p runs && tail -n 20 data/gsm8k/train.jsonl > runs/gsm8k-heldout.jsonl"

# `dflash bench` runs: (JSON stem, title, flags the JSON does not record, note)
END_TO_END = [
    ("bench_gsm8k-heldout", "GSM8K held-out, the host's own ISA", "--recalibrate",
     "The 20 questions are the last 20 of `data/gsm8k/train.jsonl`, which the bundled draft never "
     "trained on."),
    ("bench_gsm8k-heldout-avx512_core", "GSM8K held-out, bf16 units hidden", "--recalibrate",
     "The same questions with oneDNN limited to AVX512_CORE: a CPU without bf16 dot-product or "
     "matrix units, seen on the same host (`host.bf16_gemm` then takes column panels)."),
    ("bench_gsm8k-heldout-avx2", "GSM8K held-out, AVX2 host", "--recalibrate",
     "The same questions on a CPU with AVX2 and no AVX-512, so the kernels' AVX2 build: bf16 "
     "weights in column panels, widened to float32 as they load, and every product a float32 "
     "FMA. A verify row costs a larger share of a decode step than with bf16 units."),
    ("bench_gsm8k-heldout-int4", "GSM8K held-out, 4-bit target", "",
     "The same questions with the target in its shipped GGUF Q4_1 weights (`--quantization "
     "int4`, `quant_linear`); DFlash against target-only decoding of the same weights."),
    ("bench_gsm8k-heldout-t0.7", "GSM8K held-out, sampled", "",
     "The same questions sampled at temperature 0.7, request j with seed j: DFlash keeps the "
     "target's distribution (the chi-square tests of `tests/test_sampling.py` and "
     "`tests/test_tree_engine.py`), not its texts; sampled requests verify trees with one-hot "
     "proposals (design.md 4.6)."),
    ("bench_humaneval", "HumanEval", "--recalibrate",
     "Code, which the GSM8K-trained draft predicts poorly (chains accept about 1 draft a step), "
     "but which repeats its own identifiers: adaptive trees verify the prompt lookup's branches "
     "(design.md 4.6). At concurrency 32 the engine skips most draft passes."),
]

# micro-benchmarks written by bench/common.write: (JSON stem, title, command, note)
TABLES = [
    ("engine", "Engine cost", "python bench/bench_engine.py",
     "SmolLM2-135M, batch 1, 100 cached tokens, the bundled draft, each dtype forced. t(k): one "
     "target step over k new tokens; draft step: one draft pass over a 16-token block. The bf16 "
     "row went through oneDNN's bf16 GEMMs, not the pair panels the engine uses on this kind of "
     "host; the cost models above are the current engine's."),
    ("sampled", "Sampled decoding", "python bench/bench_sampled.py --dtype bfloat16 "
     "--num-prompts 16",
     "Temperature 0.7, fixed blocks, 128 tokens, seeds 0..15; the shares are of the decode time."),
    ("tp", "Tensor parallelism", "python bench/bench_tp.py",
     "A small random Qwen3 target (float32, greedy), TP=2 over gloo against TP=1 on the same "
     "cores; the draft is random too, so none of its drafts is accepted. On one CPU host TP buys "
     "no bandwidth: what the table shows is the cost of the collectives per step."),
    ("context_kv", "`context_kv`", "python bench/bench_context_kv.py",
     "The Qwen3-8B draft's shape (H 4096, D_in 20480, 5 layers, 8 KV heads, head dim 128). floor: "
     "the bare two GEMMs; eager: the unfused PyTorch composition; compile: `torch.compile` of it."),
    ("paged_attention", "`paged_attention`, draft shape", "python bench/bench_paged_attention.py",
     "Hq 32, Hkv 8, D 128, 16 non-causal queries per sequence; composition: gather + SDPA."),
    ("paged_attention_1thread", "`paged_attention`, draft shape, 1 thread",
     "python bench/bench_paged_attention.py --threads 1", ""),
    ("paged_attention_target", "`paged_attention`, target uses",
     "python bench/bench_paged_attention.py",
     "Model (query heads / KV heads / head dim); prefill and draft blocks use the matrix engine "
     "where the CPU has AMX, decode and verify the vector path."),
    ("paged_attention_target_1thread", "`paged_attention`, target uses, 1 thread",
     "python bench/bench_paged_attention.py --threads 1", ""),
    ("rejection_sample", "`rejection_sample`", "python bench/bench_rejection_sample.py",
     "V 151936, K 15; reference: the PyTorch specification; composition: a batched PyTorch "
     "composition; compile: `torch.compile` of it; of copy: against a plain copy of the bytes "
     "read."),
    ("rejection_sample_1thread", "`rejection_sample`, 1 thread",
     "python bench/bench_rejection_sample.py --threads 1", ""),
    ("rejection_sample_reads", "`rejection_sample` without input checks",
     "python bench/bench_rejection_sample.py --reads-only",
     "The engine's call (`check=False`) against reading three vocabulary rows per sequence."),
    ("panel_linear", "`panel_linear`", "python bench/bench_panel_linear.py",
     "All of SmolLM2-135M's weights per pass (538 MB in float32) for 1-128 rows: float32 column "
     "panels against `F.linear` (MKL), bf16 column panels against float32 panels, bf16 pair "
     "panels against oneDNN's bf16 GEMM."),
    ("quant_linear", "`quant_linear`", "python bench/bench_quant_linear.py",
     "All of SmolLM2-135M's weights per pass (random values) for 1-64 rows of bf16 activations: "
     "bf16 weights as the engine multiplies them on this host against int8 and int4 "
     "`quant_linear`; t(m)/t(1): a verify pass of m rows against a one-token decode."),
    ("quant_linear_avx2", "`quant_linear`, AVX2 kernels",
     "ATEN_CPU_CAPABILITY=avx2 python bench/bench_quant_linear.py",
     "The same with the kernels of the AVX2 build, as on a CPU without AVX-512: int8 and int4 "
     "through VPMADDUBSW / VPMADDWD."),
    ("quant_linear_avx512_core", "`quant_linear`, AVX-512 without VNNI or bf16",
     "ONEDNN_MAX_CPU_ISA=AVX512_CORE python bench/bench_quant_linear.py",
     "The same with the ISA limit of an AVX-512 CPU without VNNI or bf16 units (Skylake-SP): "
     "int8 and int4 through VPMADDUBSW / VPMADDWD on 64-byte vectors, bf16 weights through "
     "float32 products."),
    ("decoder_layer", "One call per decoder layer", "python bench/bench_decoder_layer.py",
     "The bundled target's forward (no lm_head) over 1, 4 and 16 new tokens after 200 cached "
     "ones, each layer as one `decoder_layer` call against its nine ops called one by one from "
     "Python, alternating in 9 rounds (medians); bf16 weights in the host's packed layout, int8 "
     "and int4 `quant_linear`."),
    ("quantized", "Quantized weights", "python bench/bench_quantized.py",
     "The bundled pair, concurrency 1, greedy, the first 12 held-out questions, 256 tokens, "
     "activations in bf16; bf16 weights (pair panels) against `quantization=\"int8\"` and "
     "`\"int4\"` (`quant_linear`; int4 holds the shipped Q4_1 weights exactly), target-only and "
     "DFlash (adaptive), the six engines alternating over 2 rounds. tok/s excludes prefill. "
     "'vs bf16': against the bf16 target-only rate."),
    ("quantized_avx2", "Quantized weights, AVX2 kernels",
     "ATEN_CPU_CAPABILITY=avx2 python bench/bench_quantized.py",
     "The same with every kernel of the AVX2 build, as on a CPU without AVX-512."),
    ("quantized_avx512_core", "Quantized weights, AVX-512 without VNNI or bf16",
     "ONEDNN_MAX_CPU_ISA=AVX512_CORE python bench/bench_quantized.py",
     "The same with the ISA limit of an AVX-512 CPU without VNNI or bf16 units (Skylake-SP): "
     "bf16 weights through float32 products, int8 and int4 through VPMADDUBSW pairs."),
    ("llamacpp", "Against llama.cpp", "python bench/bench_llamacpp.py",
     "The bundled pair at each weight format (the target converted from its shipped Q4_1 weights "
     "by `llama-quantize`, the token embedding Q8_0 in the 8- and 4-bit files; the draft by "
     "`dflash export-gguf`), the first 12 held-out questions, greedy, 256 tokens, one at a time, "
     "the same threads. llama.cpp (built from its sdist with GGML_NATIVE): target-only is "
     "`llama-bench` tg128, and tg128 after as many tokens of context as make its mean context "
     "dflash's ('mean context': the prompt and half the generated tokens, averaged over the "
     "questions; attention grows with it), DFlash `llama-speculative-simple --spec-type "
     "draft-dflash`, tau its "
     "tokens per target pass. dflash loads the same files (F32 / BF16 at that dtype, Q8_0 as "
     "int8, Q4_0 as int4); tok/s excludes prefill. Texts agree when equal up to the shorter; the "
     "last two columns compare dflash with float32 activations against llama.cpp's greedy texts "
     "(`llama-completion`): whole texts, and its argmax teacher-forced on llama.cpp's tokens."),
    (TREE_SIZES, "Acceptance by verify size", "python bench/bench_tree_sizes.py",
     "The bundled pair in float32, greedy, the 20 held-out questions, 256 tokens; each size fixed "
     "for a whole run: a chain of k argmax drafts against a best-first tree of N draft nodes. "
     "'texts equal' counts prompts whose tokens equal the first run's."),
    ("noise", "Sampling noise", "python bench/bench_noise.py",
     "`dflash.sampling.noise.exponential` (counter-based Philox through `ops.philox_bits`, one "
     "exponential race per row), the same from the op's tensor-op reference (what other devices "
     "run), and torch's `exponential_` for the same shape; ratio: the first's time over the "
     "last's."),
    ("top_k", "Greedy tokens and tree candidates", "python bench/bench_top_k.py",
     "`ops.top_k` on bfloat16 logits against the torch calls it replaces in the engine: the "
     "first argmax (`x.max(-1).indices`) and the draft tree's 8 candidates per position with "
     "their softmax probabilities (`torch.softmax(x.float(), -1).topk(8)`); speedup: torch's "
     "time over top_k's."),
]
SERVE, VLLM = "bench_serve_gsm8k-heldout", "bench_vllm"
NOT_RENDERED = {"bench_vllm_runs"}   # every run's counters behind bench_vllm.json's table


def rendered() -> list[str]:
    """The stems of bench/results/*.json that docs/performance.md shows."""
    return [s for s, *_ in END_TO_END] + [SERVE, VLLM] + [s for s, *_ in TABLES]


def host_line(info: dict) -> str:
    """The host as the JSON records it: `host.summary` where the flags were recorded."""
    extra = ", ".join(filter(None, (f"torch {info['torch']}" if "torch" in info else "",
                                    f"{info['capability']} kernels" if "capability" in info
                                    else "")))
    if all(flag in info for flag in host.FLAGS):
        line = host.summary({"cpu_family": "", "onednn_max_cpu_isa": "", **info})
    else:
        threads = info.get("threads", "?")
        line = f"{info.get('cpu', 'unknown CPU')} (model name and flags not recorded), " \
               f"{threads} thread{'' if threads == 1 else 's'}"
    return line + (f"; {extra}" if extra else "")


def table(columns: list[str], rows: list[list]) -> str:
    """A markdown table; floats as bench/common.write prints them."""
    lines = ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    lines += ["| " + " | ".join("" if v is None else _fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def _x(value: float) -> str:
    return f"{value:.2f}x"


def bench_command(data: dict, extra: str) -> str:
    """The `dflash bench` command line of a JSON, from what it records."""
    rows = data["rows"]
    first = rows[0]
    parts = []
    isa = data["host"].get("onednn_max_cpu_isa")
    if isa:
        parts.append(f"ONEDNN_MAX_CPU_ISA={isa}")
    kernels = data["host"].get("capability")
    if kernels and data["host"].get("avx512f") and not kernels.startswith("AVX512"):
        parts.append(f"ATEN_CPU_CAPABILITY={kernels.lower()}")   # a lesser build on purpose
    parts += ["dflash bench", f"--dataset {first['dataset']}", f"--num-prompts {first['prompts']}",
              "--concurrency " + ",".join(str(r["concurrency"]) for r in rows),
              f"--rounds {first['rounds']}", f"--max-tokens {data['max_tokens']}"]
    modes = list(data["engines"])
    if modes != ["adaptive", "fixed", "target_only"]:   # the default
        parts.append("--modes " + ",".join(modes))
    if data["dtype"] != "auto":
        parts.append(f"--dtype {data['dtype']}")
    for name in ("quantization", "draft_quantization"):
        if data.get(name):
            parts.append(f"--{name.replace('_', '-')} {data[name]}")
    if data["temperature"]:
        parts.append(f"--temperature {data['temperature']}")
    return " ".join(parts + ([extra] if extra else []))


def end_to_end(stem: str, title: str, extra: str, note: str) -> str:
    data = json.loads((RESULTS / f"{stem}.json").read_text())
    modes = list(data["engines"])
    # the headline mode as `dflash bench` picks it, the other DFlash modes beside it
    head, *others = [m for m in ("adaptive", "chain", "fixed") if m in modes]
    columns = ["concurrency", f"{head} tok/s", *(f"{m} tok/s" for m in others),
               "target-only tok/s", f"{head} speedup (per round)",
               *(f"{m} speedup" for m in others), f"tau ({head})",
               *(f"tau ({m})" for m in others if m == "chain"),
               f"drafts or tree nodes verified per request-step ({head})",
               "steps without the draft", "texts equal to target-only"]
    sampled = bool(data["temperature"])
    rows = []
    for r in data["rows"]:
        m = r["modes"][head]
        rounds = ", ".join(_x(s) for s in r["speedup_per_round"])
        row = [r["concurrency"], f"{r['tok_s']:.1f}", *(f"{r[f'{x}_tok_s']:.1f}" for x in others),
               f"{r['target_only_tok_s']:.1f}", f"{_x(r['speedup'])} ({rounds})",
               *(_x(r[f"{x}_speedup"]) for x in others), f"{r['tau']:.2f}",
               *(f"{r['modes'][x]['tau']:.2f}" for x in others if x == "chain"),
               f"{r['mean_verify_length']:.2f}",
               f"{m['draft_skipped_steps']} of {m['decode_steps']}",
               "n/a (sampled)" if sampled else f"{r['identical']}/{r['prompts']}"]
        rows.append(row)
    first = data["rows"][0]
    dtypes = sorted({e["dtype"] for e in data["engines"].values()})
    cost = data["engines"][head]["cost_model"]
    return "\n\n".join([
        f"### {title}",
        f"{first['target']} + {first['draft']}, "
        f"{'temperature ' + format(data['temperature'], 'g') if sampled else 'greedy'}, "
        f"{data['max_tokens']} tokens, "
        f"{first['prompts']} prompts, {first['rounds']} rounds; dtype chosen: "
        f"{', '.join(dtypes)}. {note}",
        f"Host: {host_line(data['host'])} (`bench/results/{stem}.json`, plot: "
        f"`bench/results/{stem}.png`)",
        f"```bash\n{bench_command(data, extra)}\n```",
        table(columns, rows),
        f"The {head} engine's calibrated cost model (ms):",
        cost_table(cost)])


def cost_table(cost: dict) -> str:
    labels = [("target_ms", "verify pass, n rows"),
              ("decode_ms", "decode pass, n sequences (one row each)"),
              ("draft_ms", f"draft pass, n sequences x {cost['block_size'] - 1} drafts"),
              ("draft_one_ms", "draft pass, n sequences x 1 draft")]
    ns = sorted({int(n) for key, _ in labels for n in cost.get(key, {})})
    rows = [[label, *(cost[key].get(str(n)) for n in ns)] for key, label in labels if key in cost]
    return table(["n", *map(str, ns)], rows)


def serving() -> str:
    stem = SERVE
    data = json.loads((RESULTS / f"{stem}.json").read_text())
    flags = []
    for key, value in data["args"].items():
        if value is None or value is False or key == "out":
            continue
        flag = "--" + key.replace("_", "-")
        if value is True:
            flags.append(flag)
        else:
            text = "inf" if isinstance(value, float) and math.isinf(value) else value
            flags.append(f"{flag} {text}")
    return "\n\n".join([
        "## Serving",
        "`dflash serve` on the bundled pair under streamed chat requests (the held-out questions, "
        "greedy), all sent at once with at most `concurrency` in flight: DFlash (adaptive, dtype "
        "auto) against the same server without the draft. Latencies in ms as mean / median / P99 "
        "(TTFT: time to first token, TPOT: per output token after the first, ITL: between "
        "streamed chunks, a DFlash chunk carrying every token of its step, E2EL: end to end); "
        "acceptance from the server's `vllm:spec_decode_*` counters (rate: accepted / verified "
        "draft tokens, as vLLM defines it).",
        f"Host: not recorded in `bench/results/{stem}.json` (`bench_serve.py` records its "
        "arguments only). The server ran the engine with one time correction per kind of step, "
        "not the cost model of the end-to-end tables above ([design.md](design.md) section 7).",
        f"```bash\n{HELD_OUT}\npython bench/bench_serve.py {' '.join(flags)}\n```",
        serve_table(data["rows"])])


def vllm() -> str:
    data = json.loads((RESULTS / f"{VLLM}.json").read_text())
    columns = list(data["rows"][0])
    return "\n\n".join([
        "## vLLM",
        "Stock vLLM, vLLM with the dflash plugin and dflash's own engine on the bundled pair "
        "(float32, the Hugging Face copy of the target), the last 4 held-out questions, greedy, "
        "96 tokens, each engine in its own process. \"context K/V\" is the wall time of "
        "`DFlashQwen3Model.precompute_and_store_context_kv` per draft step (the function the "
        "plugin replaces); \"dflash (fixed)\" verifies all 15 drafts every step, as vLLM does. "
        "The dflash rows ran without the engine's current cost model and held-back draft "
        "context. Every run's counters: `bench/results/bench_vllm_runs.json`; why stock "
        "vLLM's tau is lower: [vllm.md](vllm.md).",
        f"Host: {host_line(data['machine'])}; vLLM 0.32.0 (CPU build, eager) "
        f"(`bench/results/{VLLM}.json`)",
        "```bash\n.venv-vllm/bin/python bench/bench_vllm.py --prompts 4 --max-tokens 96 "
        "--concurrency 1,4\n```",
        table(columns, [[r.get(c) for c in columns] for r in data["rows"]])])


def micro(stem: str, title: str, command: str, note: str) -> str:
    data = json.loads((RESULTS / f"{stem}.json").read_text())
    columns = list(data["rows"][0])
    return "\n\n".join(filter(None, [
        f"### {title}", note, f"Host: {host_line(data['machine'])} (`bench/results/{stem}.json`)",
        f"```bash\n{command}\n```",
        table(columns, [[r.get(c) for c in columns] for r in data["rows"]])]))


def readme_table() -> str:
    """The README's results table: the headline `dflash bench` run, with its host."""
    stem = END_TO_END[0][0]
    data = json.loads((RESULTS / f"{stem}.json").read_text())
    rows = [[r["concurrency"], f"{r['tok_s']:.1f}", f"{r['target_only_tok_s']:.1f}",
             _x(r["speedup"]), f"{r['tau']:.2f}", f"{r['identical']}/{r['prompts']}"]
            for r in data["rows"]]
    first = data["rows"][0]
    prose = (f"The bundled pair, greedy, {first['prompts']} GSM8K "
             f"questions the draft never trained on, dtype and verify sizes chosen by the "
             f"engine. Host: {host_line(data['host'])}.")
    return "\n\n".join([
        BEGIN,
        textwrap.fill(prose, 100, break_long_words=False, break_on_hyphens=False),
        f"```bash\n{HELD_OUT}\n{bench_command(data, '')}\n```",
        table(["concurrency", "DFlash tok/s", "target-only tok/s", "speedup", "tau",
               "texts equal to target-only"], rows),
        END])


def tree_sizes_table() -> str:
    """The README's tau-by-verify-size table (bench/bench_tree_sizes.py), with its host."""
    data = json.loads((RESULTS / f"{TREE_SIZES}.json").read_text())
    rows = data["rows"]
    prose = (f"Tokens per step (tau) by verify size, each size fixed for a whole run "
             f"(`python bench/bench_tree_sizes.py`: the bundled pair in float32, greedy, the 20 "
             f"held-out questions, 256 tokens): the draft's argmax chain of k drafts against a "
             f"best-first tree of N nodes. Every run's texts are the same. Host: "
             f"{host_line(data['machine'])}.")
    sizes = [r["verify rows (drafts or nodes)"] for r in rows]
    return "\n\n".join([
        TREES_BEGIN,
        textwrap.fill(prose, 100, break_long_words=False, break_on_hyphens=False),
        table(["verify rows", *map(str, sizes)],
              [["chain of argmax drafts, tau", *("-" if r["chain tau"] is None
                                                 else f"{r['chain tau']:.2f}" for r in rows)],
               ["best-first tree, tau", *(f"{r['tree tau']:.2f}" for r in rows)]]),
        TREES_END])


def _replace(text: str, begin: str, end: str, block: str) -> str:
    head, sep, rest = text.partition(begin)
    _, sep2, tail = rest.partition(end)
    if not (sep and sep2):
        raise SystemExit(f"{README} has no table between {begin!r} and {end!r}")
    return head + block + tail


def readme(text: str) -> str:
    """`text` (the README) with its results tables re-rendered."""
    text = _replace(text, BEGIN, END, readme_table())
    return _replace(text, TREES_BEGIN, TREES_END, tree_sizes_table())


def render() -> str:
    parts = [
        "# Performance",
        "<!-- Generated by `python bench/render.py` from bench/results/*.json: do not edit by "
        "hand; rerun the benchmark, then the script. -->",
        "Every table below is rendered from a JSON file in `bench/results/`, with the host that "
        "JSON records and the command that wrote it (run from the repository root). Every ratio "
        "compares with a baseline measured in the same run; figures from different tables, "
        "hosts or runs do not compare. Speed depends on the host: whether bf16 GEMMs have matrix "
        "units (AMX) or AVX512-BF16 dot products changes the cost of a verify pass several-fold, "
        "which is why the engine measures its host ([design.md](design.md) section 4.4). On the "
        "shared VMs these were measured on, whole runs of the same command differ noticeably, so "
        "compare modes within one table.",
        "## End to end: `dflash bench`",
        "\"adaptive\" (the default) verifies a tree of the draft's best candidates per sequence, "
        "sized every step; \"chain\" chooses each sequence's number of argmax drafts every step; "
        "\"fixed\" verifies all 15 drafts every step; \"target-only\" is the same engine without "
        "the draft. tok/s include "
        "prefill; `--rounds N` runs the modes back to back in alternating order N times and "
        "reports tok/s over all rounds and each round's speedup. \"texts equal\" counts prompts "
        "whose tokens equal target-only's.",
        f"```bash\n{HELD_OUT}\n```",
        *(end_to_end(*spec) for spec in END_TO_END),
        serving(),
        vllm(),
        "## Engine, sampling, tensor parallelism and kernels",
        "Kernel baselines: the unfused PyTorch composition and `torch.compile` of it (for "
        "`panel_linear`: torch's `F.linear`); a column's name says which way its ratio goes "
        "(\"speedup\", \"vs ...\": the baseline's time over the kernel's). "
        "`python bench/run_all.py` runs every kernel benchmark. A host shown as bare `x86_64` "
        "comes from a JSON without the CPU model and flags; the "
        "`context_kv`, `paged_attention` and `rejection_sample` tables among them come from a "
        "2-core VM with AMX and AVX512-BF16 (Sapphire Rapids class).",
        *(micro(*spec) for spec in TABLES),
    ]
    return "\n\n".join(parts) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="compare with docs/performance.md instead of writing it")
    args = parser.parse_args(argv)
    wanted = {OUT: render(), README: readme(README.read_text())}
    stale = [path for path, text in wanted.items() if path.read_text() != text]
    if args.check:
        for path in stale:
            print(f"{path} is out of date: run python bench/render.py", file=sys.stderr)
        return 1 if stale else 0
    for path in stale:
        path.write_text(wanted[path])
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
