"""Serving benchmark: `dflash serve` under an async HTTP client, reporting what `vllm bench serve`
reports, with its labels.

For each mode (DFlash, target-only) it starts `dflash serve` on a free port of 127.0.0.1, sends
the prompts as streamed chat completions (greedy, `max_tokens` each) at each concurrency, at a
request rate (Poisson arrivals, `inf` = all at once) and reads the speculative-decoding counters
from `/metrics` before and after each run.

    mkdir -p runs && tail -n 20 data/gsm8k/train.jsonl > runs/gsm8k-heldout.jsonl
    python bench/bench_serve.py --dataset runs/gsm8k-heldout.jsonl --num-prompts 20 \\
        --concurrency 1,4,16                        # the bundled pair, DFlash and target-only
    python bench/bench_serve.py --url http://127.0.0.1:8000 --dataset ...   # a running server

Metrics (as `vllm bench serve`): successful requests, benchmark duration, request and output
token throughput, mean / median / P99 of TTFT (time to first token), TPOT (time per output token
after the first, per request), ITL (inter-token latency: the gaps between streamed chunks; a
DFlash chunk may carry several tokens) and E2EL (end-to-end latency), all in ms; acceptance rate
(accepted / drafted tokens verified, vLLM's definition) and acceptance length (1 + accepted /
drafts) from the server's `vllm:spec_decode_*` counters. Results: a table on stdout and
`bench/results/bench_serve_<dataset>.json` (per-request figures included).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from dflash.bench import load_dataset  # noqa: E402

RESULTS = ROOT / "bench" / "results"


# --------------------------------------------------------------------------- the server

class ServerProcess:
    """`dflash serve` in a subprocess on a free port; stopped with SIGTERM."""

    def __init__(self, args: list[str], timeout: float = 1800.0):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [str(ROOT), os.environ.get("PYTHONPATH", "")]))
        self.proc = subprocess.Popen([sys.executable, "-m", "dflash.cli", "serve", "--port", "0",
                                      *args], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                     text=True, env=env)
        self.log: list[str] = []
        self.url = None
        deadline = time.time() + timeout
        while self.url is None:
            line = self.proc.stderr.readline()
            if not line or time.time() > deadline:
                self.stop()
                raise RuntimeError("dflash serve did not start:\n" + "".join(self.log))
            self.log.append(line)
            sys.stderr.write(line)
            if line.startswith("dflash serve:") and " on http://" in line:
                self.url = line.split(" on ")[1].split()[0]
        threading.Thread(target=lambda: self.log.extend(self.proc.stderr), daemon=True).start()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def scrape(url: str) -> dict:
    """The spec-decode counters of /metrics: {name: value}, per-position ones as lists."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict = {"per_pos": {}}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in family.samples:
            if s.name == "vllm:spec_decode_num_accepted_tokens_per_pos_total":
                out["per_pos"][int(s.labels["position"])] = s.value
            elif s.name.startswith("vllm:spec_decode_") and s.name.endswith("_total"):
                out[s.name] = s.value
    return out


# --------------------------------------------------------------------------- the client

async def _one(client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int,
               chat: bool) -> dict:
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    path = "/v1/chat/completions" if chat else "/v1/completions"
    start = time.perf_counter()
    chunks, usage, text, error = [], None, "", None
    try:
        async with client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                return {"ok": False, "error": f"{r.status_code}: {(await r.aread())[:200]!r}"}
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    error = data["error"]["message"]
                    break
                if data.get("usage"):
                    usage = data["usage"]
                for choice in data.get("choices", []):
                    piece = choice.get("delta", {}).get("content") if chat else choice.get("text")
                    if piece:
                        chunks.append(time.perf_counter())
                        text += piece
    except httpx.HTTPError as e:
        error = f"{type(e).__name__}: {e}"
    end = time.perf_counter()
    if error is not None or usage is None or not chunks:
        return {"ok": False, "error": error or "no output"}
    n = usage["completion_tokens"]
    ttft = chunks[0] - start
    return {"ok": True, "prompt_tokens": usage["prompt_tokens"], "output_tokens": n,
            "ttft": ttft, "e2el": end - start,
            "tpot": (end - start - ttft) / (n - 1) if n > 1 else None,
            "itl": [b - a for a, b in zip(chunks, chunks[1:])], "text": text}


