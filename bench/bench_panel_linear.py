"""Micro-benchmark of dflash::panel_linear on SmolLM2-135M's GEMM shapes.

One pass over all of the model's linear weights (30 layers of qkv, o, gate_up, down, then the
lm_head: 538 MB, more than this machine's cache, as in a decode step) for 1, 4, 16 and 64 rows,
in the same run: torch's F.linear (MKL) on the [N, K] float32 weights, panel_linear on the same
weights in column panels, and panel_linear on bf16 weights in panels with bf16 rows (float32
math, each weight widened as it is loaded: half the bytes to stream); and the float32 bytes
streamed per second against a plain copy of the same number of bytes (a pass that is bound by
memory bandwidth runs near 0.5 copy, which moves each byte twice). Where the CPU multiplies bf16
in hardware (oneDNN says so) also: panel_linear on the bf16 weights in pair panels (AVX512-BF16's
dot products where the CPU has them) and oneDNN's bf16 GEMM on its blocked layout, the two bf16
paths `host.bf16_gemm` chooses between.

    python bench/bench_panel_linear.py [--threads N]   # from the repository root
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # this tree's dflash

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from common import copy_bandwidth, threads_option, timeit, write  # noqa: E402

from dflash import ops  # noqa: E402

HIDDEN, INTERMEDIATE, LAYERS, VOCAB = 576, 1536, 30, 49152
LAYER_SHAPES = [(960, HIDDEN), (HIDDEN, HIDDEN), (2 * INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)]
MODEL_SHAPES = LAYER_SHAPES * LAYERS + [(VOCAB, HIDDEN)]   # one decode step's weights, in order


def one_pass(linear, weights, inputs) -> None:
    for w in weights:
        k = 2 * w.shape[1] if w.dim() == 4 else w.shape[1]   # pair panels: [N/16, K/2, 16, 2]
        linear(inputs[k], w)


def onednn_linear(x, weight):
    return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")


def main() -> None:
    threads_option(__doc__)
    weights = [torch.randn(shape) for shape in MODEL_SHAPES]
    panels = [ops.to_panels(w) for w in weights]
    bf16_panels = [p.bfloat16() for p in panels]
    bf16_units = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    if bf16_units:
        pairs = [ops.to_pair_panels(w.bfloat16()) for w in weights]
        onednn = [torch.ops.mkldnn._reorder_linear_weight(w.bfloat16(), 16) for w in weights]
    nbytes = sum(w.numel() * 4 for w in weights)
    copy = copy_bandwidth(nbytes)
    rows = []
    for m in (1, 4, 16, 64, 128):
        x = {k: torch.randn(m, k) for k in (HIDDEN, INTERMEDIATE)}
        t_torch = timeit(lambda x=x: one_pass(F.linear, weights, x), min_time=1.0)
        t_panel = timeit(lambda x=x: one_pass(ops.panel_linear, panels, x), min_time=1.0)
        x16 = {k: v.bfloat16() for k, v in x.items()}
        t_bf16 = timeit(lambda x=x16: one_pass(ops.panel_linear, bf16_panels, x), min_time=1.0)
        rows.append({"rows": m, "F.linear ms": t_torch * 1e3, "panel_linear ms": t_panel * 1e3,
                     "speedup": t_torch / t_panel,
                     "panel_linear GB/s": nbytes / t_panel / 1e9,
                     "vs copy": nbytes / t_panel / copy,
                     "bf16 panel_linear ms": t_bf16 * 1e3, "bf16 / float32 time": t_bf16 / t_panel})
        if bf16_units:
            t_pairs = timeit(lambda x=x16: one_pass(ops.panel_linear, pairs, x), min_time=1.0)
            t_onednn = timeit(lambda x=x16: one_pass(onednn_linear, onednn, x), min_time=1.0)
            rows[-1] |= {"bf16 pair panels ms": t_pairs * 1e3, "bf16 oneDNN ms": t_onednn * 1e3,
                         "pairs / oneDNN time": t_pairs / t_onednn}
    write("panel_linear", rows, list(rows[0]))


if __name__ == "__main__":
    main()
