"""The bundled target's forward with each layer as one `decoder_layer` call against its ops
called one by one from Python, for 1, 4 and 16 new tokens over 200 cached ones, with the weights
in bf16 (the host's packed layout), int8 and int4. The two ways alternate in rounds within the
run; each figure is the median round.

    python bench/bench_decoder_layer.py [--threads N]   # from the repository root
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # this tree's dflash

import torch  # noqa: E402
from common import threads_option, write  # noqa: E402

from dflash import assets  # noqa: E402
from dflash.models import load_target  # noqa: E402
from dflash.models.layers import build_metadata  # noqa: E402

CONTEXT, BLOCK, ROUNDS, PASSES = 200, 16, 9, 30


def forward_ms(model, cache, rows: int, passes: int) -> float:
    table = list(range((CONTEXT + rows) // BLOCK + 1))
    meta = build_metadata([table], [CONTEXT], [rows], BLOCK, num_blocks=cache.shape[2])
    ids = torch.arange(rows) + 100
    start = time.perf_counter()
    with torch.inference_mode():
        for _ in range(passes):
            model(ids, meta, cache)
    return (time.perf_counter() - start) / passes * 1e3


def main() -> None:
    threads_option(__doc__)
    rows_out = []
    for weights, quantization in (("bf16", None), ("int8", "int8"), ("int4", "int4")):
        model = load_target(assets.smollm2_target(), dtype=torch.bfloat16,
                            quantization=quantization)
        model.pack_weights()
        cache = torch.zeros(model.kv_cache_shape(CONTEXT // BLOCK + 4, BLOCK),
                            dtype=torch.bfloat16)
        for rows in (1, 4, 16):
            times = {"op by op": [], "one call": []}
            for _ in range(ROUNDS):
                for way in times:
                    model.unfuse()
                    if way == "one call":
                        for layer in model.layers:
                            layer.fuse()
                    forward_ms(model, cache, rows, 3)   # warm-up
                    times[way].append(forward_ms(model, cache, rows, PASSES))
            ops_ms, call_ms = (statistics.median(t) for t in times.values())
            rows_out.append({"weights": weights, "rows": rows, "op by op ms": ops_ms,
                             "one call ms": call_ms, "time saved": 1 - call_ms / ops_ms})
    write("decoder_layer", rows_out, list(rows_out[0]))


if __name__ == "__main__":
    main()