async def _run(url: str, model: str, prompts: list[str], max_tokens: int, chat: bool,
               concurrency: int, rate: float, seed: int) -> tuple[list[dict], float]:
    limits = httpx.Limits(max_connections=concurrency + 4)
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits) as client:
        semaphore = asyncio.Semaphore(concurrency)

        async def limited(prompt):
            async with semaphore:
                return await _one(client, model, prompt, max_tokens, chat)

        start = time.perf_counter()
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.create_task(limited(prompt)))
            if rate != float("inf"):
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - start


def _ms(values: list[float]) -> dict:
    if not values:
        return {"mean": None, "median": None, "p99": None}
    ordered = sorted(values)   # P99 with linear interpolation, as numpy.percentile
    k = 0.99 * (len(ordered) - 1)
    lo = int(k)
    hi = min(lo + 1, len(ordered) - 1)
    p99 = ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)
    return {"mean": 1e3 * statistics.fmean(values), "median": 1e3 * statistics.median(values),
            "p99": 1e3 * p99}


def summarize(results: list[dict], duration: float, before: dict, after: dict,
              concurrency: int) -> dict:
    ok = [r for r in results if r["ok"]]
    out_tokens = sum(r["output_tokens"] for r in ok)
    in_tokens = sum(r["prompt_tokens"] for r in ok)
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after if k != "per_pos"}
    drafts = delta.get("vllm:spec_decode_num_drafts_total", 0.0)
    drafted = delta.get("vllm:spec_decode_num_draft_tokens_total", 0.0)
    accepted = delta.get("vllm:spec_decode_num_accepted_tokens_total", 0.0)
    per_pos = [after["per_pos"][i] - before["per_pos"].get(i, 0.0)
               for i in sorted(after["per_pos"])]
    return {
        "successful_requests": len(ok),
        "failed_requests": len(results) - len(ok),
        "errors": sorted({r["error"] for r in results if not r["ok"]})[:5],
        "max_concurrency": concurrency,
        "duration_s": duration,
        "total_input_tokens": in_tokens,
        "total_generated_tokens": out_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "ttft_ms": _ms([r["ttft"] for r in ok]),
        "tpot_ms": _ms([r["tpot"] for r in ok if r["tpot"] is not None]),
        "itl_ms": _ms([x for r in ok for x in r["itl"]]),
        "e2el_ms": _ms([r["e2el"] for r in ok]),
        "num_drafts": drafts,
        "num_draft_tokens": drafted,
        "num_accepted_tokens": accepted,
        "acceptance_rate": 100 * accepted / drafted if drafted else None,
        "acceptance_length": 1 + accepted / drafts if drafts else None,
        "per_position_acceptance": [100 * n / drafts for n in per_pos] if drafts else [],
        "requests": [{k: v for k, v in r.items() if k != "itl"} for r in results],
    }


def print_result(mode: str, s: dict) -> None:
    def line(label, value, fmt="{:.2f}"):
        text = "n/a" if value is None else fmt.format(value)
        print(f"{label:<40}{text:>10}")

    print(f"{' Serving Benchmark Result (' + mode + ') ':=^50}")
    line("Successful requests:", s["successful_requests"], "{}")
    line("Failed requests:", s["failed_requests"], "{}")
    line("Maximum request concurrency:", s["max_concurrency"], "{}")
    line("Benchmark duration (s):", s["duration_s"])
    line("Total input tokens:", s["total_input_tokens"], "{}")
    line("Total generated tokens:", s["total_generated_tokens"], "{}")
    line("Request throughput (req/s):", s["request_throughput"])
    line("Output token throughput (tok/s):", s["output_throughput"])
    line("Total Token throughput (tok/s):", s["total_token_throughput"])
    for key, title, name in [("ttft_ms", "Time to First Token", "TTFT"),
                             ("tpot_ms", "Time per Output Token (excl. 1st token)", "TPOT"),
                             ("itl_ms", "Inter-token Latency", "ITL"),
                             ("e2el_ms", "End-to-end Latency", "E2EL")]:
        print(f"{title:-^50}")
        line(f"Mean {name} (ms):", s[key]["mean"])
        line(f"Median {name} (ms):", s[key]["median"])
        line(f"P99 {name} (ms):", s[key]["p99"])
    if s["num_drafts"]:
        print(f"{'Speculative Decoding':-^50}")
        line("Acceptance rate (%):", s["acceptance_rate"])
        line("Acceptance length:", s["acceptance_length"])
        line("Drafts:", s["num_drafts"], "{:.0f}")
        line("Draft tokens:", s["num_draft_tokens"], "{:.0f}")
        line("Accepted tokens:", s["num_accepted_tokens"], "{:.0f}")
        print("Per-position acceptance (%):", ", ".join(
            f"{x:.1f}" for x in s["per_position_acceptance"]))
    print("=" * 50)


