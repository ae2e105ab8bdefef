"""Optional dependencies: imported when a feature needs them, with an error naming the extra that
installs them (`pip install "dflash-npu[bench]"`) instead of a bare ModuleNotFoundError."""

from __future__ import annotations

import importlib
from types import ModuleType


class MissingDependency(ImportError):
    """An optional dependency of a dflash feature is not installed."""


def require(module: str, extra: str, feature: str) -> ModuleType:
    """`import module`, or raise MissingDependency saying which extra of dflash-npu provides it."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        top = module.split(".")[0]
        if e.name is not None and e.name.split(".")[0] != top:
            raise   # the package is there but one of its own imports failed: show that error
        raise MissingDependency(
            f"{feature} needs {top}, which is not installed: pip install \"dflash-npu[{extra}]\" "
            f"(or pip install {top})") from e


def pyplot(extra: str, feature: str) -> ModuleType:
    """matplotlib.pyplot with the non-interactive Agg backend (plots are written to files)."""
    matplotlib = require("matplotlib", extra, feature)
    matplotlib.use("Agg")
    return require("matplotlib.pyplot", extra, feature)
