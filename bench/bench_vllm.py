"""Stock vLLM vs vLLM + dflash plugin vs dflash's own engine on the same pair and prompts.

Run with the vLLM environment's python (.ci/vllm-env):

    .venv-vllm/bin/python bench/bench_vllm.py [--prompts 8 --max-tokens 128 --concurrency 1,4]

Every engine runs in its own process, one after the other, greedy, in float32 (the dtype in which
all three compute the same tokens): vLLM's CPU build with DFlash (stock, with the plugin, and
stock with its context k_norm run per layer, see docs/vllm.md) and target-only, and dflash's
engine with DFlash (speculation "fixed": every step verifies all 15 drafts, as vLLM does) and
target-only. Reported per engine and concurrency: output tok/s (wall time of generate, prefill
included), tau (1 + accepted / drafts) and, for vLLM's DFlash runs, the time per draft step spent in
DFlashQwen3Model.precompute_and_store_context_kv (the function the plugin replaces). Tables and JSON
go to bench/results/bench_vllm.*.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(Path(__file__).parent))

VLLM_MODES = ("stock", "plugin", "per-layer-k-norm", "target-only")
DEFAULT_MODES = ("stock", "plugin", "target-only", "dflash", "dflash-target-only")
DFLASH_MODES = ("dflash", "dflash-target-only")


def run_dflash(mode: str, prompts: int, max_tokens: int, concurrency: int, out: Path) -> None:
    """dflash's own engine on the bundled pair (the HF copy of the target vLLM reads)."""
    import vllm_engine

    from dflash import LLM, SamplingParams
    from dflash.assets import bundled_draft, smollm2_hf_target

    target = smollm2_hf_target()
    ids = vllm_engine.held_out_prompts(target, prompts)
    draft = None if mode == "dflash-target-only" else bundled_draft()
    with LLM(target, draft, dtype="float32", max_num_seqs=concurrency,
             speculation="fixed") as llm:
        llm.generate(ids[:1], SamplingParams(max_tokens=8, temperature=0.0))   # warm-up
        before = llm.metrics()
        outs = llm.generate(ids, SamplingParams(max_tokens=max_tokens, temperature=0.0))
        after = llm.metrics()
    drafts = after["num_drafts"] - before["num_drafts"]
    accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
    tokens = [list(o.token_ids) for o in outs]
    seconds = after["elapsed_s"] - before["elapsed_s"]
    out.write_text(json.dumps({
        "mode": mode, "token_ids": tokens, "seconds": seconds,
        "tok_per_s": sum(map(len, tokens)) / seconds,
        "spec": {"drafts": drafts, "accepted": accepted,
                 "tau": 1 + accepted / drafts if drafts else None}}) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--concurrency", default="1,4")
    parser.add_argument("--modes", default=",".join(DEFAULT_MODES),
                        help=f"of {', '.join(VLLM_MODES + DFLASH_MODES)}")
    parser.add_argument("--dflash-child", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.dflash_child:
        return run_dflash(args.dflash_child, args.prompts, args.max_tokens,
                          int(args.concurrency), args.out)
    import common

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for conc in map(int, args.concurrency.split(",")):
            for mode in args.modes.split(","):
                out = Path(tmp) / f"{mode}-{conc}.json"
                common_args = ["--prompts", str(args.prompts), "--max-tokens",
                               str(args.max_tokens), "--out", str(out)]
                if mode in VLLM_MODES:
                    cmd = [str(ROOT / "tools" / "vllm_engine.py"), "--mode", mode,
                           "--concurrency", str(conc), "--warmup", "1", *common_args]
                else:
                    cmd = [__file__, "--dflash-child", mode, "--concurrency", str(conc),
                           *common_args]
                print(f"running {mode} at concurrency {conc}", flush=True)
                subprocess.run([sys.executable, *cmd], check=True, capture_output=True)
                rows.append({"concurrency": conc, **json.loads(out.read_text())})
    table = []
    reference = {(r["concurrency"]): r["token_ids"] for r in rows if r["mode"] == "stock"}
    for r in rows:
        ctx = r.get("context_kv_seconds") or []
        table.append({
            "engine": {"stock": "vLLM", "plugin": "vLLM + dflash plugin",
                       "per-layer-k-norm": "vLLM, per-layer k_norm",
                       "target-only": "vLLM target-only", "dflash": "dflash (fixed)",
                       "dflash-target-only": "dflash target-only"}[r["mode"]],
            "concurrency": r["concurrency"], "tok/s": r["tok_per_s"],
            "tau": r["spec"].get("tau") or "",
            "context K/V ms per step (median)": statistics.median(ctx) * 1e3 if ctx else "",
            "same tokens as vLLM": "" if r["concurrency"] not in reference
            else r["token_ids"] == reference[r["concurrency"]],
        })
        r.pop("token_ids")
    common.write("bench_vllm", table, list(table[0]))
    (common.RESULTS / "bench_vllm_runs.json").write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
