"""Micro-benchmark of dflash::quant_linear on SmolLM2-135M's GEMM shapes.

One pass over all of the model's linear weights (30 layers of qkv, o, gate_up, down, then the
lm_head, as in a decode step) for 1 to 64 rows of bf16 activations, in the same run: the bf16
weights the way the engine multiplies them on this host (`layers.pack_linear_weight`), and the
same weights quantized to int8 and int4 (`quant_linear`). t(m) / t(1) is what a verify pass of
m rows costs against a one-token decode, the figure DFlash's speed rests on.

    python bench/bench_quant_linear.py [--threads N]   # from the repository root

Under `ATEN_CPU_CAPABILITY=avx2` (or `default`) the kernels of that build run, and the results
file gets an `_avx2` (`_default`) suffix.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # this tree's dflash

import torch  # noqa: E402
from bench_panel_linear import MODEL_SHAPES  # noqa: E402
from common import build_suffix, threads_option, timeit, write  # noqa: E402

from dflash import host  # noqa: E402
from dflash.models.layers import linear, pack_linear_weight, quantize_linear_weight  # noqa: E402


def main() -> None:
    threads_option(__doc__)
    shapes = MODEL_SHAPES
    weights = [torch.randn(shape, generator=torch.Generator().manual_seed(i))
               for i, shape in enumerate(shapes)]
    formats = {f"bf16 ({host.bf16_gemm()})": [pack_linear_weight(w.bfloat16()) for w in weights],
               "int8": [quantize_linear_weight(w, "int8") for w in weights],
               "int4": [quantize_linear_weight(w, "int4") for w in weights]}
    del weights
    first, rows = {}, []
    for m in (1, 4, 8, 16, 32, 64):
        x = {k: torch.randn(m, k).bfloat16() for k in {s[1] for s in shapes}}
        row = {"rows": m}
        for name, ws in formats.items():
            t = timeit(lambda ws=ws, x=x: [linear(x[s[1]], w) for s, w in zip(shapes, ws)],
                       min_time=1.0)
            first.setdefault(name, t)
            row[f"{name} ms"] = t * 1e3
            row[f"{name} t(m)/t(1)"] = t / first[name]
        bf16 = row[f"{next(iter(formats))} ms"]
        row |= {f"{name} vs bf16 time": row[f"{name} ms"] / bf16 for name in ("int8", "int4")}
        rows.append(row)
    write("quant_linear" + build_suffix(), rows, list(rows[0]))


if __name__ == "__main__":
    main()
