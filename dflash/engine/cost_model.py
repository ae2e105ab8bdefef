"""What a decode step costs on this host, measured at engine start and cached.

A step's time is modelled as target(rows) + draft(drafting sequences): `target` is one verify pass
over `rows` query tokens in total (every sequence's pending token plus its verified drafts), `draft`
the block forward of the sequences that draft this step (0 when none does). Both are timed on a
small grid with the engine's own worker and caches (`Worker.measure_costs`) and interpolated
linearly between grid points (extrapolated from the last two beyond the grid: GEMMs are linear in
rows once they are compute bound).

The measurements are cached as JSON under `dflash.assets.cache_dir() / "calibration"`, keyed by
the host (CPU model, flags, ONEDNN_MAX_CPU_ISA, threads, torch), the checkpoints (paths, sizes,
modification times), the dtype and the shapes that matter; `recalibrate=True` measures again. A
cache file that cannot be read is ignored with a warning.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

from .. import assets, host

CONTEXT = 128          # cached tokens per sequence while timing (a short conversation)
MAX_MEASURED_ROWS = 256  # beyond this the verify cost is extrapolated (it is compute bound)
REPEATS = 5
CACHE_DIR = None         # None: assets.cache_dir() / "calibration"


@dataclass
class CostModel:
    """Seconds per step component: target_s {rows: s} for one verify pass, draft_s {drafting
    sequences: s} for one draft step (empty without a draft), for an engine of `block_size`."""

    target_s: dict[int, float]
    draft_s: dict[int, float]
    block_size: int = 1

    def target(self, rows: int) -> float:
        return _interpolate(self.target_s, rows)

    def draft(self, sequences: int) -> float:
        return 0.0 if sequences == 0 or not self.draft_s else \
            _interpolate(self.draft_s, sequences)

    def to_json(self) -> dict:
        return {"target_ms": {str(k): round(v * 1e3, 4) for k, v in self.target_s.items()},
                "draft_ms": {str(k): round(v * 1e3, 4) for k, v in self.draft_s.items()},
                "block_size": self.block_size}

    @classmethod
    def from_json(cls, data: dict) -> CostModel:
        parse = lambda d: {int(k): float(v) / 1e3 for k, v in d.items()}  # noqa: E731
        model = cls(parse(data["target_ms"]), parse(data["draft_ms"]), int(data["block_size"]))
        if not model.target_s or any(v <= 0 for v in (*model.target_s.values(),
                                                      *model.draft_s.values())):
            raise ValueError("a cost model needs positive timings")
        return model

    def table(self) -> str:
        """The measurements as a small text table (what `dflash bench` prints)."""
        lines = ["verify rows: " + "  ".join(f"{k}:{v * 1e3:.1f}ms"
                                             for k, v in sorted(self.target_s.items()))]
        if self.draft_s:
            lines.append("draft seqs:  " + "  ".join(f"{k}:{v * 1e3:.1f}ms"
                                                     for k, v in sorted(self.draft_s.items())))
        return "\n".join(lines)


def _interpolate(points: dict[int, float], x: int) -> float:
    xs = sorted(points)
    if len(xs) == 1:
        return points[xs[0]] * max(x, 1) / xs[0]
    i = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
    x0, x1 = xs[i - 1], xs[i]
    y0, y1 = points[x0], points[x1]
    return max(y0 + (y1 - y0) * (x - x0) / (x1 - x0), 0.0)


def powers_of_two_to(limit: int) -> list[int]:
    """1, 2, 4, ... below `limit`, then `limit` itself."""
    grid, x = [], 1
    while x < limit:
        grid.append(x)
        x *= 2
    return grid + [limit]


def calibrate(worker, allocator, max_num_seqs: int, block_size: int, max_model_len: int
              ) -> CostModel:
    """Time the worker's verify pass up to max_num_seqs * block_size rows and its draft step up
    to max_num_seqs sequences, in cache blocks borrowed from `allocator` (returned after)."""
    capacity = allocator.num_blocks * allocator.block_size
    context = max(min(CONTEXT, max_model_len - block_size, capacity - block_size), 1)
    tables: list[list[int]] = []
    try:
        while len(tables) < max_num_seqs:
            table: list[int] = []
            if not allocator.grow(table, context + block_size):
                break
            tables.append(table)
        if not tables:
            raise ValueError("the cache cannot hold one sequence to calibrate with")
        rows = min(len(tables) * block_size, MAX_MEASURED_ROWS)
        target_s, draft_s = worker.measure_costs(tables, context, powers_of_two_to(rows),
                                                 powers_of_two_to(len(tables)), REPEATS)
    finally:
        for table in tables:
            allocator.free(table)
    return CostModel(target_s, draft_s, block_size)


# ------------------------------------------------------------------------------------ cache
def cache_key(target, draft, dtype: str, **shape) -> dict:
    """What a measurement depends on: host, checkpoints (by path, size and mtime), dtype, shapes."""
    from .. import __version__  # the package is fully imported by the time an engine starts

    return {"host": host.describe(), "dflash": __version__, "dtype": dtype,
            "target": _identity(target), "draft": None if draft is None else _identity(draft),
            **shape}


def _identity(path) -> dict:
    path = Path(path).resolve()
    files = sorted(path.rglob("*")) if path.is_dir() else [path]
    stats = [(f.name, f.stat().st_size, int(f.stat().st_mtime)) for f in files if f.is_file()]
    return {"path": str(path), "files": hashlib.sha1(repr(stats).encode()).hexdigest()}


def _path(key: dict) -> Path:
    digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return Path(CACHE_DIR or assets.cache_dir() / "calibration") / f"{digest}.json"


def load(key: dict) -> CostModel | None:
    """The cached cost model for `key`, or None (a missing, unreadable or mismatching file)."""
    path = _path(key)
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
        if data["key"] != json.loads(json.dumps(key)):
            raise ValueError("its key does not match")
        return CostModel.from_json(data["cost_model"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        warnings.warn(f"ignoring the calibration cache file {path} ({e}); measuring again",
                      stacklevel=2)
        return None


def save(key: dict, model: CostModel) -> None:
    path = _path(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.part")
    partial.write_text(json.dumps({"key": key, "cost_model": model.to_json()}, indent=1))
    partial.replace(path)   # never leave a half-written file for the next start to read
