"""`EngineArgs`: what an engine is built from (the arguments of `dflash.LLM`), checked."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

from ..models.layers import QUANTIZATIONS

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class EngineArgs:
    """The engine's configuration; `dflash.LLM` documents each field."""

    target: object
    draft: object = None
    dtype: str | torch.dtype = "auto"
    device: str = "cpu"
    max_num_seqs: int = 8
    block_size: int | None = None
    kv_block_size: int = 16
    max_model_len: int | None = None
    num_kv_blocks: int | None = None
    draft_sampling: str = "greedy"
    cp_size: int = 1
    tokenizer: object = None
    tp_size: int = 1
    tp_timeout: float = 300.0
    speculation: str = "adaptive"
    recalibrate: bool = False
    quantization: str | None = None
    draft_quantization: str | None = None

    def __post_init__(self):
        if self.cp_size != 1:
            raise ValueError(f"context parallelism (cp_size={self.cp_size}) is not supported; "
                             "use cp_size=1")
        for name, least in (("tp_size", 1), ("max_num_seqs", 1), ("kv_block_size", 1)):
            _check_count(name, getattr(self, name), least)
        # a timedelta: 0 or less failed the ranks' first connection, None or inf raised no
        # error naming it
        if not isinstance(self.tp_timeout, numbers.Real) or isinstance(self.tp_timeout, bool) \
                or not 0 < self.tp_timeout < math.inf:
            raise ValueError(f"tp_timeout must be a positive finite number of seconds, "
                             f"got {self.tp_timeout!r}")
        # max_model_len: at least a prompt token and an output token
        for name, least in (("block_size", 1), ("max_model_len", 2), ("num_kv_blocks", 1)):
            if getattr(self, name) is not None:
                _check_count(name, getattr(self, name), least, "None or ")
        if self.speculation not in ("adaptive", "chain", "fixed"):
            raise ValueError(f"speculation must be 'adaptive', 'chain' or 'fixed', "
                             f"got {self.speculation!r}")
        for name in ("quantization", "draft_quantization"):
            if getattr(self, name) not in (None, *QUANTIZATIONS):
                raise ValueError(f"{name} must be None or one of {list(QUANTIZATIONS)}, "
                                 f"got {getattr(self, name)!r}")
        if self.dtype != "auto":
            dtype = DTYPES.get(self.dtype, self.dtype) if isinstance(self.dtype, str) \
                else self.dtype
            if dtype not in DTYPES.values():
                raise ValueError(f"dtype must be 'auto' or one of {list(DTYPES)}, "
                                 f"got {self.dtype!r}")
            self.dtype = dtype

    @property
    def served_len(self) -> int:
        """The length RoPE tables and TP ranks are built for (the default max_model_len)."""
        return 4096 if self.max_model_len is None else self.max_model_len


def _check_count(name: str, value, least: int, alternative: str = "") -> None:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < least:
        raise ValueError(f"{name} must be {alternative}an integer >= {least}, got {value!r}")


def dtype_name(dtype: torch.dtype) -> str:
    return next(name for name, d in DTYPES.items() if d == dtype)
