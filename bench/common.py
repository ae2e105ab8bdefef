"""Tiny timing harness shared by the micro-benchmarks: every figure is a ratio against a baseline
measured in the same run, next to this machine's measured copy bandwidth and GEMM rate."""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import torch

from dflash import bench, host

RESULTS = Path(__file__).parent / "results"


def build_suffix() -> str:
    """`_<limit>` (e.g. `_avx512_core`) when ONEDNN_MAX_CPU_ISA hides instructions from oneDNN
    and the kernels, and `_avx2` or `_default` when the kernels loaded are of that build (an
    AVX2-only CPU, or ATEN_CPU_CAPABILITY), else "": results files of such runs carry it, as
    `dflash bench`'s do (`dflash.bench.variant`)."""
    return "".join(f"_{part}" for part in bench.variant(bench.host_info()))


def timeit(fn, warmup: int = 3, min_time: float = 0.5, min_runs: int = 5) -> float:
    """Median wall time of fn() in seconds."""
    for _ in range(warmup):
        fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < min_runs or time.perf_counter() - start < min_time:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_bandwidth(nbytes: int) -> float:
    """Bytes/s of a plain tensor copy of `nbytes` (read + write counted once each, like a kernel
    that reads its input once and writes its output once)."""
    src = torch.empty(max(nbytes // 4, 1), dtype=torch.float32).uniform_()
    dst = torch.empty_like(src)
    seconds = timeit(lambda: dst.copy_(src))
    return 2 * src.numel() * 4 / seconds


def gemm_rate(m: int, n: int, k: int, dtype: torch.dtype) -> float:
    """FLOP/s of an [m, k] x [k, n] matmul in `dtype`."""
    a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
    return 2 * m * n * k / timeit(lambda: a @ b)


def threads_option(description: str):
    """The micro-benchmarks' command line: --threads N sets torch's threads (default: torch's
    choice). Returns the parsed arguments."""
    import argparse

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    return args


def run_thread_cases(name: str, description: str, case, shapes) -> None:
    """case(*shape, threads) for every shape, with --threads N threads or else with 1 and with
    torch's default; the rows are written as `name` (`name`_Nthread with --threads)."""
    import argparse

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--threads", type=int, help="torch threads (default: 1 and torch's choice)")
    cli = parser.parse_args()
    threads = [cli.threads] if cli.threads else sorted({1, torch.get_num_threads()})
    print(f"load average {os.getloadavg()[0]:.1f}")
    rows = [case(*shape, t) for shape in shapes for t in threads]
    write(name + (f"_{cli.threads}thread" if cli.threads else ""), rows, list(rows[0]))


def machine() -> dict:
    """The host (CPU model, AMX / AVX512-BF16 / AVX-512 / AVX2 flags, threads, torch) and the CPU
    capability torch dispatches to."""
    return {**host.describe(), "capability": torch.backends.cpu.get_cpu_capability()}


def write(name: str, rows: list[dict], columns: list[str]) -> None:
    """Print a markdown table of `rows` and save it with the JSON under bench/results/."""
    RESULTS.mkdir(exist_ok=True)
    lines = ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(_fmt(row.get(c, "")) for c in columns) + " |")
    table = "\n".join(lines)
    print(table)
    (RESULTS / f"{name}.md").write_text(f"Machine: {machine()}\n\n{table}\n")
    (RESULTS / f"{name}.json").write_text(json.dumps({"machine": machine(), "rows": rows},
                                                     indent=1))


def _fmt(value) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)
