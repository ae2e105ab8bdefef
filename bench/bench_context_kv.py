"""dflash::context_kv at the Qwen3-8B draft shape: the fused op against

  * eager: the unfused PyTorch composition (fc GEMM, RMSNorm, one K/V GEMM, view + permute +
    contiguous, then per layer: k RMSNorm, RoPE, index_put of K and of V),
  * compile: torch.compile of that same composition,
  * floor: the two GEMMs alone, which any implementation must run.

H = 4096, 5 target features (D_in = 20480), L = 5, Hkv = 8, D = 128, caches as views of one
stacked tensor, every slot valid (the composition does not skip -1 slots). The variants run
interleaved, one call each per round for `--rounds` rounds; times are the fastest call of each
(the statistic least disturbed by other processes on a shared machine), and the fused / floor
ratio is also given from the medians.

    python bench/bench_context_kv.py                 # N = 16 and 512, bfloat16
    python bench/bench_context_kv.py --tokens 16 --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # this checkout's dflash and bench

from bench.common import timeit, write  # noqa: E402
from dflash import ops  # noqa: E402
from dflash.ops import reference  # noqa: E402
from dflash.ops.cases import context_kv_inputs  # noqa: E402

SHAPE = dict(d_in=5 * 4096, h=4096, layers=5, hkv=8, d=128, block_size=16)


def unfused(hidden, fc_weight, hidden_norm_weight, kv_weight, kv_bias, k_norm_weight, positions,
            cos_sin_cache, slot_mapping, key_caches, value_caches, eps):
    dtype = hidden.dtype
    layers, d = k_norm_weight.shape
    hkv = key_caches[0].shape[2]
    c = reference.rms_norm_float32(F.linear(hidden, fc_weight), hidden_norm_weight, eps).to(dtype)
    kv = F.linear(c, kv_weight, kv_bias)
    kv = kv.view(-1, layers, 2, hkv, d).permute(1, 2, 0, 3, 4).contiguous()  # [L, 2, N, Hkv, D]
    cos_sin = cos_sin_cache[positions]
    for layer in range(layers):
        k = reference.rope_neox(reference.rms_norm_float32(kv[layer, 0], k_norm_weight[layer], eps),
                                cos_sin).to(dtype)
        key_caches[layer].view(-1, hkv, d).index_put_((slot_mapping,), k)
        value_caches[layer].view(-1, hkv, d).index_put_((slot_mapping,), kv[layer, 1])


def gemms(args, c):
    F.linear(args["hidden"], args["fc_weight"])
    F.linear(c, args["kv_weight"], args["kv_bias"])


def check_agreement(args, compiled) -> None:
    """The three implementations compute the same thing. The bound is loose on purpose: the
    compiled graph fuses the norms with its own summation order, so c, and then K and V, can move
    by a few ulps of small values; a layout or indexing mistake would be off by O(1)."""
    results = []
    for fn in (ops.context_kv, unfused, compiled):
        for cache in args["key_caches"] + args["value_caches"]:
            cache.fill_(float("nan"))
        fn(**args)
        results.append([c.clone() for c in args["key_caches"] + args["value_caches"]])
    for other in results[1:]:
        for a, b in zip(results[0], other):
            torch.testing.assert_close(a, b, rtol=0.02, atol=0.05, equal_nan=True)


def bench(n: int, dtype: torch.dtype, rounds: int) -> dict:
    args = context_kv_inputs(n=n, num_blocks=2 * max(n // SHAPE["block_size"], 1), dtype=dtype,
                             stacked=True, **SHAPE)
    compiled = torch.compile(unfused)
    check_agreement(args, compiled)        # also compiles
    c = reference.rms_norm_float32(F.linear(args["hidden"], args["fc_weight"]),
                           args["hidden_norm_weight"], args["eps"]).to(dtype)
    variants = {"fused": lambda: ops.context_kv(**args), "eager": lambda: unfused(**args),
                "compile": lambda: compiled(**args), "floor": lambda: gemms(args, c)}
    runs: dict[str, list[float]] = {name: [] for name in variants}
    for fn in variants.values():
        timeit(fn, min_time=0, min_runs=1)                   # warm up
    for _ in range(rounds):                                  # interleaved single runs
        for name, fn in variants.items():
            runs[name].append(timeit(fn, warmup=0, min_time=0, min_runs=1))
    best = {name: min(times) for name, times in runs.items()}
    rows = args["kv_weight"].shape[0]
    flops = 2 * n * (SHAPE["d_in"] * SHAPE["h"] + SHAPE["h"] * rows)
    return {"N": n, "dtype": str(dtype).removeprefix("torch."),
            **{f"{name} ms": 1e3 * t for name, t in best.items()},
            "fused / floor": best["fused"] / best["floor"],
            "fused / floor (median)": statistics.median(runs["fused"]) /
            statistics.median(runs["floor"]),
            "eager / fused": best["eager"] / best["fused"],
            "compile / fused": best["compile"] / best["fused"],
            "floor TFLOP/s": flops / best["floor"] / 1e12}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[16, 512])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--rounds", type=int, default=15)
    opts = parser.parse_args()
    print(f"context_kv served by: {ops.implementation('context_kv')}")
    rows = [bench(n, getattr(torch, opts.dtype), opts.rounds) for n in opts.tokens]
    columns = ["N", "dtype", "fused ms", "eager ms", "compile ms", "floor ms", "fused / floor",
               "fused / floor (median)", "eager / fused", "compile / fused", "floor TFLOP/s"]
    write("context_kv", rows, columns)


if __name__ == "__main__":
    main()
