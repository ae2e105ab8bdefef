"""Micro-benchmark of dflash::rejection_sample at the Qwen3 vocabulary (V = 151936, K = 15).

For batch sizes 1, 16, 64 with dense and one-hot proposals (half the rows greedy): the kernel's
time against the PyTorch reference in the same run, and the bytes the op must read (every
probability is validated, so all of target_probs, draft_probs and exponential) per second against
a plain copy of the same number of bytes. Goal: >= 5x the reference at batch 16 and >= 50% of
copy bandwidth.

    python bench/bench_rejection_sample.py [--threads N]   # from the repository root
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # this tree's dflash

import torch  # noqa: E402
from common import copy_bandwidth, timeit, write  # noqa: E402

import dflash  # noqa: E402
from dflash import reference  # noqa: E402
from dflash.testing import rejection_sample_inputs  # noqa: E402

V, K = 151936, 15


def case(bs: int, dense: bool) -> dict:
    args = rejection_sample_inputs(bs=bs, k=K, v=V, dense=dense)
    nbytes = sum(t.numel() * t.element_size() for t in args.values() if t is not None)
    kernel_s = timeit(lambda: torch.ops.dflash.rejection_sample(**args))
    reference_s = timeit(lambda: reference.rejection_sample(**args), warmup=1, min_time=0,
                         min_runs=3)
    copy = copy_bandwidth(nbytes)
    return {
        "batch": bs, "proposal": "dense" if dense else "one-hot", "MB read": nbytes / 1e6,
        "kernel ms": kernel_s * 1e3, "reference ms": reference_s * 1e3,
        "speedup": reference_s / kernel_s,
        "kernel GB/s": nbytes / kernel_s / 1e9, "copy GB/s": copy / 1e9,
        "of copy": f"{nbytes / kernel_s / copy:.0%}",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    threads = parser.parse_args().threads
    if threads:
        torch.set_num_threads(threads)
    impl = dflash.ops.implementation("rejection_sample")
    print(f"rejection_sample CPU implementation: {impl}, {torch.get_num_threads()} threads, "
          f"load average {os.getloadavg()[0]:.1f}")
    rows = [case(bs, dense) for bs in (1, 16, 64) for dense in (True, False)]
    write("rejection_sample" + (f"_{threads}thread" if threads else ""), rows, list(rows[0]))
    print("copy GB/s counts read + write; kernel GB/s counts the bytes the op reads")


if __name__ == "__main__":
    main()