def markdown(rows: list[dict]) -> str:
    head = ["mode", "concurrency", "requests", "duration s", "req/s", "output tok/s",
            "TTFT mean / median / P99 ms", "TPOT mean / median / P99 ms",
            "ITL mean / median / P99 ms", "E2EL mean / median / P99 ms", "acceptance rate",
            "acceptance length"]

    def three(d):
        return " / ".join("n/a" if d[k] is None else f"{d[k]:.0f}" for k in ("mean", "median",
                                                                              "p99"))

    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in rows:
        s = r["result"]
        rate = "n/a" if s["acceptance_rate"] is None else f"{s['acceptance_rate']:.1f}%"
        length = "n/a" if s["acceptance_length"] is None else f"{s['acceptance_length']:.2f}"
        lines.append("| " + " | ".join([
            r["mode"], str(r["concurrency"]), str(s["successful_requests"]),
            f"{s['duration_s']:.1f}", f"{s['request_throughput']:.2f}",
            f"{s['output_throughput']:.1f}", three(s["ttft_ms"]), three(s["tpot_ms"]),
            three(s["itl_ms"]), three(s["e2el_ms"]), rate, length]) + " |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------- main

def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", required=True,
                   help="GSM8K-format JSONL path, humaneval or mt-bench (as dflash bench)")
    p.add_argument("--num-prompts", type=int, default=20)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--concurrency", default="1,4,16", help="comma list")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second (Poisson arrivals); inf: all at once")
    p.add_argument("--modes", default="dflash,target_only",
                   help="comma list of dflash (the draft on) and target_only")
    p.add_argument("--target", default="smollm2")
    p.add_argument("--draft", default=None, help="default: the bundled draft for smollm2")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--speculation", default="adaptive", choices=["adaptive", "chain", "fixed"])
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="the server's batch limit (default: the largest concurrency)")
    p.add_argument("--completions", action="store_true",
                   help="send raw prompts to /v1/completions instead of chat completions")
    p.add_argument("--url", default=None,
                   help="benchmark this running server instead of starting one (one mode)")
    p.add_argument("--model", default=None, help="with --url: the served model name")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON path (default bench/results/...)")
    args = p.parse_args(argv)

    prompts = load_dataset(args.dataset, args.num_prompts)
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    modes = ["server"] if args.url else args.modes.split(",")
    rows = []
    for mode in modes:
        server = None
        if args.url:
            url = args.url.rstrip("/")
        else:
            flags = ["--target", args.target, "--dtype", args.dtype, "--speculation",
                     args.speculation, "--max-num-seqs",
                     str(args.max_num_seqs or max(concurrencies)), "--max-queue",
                     str(max(len(prompts), 1))]
            if mode == "target_only":
                flags.append("--no-draft")
            elif args.draft:
                flags += ["--draft", args.draft]
            server = ServerProcess(flags)
            url = server.url
        try:
            model = args.model or httpx.get(url + "/v1/models").json()["data"][0]["id"]
            asyncio.run(_run(url, model, prompts[:1], 8, not args.completions, 1, float("inf"),
                             args.seed))   # warm-up, excluded
            for c in concurrencies:
                before = scrape(url)
                results, duration = asyncio.run(_run(url, model, prompts, args.max_tokens,
                                                     not args.completions, c,
                                                     args.request_rate, args.seed))
                summary = summarize(results, duration, before, scrape(url), c)
                print_result(f"{mode}, concurrency {c}", summary)
                rows.append({"mode": mode, "concurrency": c, "result": summary})
        finally:
            if server is not None:
                server.stop()
    name = Path(args.dataset).stem if Path(args.dataset).is_file() else args.dataset
    out = Path(args.out) if args.out else RESULTS / f"bench_serve_{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": {k: v for k, v in vars(args).items()}, "rows": rows},
                              indent=1, default=str))
    print(markdown(rows))
    print(f"results: {out}")
    return 0 if all(r["result"]["failed_requests"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
