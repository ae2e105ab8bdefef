"""What a decode step costs on this host, measured at engine start and cached.

A step over n sequences that verifies `rows` query tokens in all (every sequence's pending token
plus its verified drafts) and drafts for d of them is modelled as

    decode(n) + [target(rows) - target(n)] + draft(d, k)

`decode` is one pass with one row per sequence (the step with speculation off), `target` one
verify pass with the rows packed B to a sequence (what verifying drafts adds is priced by its
slope), `draft` the forward over the drafting sequences' blocks of k + 1 rows (the pending
token and k masks; a lone drafting sequence's whole block) plus the draft's lm_head over the k
mask rows (k the longest verify of the
step; 0 when none drafts). The draft is timed at k = 1 and k = B-1 and priced linearly in k
between. They are timed on small grids with the engine's own worker and caches
(`Worker.measure_costs`), all points in turn (`fastest_each`); points that look preempted (slower
than a larger point) are timed again, and values in between are interpolated linearly
(extrapolated from the last two beyond the grid: GEMMs are linear in rows once they are compute
bound).

The measurements are cached as JSON under `dflash.assets.cache_dir() / "calibration"`, keyed by
the host (CPU model, family and model numbers, flags, ONEDNN_MAX_CPU_ISA, threads, torch), the
CPU kernels' build, the checkpoints (paths, sizes, modification times), the dtype and the shapes
that matter; `recalibrate=True` measures again. A cache file that cannot be read is ignored with
a warning, and one that cannot be written is a warning too.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .. import assets, host
from ..ops import registry

CONTEXT = 128          # cached tokens per sequence while timing (a short conversation)
MAX_MEASURED_ROWS = 256  # beyond this the verify cost is extrapolated (it is compute bound)
REPEATS = 5
SUSPECT = 1.25           # a point this much slower than a larger one is timed again ...
RETRIES = 2              # ... at most this many times (the fastest time is kept)
FORMAT = 9               # of the cache files: files of another format are not read


@dataclass
class CostModel:
    """Seconds per step component for an engine of `block_size`: target_s {rows: s} for one
    verify pass (rows packed B to a sequence), draft_s {drafting sequences: s} for one draft
    step making B-1 drafts a sequence (empty without a draft), draft_one_s the same making one
    draft a sequence (empty: priced as draft_s), decode_s {sequences: s} for one pass of one
    row per sequence (empty: target_s, which is that layout when block_size is 1). Counts may
    be numpy arrays (the chooser prices every choice at once)."""

    target_s: dict[int, float]
    draft_s: dict[int, float]
    block_size: int = 1
    decode_s: dict[int, float] = field(default_factory=dict)
    draft_one_s: dict[int, float] = field(default_factory=dict)

    def target(self, rows):
        return self._interpolate("target_s", rows)

    def decode(self, sequences):
        return self._interpolate("decode_s" if self.decode_s else "target_s", sequences)

    def extra(self, sequences, rows):
        """What verifying `rows` rows over `sequences` sequences costs beyond decoding them."""
        return np.maximum(self.target(rows) - self.target(sequences), 0.0)

    def draft(self, sequences, drafts=None):
        """One draft step of `sequences` sequences making `drafts` drafts each (default B-1):
        blocks of drafts + 1 rows (one sequence: the whole block), drafts of them through the
        lm_head."""
        if not self.draft_s:
            return np.zeros(np.shape(sequences))
        cost = self._interpolate("draft_s", sequences)
        if drafts is not None and self.draft_one_s and self.block_size > 2:
            one = self._interpolate("draft_one_s", sequences)
            cost = one + (cost - one) * (np.maximum(drafts, 1) - 1) / (self.block_size - 2)
        return np.where(np.asarray(sequences) == 0, 0.0, cost)

    def __post_init__(self):
        # the chooser prices every step: the points as arrays once (read at construction)
        self._curves = {name: (np.array(sorted(points), dtype=np.float64),
                               np.array([points[k] for k in sorted(points)]))
                        for name in ("target_s", "draft_s", "decode_s", "draft_one_s")
                        if (points := getattr(self, name))}

        self._step_tables: dict[tuple[int, int], tuple] = {}

    def _interpolate(self, name: str, x):
        return _interpolate(*self._curves[name], x)

    def step_tables(self, sequences: int, positions: int) -> tuple[float, np.ndarray, np.ndarray]:
        """What the chooser and the time fit read every step, priced once per batch size:
        decode(n), extra(n, rows) for rows n .. n * (positions + 1) (index rows - n), and
        draft(d, longest) for d 0..n and longest 0..positions ([n + 1, positions + 1])."""
        key = (sequences, positions)
        if key not in self._step_tables:
            n, rows = sequences, np.arange(sequences, sequences * (positions + 1) + 1)
            draft = self.draft(np.arange(n + 1)[:, None], np.arange(positions + 1)[None, :])
            self._step_tables[key] = (
                float(self.decode(n)), np.asarray(self.extra(n, rows), dtype=np.float64),
                np.broadcast_to(np.asarray(draft, dtype=np.float64), (n + 1, positions + 1)))
        return self._step_tables[key]

    def step(self, sequences: int, rows: int, drafting: int, drafts: int | None = None
             ) -> float:
        """One decode step: `sequences` sequences, `rows` verified rows, `drafting` of them
        drafting, the longest verifying `drafts` drafts."""
        return float(self.decode(sequences) + self.extra(sequences, rows) +
                     self.draft(drafting, drafts))

    def to_json(self) -> dict:
        ms = lambda d: {str(k): round(v * 1e3, 4) for k, v in d.items()}  # noqa: E731
        return {"target_ms": ms(self.target_s), "draft_ms": ms(self.draft_s),
                "decode_ms": ms(self.decode_s), "draft_one_ms": ms(self.draft_one_s),
                "block_size": self.block_size}

    @classmethod
    def from_json(cls, data: dict) -> CostModel:
        parse = lambda d: {int(k): float(v) / 1e3 for k, v in d.items()}  # noqa: E731
        model = cls(parse(data["target_ms"]), parse(data["draft_ms"]), int(data["block_size"]),
                    parse(data["decode_ms"]), parse(data["draft_one_ms"]))
        if not model.target_s or any(v <= 0 for points in (model.target_s, model.draft_s,
                                                           model.decode_s, model.draft_one_s)
                                     for v in points.values()):
            raise ValueError("a cost model needs positive timings")
        return model

    def table(self) -> str:
        """The measurements as a small text table (what `dflash bench` prints)."""
        rows = [("verify rows:", self.target_s), ("decode seqs:", self.decode_s),
                ("draft seqs: ", self.draft_s), ("1 draft each:", self.draft_one_s)]
        return "\n".join(f"{title} " + "  ".join(f"{k}:{v * 1e3:.1f}ms" for k, v in
                                                 sorted(points.items()))
                         for title, points in rows if points)


def _interpolate(xs: np.ndarray, ys: np.ndarray, x):
    """Piecewise linear through the points (xs ascending), extended linearly beyond both ends;
    never below 0."""
    if len(xs) == 1:
        return ys[0] * np.maximum(x, 1) / xs[0]
    i = np.clip(np.searchsorted(xs, x), 1, len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return np.maximum(y0 + (y1 - y0) * (x - x0) / (x1 - x0), 0.0)


def fastest_seconds(fn, repeats: int) -> float:
    """The fastest of `repeats` timed runs of fn() after a warm-up: what the work costs when
    nothing else interrupts it (a median still carries the preemptions of a busy machine)."""
    return fastest_each({0: fn}, repeats)[0]


def fastest_each(fns: dict, repeats: int) -> dict:
    """fastest_seconds of every fn in `fns` ({key: fn} -> {key: seconds}), timed in turn: round r
    runs each fn once, so every fn is timed across the same stretch of time and a phase in which
    the machine runs slower (another tenant, a frequency change) weighs on all of them alike
    instead of on the points measured during it."""
    for fn in fns.values():
        fn()   # warm-up: first-call allocations, kernel selection
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(repeats):
        for key, fn in fns.items():
            start = time.perf_counter()
            fn()
            best[key] = min(best[key], time.perf_counter() - start)
    return best


def timing_grid(limit: int, every_below: int = 1) -> list[int]:
    """The counts timed up to `limit`: 1, 2, 3, ... up to `every_below`, then powers of two,
    below `limit`; then `limit`."""
    grid = list(range(1, min(every_below, limit - 1) + 1))
    x = 1
    while x < limit:
        if x > every_below:
            grid.append(x)
        x *= 2
    return grid + [limit]


def calibrate(worker, allocator, max_num_seqs: int, block_size: int, max_model_len: int
              ) -> CostModel:
    """Time the worker's verify pass up to max_num_seqs * block_size rows and its decode and
    draft steps (B-1 drafts and 1 draft a sequence) up to max_num_seqs sequences, in cache
    blocks borrowed from `allocator` (returned after)."""
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
        # every row count of one block: a kernel's cost steps where a row tile fills (the
        # bundled target in bf16 on a Zen 4 host: flat from 4 to 6 rows, then 1.4 ms more at 7,
        # more than half of what 1 to 6 rows add), and a lone sequence's tree is priced there
        # row by row
        rows = timing_grid(min(len(tables) * block_size, MAX_MEASURED_ROWS), block_size)
        seqs = timing_grid(len(tables))
        measured = worker.measure_costs(tables, context, rows, seqs, REPEATS)
        for _ in range(RETRIES):   # a preempted point would mislead every step's choice
            suspects = [_suspects(points) for points in measured]
            if not any(suspects):
                break
            again = worker.measure_costs(tables, context, suspects[0],
                                         sorted(set().union(*suspects[1:])), REPEATS)
            for points, new in zip(measured, again):
                for x, seconds in new.items():
                    points[x] = min(points[x], seconds)
    finally:
        for table in tables:
            allocator.free(table)
    target_s, draft_s, decode_s, draft_one_s = measured
    return CostModel(target_s, draft_s, block_size, decode_s, draft_one_s)


def _suspects(points: dict[int, float]) -> list[int]:
    """Grid points measured more than SUSPECT times slower than some larger point."""
    xs = sorted(points)
    return [x for i, x in enumerate(xs)
            if any(points[x] > SUSPECT * points[y] for y in xs[i + 1:])]


# ------------------------------------------------------------------------------------ cache
def cache_key(target, draft, dtype: str, **shape) -> dict:
    """What a measurement depends on: host, the CPU kernels' build (ATEN_CPU_CAPABILITY may pick
    a lower one), checkpoints (by path, size and mtime), dtype, shapes."""
    from .. import __version__  # the package is fully imported by the time an engine starts

    return {"format": FORMAT, "host": host.describe(), "kernels": registry.CPU_CAPABILITY,
            "dflash": __version__, "dtype": dtype,
            "target": _identity(target), "draft": None if draft is None else _identity(draft),
            **shape}


def _identity(path) -> dict:
    path = Path(path).resolve()
    files = sorted(path.rglob("*")) if path.is_dir() else [path]
    stats = [(f.name, f.stat().st_size, int(f.stat().st_mtime)) for f in files if f.is_file()]
    return {"path": str(path), "files": hashlib.sha1(repr(stats).encode()).hexdigest()}


def _path(key: dict) -> Path:
    digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / f"{digest}.json"


def cache_dir() -> Path:
    """Where measured cost models are kept: $DFLASH_CALIBRATION_DIR, else the calibration
    folder of dflash's cache (assets.cache_dir())."""
    return Path(os.environ.get("DFLASH_CALIBRATION_DIR") or assets.cache_dir() / "calibration")


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
    """Cache `model` for the next start; a cache that cannot be written (a read-only home) is a
    warning, as the measurements only save that start the time of taking them again."""
    path = _path(key)
    partial = path.with_suffix(f".{os.getpid()}.part")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial.write_text(json.dumps({"key": key, "cost_model": model.to_json()}, indent=1))
        partial.replace(path)   # never leave a half-written file for the next start to read
    except OSError as e:
        warnings.warn(f"cannot cache the calibration at {path} ({e}): the next start measures "
                      f"again (DFLASH_CALIBRATION_DIR sets another directory)", stacklevel=2)
