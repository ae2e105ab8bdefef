"""paged_attention: the C++ kernel vs the PyTorch composition (gather the context from the paged
cache + scaled_dot_product_attention) and `torch.compile` of that composition, in the same run.

    PYTHONPATH=. python bench/bench_paged_attention.py [--quick] [--threads N]

Table 1 (`paged_attention`) is the issue's grid: the Qwen3-8B DFlash draft shape (Hq = 32, Hkv = 8,
D = 128, 16 non-causal block queries per sequence), batch 1 and 8, context 512 / 2048 / 8192,
bf16 and fp32, with the kernel's achieved K/V read rate next to this machine's copy bandwidth.
Table 2 (`paged_attention_target`) covers the causal uses by the target model: prefill of a long
prompt, decode and verify. On a shared machine, `--threads 1` gives the steadier comparison:
two-thread runs of both sides suffer whenever another process takes one of the cores.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import dflash  # noqa: E402
from bench.common import copy_bandwidth, timeit, write  # noqa: E402
from dflash.ops.cases import paged_attention_inputs  # noqa: E402


def composition(query, key, value, key_cache, value_cache, block_table, context_lens,
                cu_query_lens, scale, causal):
    """The unfused baseline for a batch of equal-length sequences: one gather of every context
    through the block table, concatenation with the new K/V, one batched SDPA call (GQA native)."""
    b = block_table.shape[0]
    ctx, n = int(context_lens[0]), query.shape[0] // b
    hkv, d = key.shape[1:]
    blocks = block_table[:, : -(-ctx // key_cache.shape[1])].long()

    def keys_of(cache, new):
        gathered = cache[blocks].view(b, -1, hkv, d)[:, :ctx]
        return torch.cat([gathered, new.view(b, n, hkv, d)], dim=1).transpose(1, 2)

    mask = None
    if causal:   # new token i sees the context and new tokens 0..i
        mask = torch.arange(ctx + n)[None, :] <= ctx + torch.arange(n)[:, None]
    out = F.scaled_dot_product_attention(
        query.view(b, n, -1, d).transpose(1, 2), keys_of(key_cache, key),
        keys_of(value_cache, value), attn_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(1, 2).reshape(query.shape)


COMPILED = torch.compile(composition, dynamic=False)


def measure(batch, context, queries, hq, hkv, d, dtype, causal, block_size=16):
    args = paged_attention_inputs(context_lens=(context,) * batch, query_lens=(queries,) * batch,
                                  hq=hq, hkv=hkv, d=d, block_size=block_size, extra_blocks=0,
                                  causal=causal, dtype=dtype)
    tol = 2e-2 if dtype != torch.float32 else 1e-4
    kernel = torch.ops.dflash.paged_attention(**args)
    for fn in (composition, COMPILED):
        torch.testing.assert_close(kernel, fn(**args), atol=tol, rtol=tol)
    # Alternate the three in short rounds and keep each one's best round, so load from other
    # processes on the machine hits them alike.
    fns = (lambda: torch.ops.dflash.paged_attention(**args), lambda: composition(**args),
           lambda: COMPILED(**args))
    rounds = [[timeit(fn, min_time=0.2) for fn in fns] for _ in range(3)]
    kernel, baseline, compiled = (min(times) for times in zip(*rounds))
    kv_bytes = 2 * batch * context * hkv * d * args["key"].element_size()
    return {"dtype": str(dtype).removeprefix("torch."), "batch": batch, "context": context,
            "queries": queries, "kernel ms": kernel * 1e3, "composition ms": baseline * 1e3,
            "compile ms": compiled * 1e3, "speedup": baseline / kernel,
            "vs compile": compiled / kernel, "K/V GB/s": kv_bytes / kernel / 1e9}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="batch 1 and context 2048 only "
                        "(results files get a _quick suffix)")
    parser.add_argument("--threads", type=int, help="torch threads (default: all cores); the "
                        "results files get a _<n>thread suffix")
    opts = parser.parse_args()
    suffix = ""
    if opts.threads:
        torch.set_num_threads(opts.threads)
        suffix = f"_{opts.threads}thread"
    if opts.quick:   # a spot check must not overwrite the full tables
        suffix += "_quick"
    impl = dflash.ops.implementation("paged_attention")
    if impl == "reference":
        sys.exit("paged_attention has no compiled CPU kernel: build with "
                 "`python setup.py build_ext --inplace` first")
    copy = copy_bandwidth(256 << 20)
    print(f"implementation: {impl}; copy bandwidth {copy / 1e9:.1f} GB/s")

    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        for batch in (1,) if opts.quick else (1, 8):
            for context in (2048,) if opts.quick else (512, 2048, 8192):
                row = measure(batch, context, 16, 32, 8, 128, dtype, causal=False)
                row["of copy"] = row["K/V GB/s"] * 1e9 / copy
                rows.append(row)
                print(row, flush=True)
    write("paged_attention" + suffix, rows, ["dtype", "batch", "context", "kernel ms",
                                             "composition ms", "compile ms", "speedup",
                                             "vs compile", "K/V GB/s", "of copy"])

    target = []
    shapes = {"SmolLM2 (9/3/64)": (9, 3, 64), "Qwen3-8B (32/8/128)": (32, 8, 128)}
    uses = [("prefill", 1, 0, 2048), ("decode", 8, 2048, 1), ("verify", 8, 2048, 16)]
    for model, (hq, hkv, d) in shapes.items():
        for use, batch, context, queries in uses[:1] if opts.quick else uses:
            row = measure(batch, context, queries, hq, hkv, d, torch.bfloat16, causal=True)
            target.append({"model": model, "use": use, **row})
            print(target[-1], flush=True)
    write("paged_attention_target" + suffix, target,
          ["model", "use", "dtype", "batch", "context", "queries", "kernel ms", "composition ms",
           "compile ms", "speedup", "vs compile"])


if __name__ == "__main__":
    main()
