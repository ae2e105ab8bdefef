"""Micro-benchmark of dflash::rejection_sample at the Qwen3 vocabulary (V = 151936, K = 15).

For batch sizes 1, 16, 64 with dense and one-hot proposals (half the rows greedy), in the same
run: the kernel, the PyTorch reference (the executable spec, a loop over rows), a batched PyTorch
composition without Python loops, and `torch.compile` of that composition; and the bytes the op
must read (every probability is checked, so all of target_probs, draft_probs and exponential)
per second against a plain copy of the same number of bytes. Goal: >= 5x the reference at batch
16 and >= 50% of copy bandwidth.

Then, at batch 16, K 15, dense fp32, every row sampled: the kernel with and without `check`
(without, each sequence reads only p[draft] and q[draft] up to the first rejection, then the
residual's p, q and noise rows, or the bonus row) against reading 3 vocabulary rows per sequence
(the max of a contiguous [3 * 16, V] float32 tensor), all in the same run. Goal: without
checking <= 2x the 3-row read.

    python bench/bench_rejection_sample.py [--threads N] [--reads-only]   # from the repository root
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
from dflash.ops import reference  # noqa: E402
from dflash.ops.cases import rejection_sample_inputs  # noqa: E402

V, K = 151936, 15


def composition(draft_token_ids, draft_probs, target_probs, is_greedy, uniform, exponential):
    """docs/design.md 3.3 as batched tensor ops (no checks, no row loop): the unfused baseline."""
    bs, k = draft_token_ids.shape
    rows = torch.arange(bs)
    ids = draft_token_ids[..., None]
    p_draft = target_probs[:, :k].gather(2, ids)[..., 0]
    q_draft = 1.0 if draft_probs is None else draft_probs.gather(2, ids)[..., 0]
    accept = torch.where(is_greedy[:, None], draft_token_ids == target_probs[:, :k].argmax(-1),
                         uniform * q_draft < p_draft)
    accepted = accept.long().cumprod(1).sum(1)
    p_final = target_probs[rows, accepted]
    rejected = accepted < k
    at = accepted.clamp(max=k - 1)
    if draft_probs is None:
        q_final = torch.zeros_like(p_final).scatter_(1, draft_token_ids[rows, at, None], 1.0)
    else:
        q_final = draft_probs[rows, at]
    residual = torch.where(rejected[:, None], (p_final - q_final).clamp(min=0), p_final)
    residual = torch.where((residual > 0).any(1, keepdim=True), residual, p_final)
    final = torch.where(is_greedy, p_final.argmax(1), (residual / exponential).argmax(1))
    out = torch.where(torch.arange(k + 1) < accepted[:, None],
                      torch.nn.functional.pad(draft_token_ids, (0, 1)), -1)
    out[rows, accepted] = final
    return out, accepted


COMPILED = torch.compile(composition, dynamic=False)


def case(bs: int, dense: bool) -> dict:
    args = rejection_sample_inputs(bs=bs, k=K, v=V, dense=dense)
    nbytes = sum(t.numel() * t.element_size() for t in args.values() if t is not None)
    expected = torch.ops.dflash.rejection_sample(**args)
    for fn in (reference.rejection_sample, composition, COMPILED):
        for got, want in zip(fn(**args), expected):
            assert torch.equal(got, want), fn
    kernel_s = timeit(lambda: torch.ops.dflash.rejection_sample(**args))
    reference_s = timeit(lambda: reference.rejection_sample(**args), warmup=1, min_time=0,
                         min_runs=3)
    composition_s = timeit(lambda: composition(**args))
    compiled_s = timeit(lambda: COMPILED(**args))
    copy = copy_bandwidth(nbytes)
    return {
        "batch": bs, "proposal": "dense" if dense else "one-hot", "MB read": nbytes / 1e6,
        "kernel ms": kernel_s * 1e3, "reference ms": reference_s * 1e3,
        "composition ms": composition_s * 1e3, "compile ms": compiled_s * 1e3,
        "speedup": reference_s / kernel_s, "vs composition": composition_s / kernel_s,
        "vs compile": compiled_s / kernel_s,
        "kernel GB/s": nbytes / kernel_s / 1e9, "copy GB/s": copy / 1e9,
        "of copy": f"{nbytes / kernel_s / copy:.0%}",
    }


def reads() -> dict:
    bs = 16
    args = rejection_sample_inputs(bs=bs, k=K, v=V, dense=True, greedy_every=0, draft_noise=0.3)
    accepted = reference.rejection_sample(**args)[1]
    for check in (True, False):
        got = torch.ops.dflash.rejection_sample(**args, check=check)
        assert torch.equal(got[1], accepted)
    three_rows = torch.rand(3 * bs, V)
    checked_s = timeit(lambda: torch.ops.dflash.rejection_sample(**args))
    lazy_s = timeit(lambda: torch.ops.dflash.rejection_sample(**args, check=False))
    rows_s = timeit(lambda: three_rows.amax())
    return {
        "batch": bs, "K": K, "V": V, "proposal": "dense, all sampled",
        "mean accepted": float(accepted.float().mean()),
        "check ms": checked_s * 1e3, "no-check ms": lazy_s * 1e3,
        "3-row read ms": rows_s * 1e3, "check / 3 rows": checked_s / rows_s,
        "no-check / 3 rows": lazy_s / rows_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    parser.add_argument("--reads-only", action="store_true",
                        help="only the check / no-check / 3-row comparison")
    cli = parser.parse_args()
    threads = cli.threads
    if threads:
        torch.set_num_threads(threads)
    impl = dflash.ops.implementation("rejection_sample")
    print(f"rejection_sample CPU implementation: {impl}, {torch.get_num_threads()} threads, "
          f"load average {os.getloadavg()[0]:.1f}")
    suffix = f"_{threads}thread" if threads else ""
    if not cli.reads_only:
        rows = [case(bs, dense) for bs in (1, 16, 64) for dense in (True, False)]
        write("rejection_sample" + suffix, rows, list(rows[0]))
        print("copy GB/s counts read + write; kernel GB/s counts the bytes the op reads")
    row = reads()
    write("rejection_sample_reads" + suffix, [row], list(row))


if __name__ == "__main__":
    main()
