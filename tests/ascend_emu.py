"""Test-only build of the Ascend C kernels for x86, against the emulation in ascend_kernels/emu.

`ops()` compiles ascend_kernels/*.cpp (the same sources the NPU build compiles with CANN), the
emulated launchers and the rule snippets into one library, loads it and returns
`torch.ops.dflash_emu`. The build is cached in build/ascend_emu and only recompiles what changed.
Nothing here is part of the dflash package.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import torch

import dflash.models.target
import dflash.ops
from dflash.ops import checks, reference

ROOT = Path(__file__).resolve().parents[1]
KERNELS = ROOT / "ascend_kernels"
SOURCES = [
    KERNELS / "emu" / "launchers.cpp",
    KERNELS / "rejection_sample.cpp",
    KERNELS / "context_kv.cpp",
    KERNELS / "paged_attention.cpp",
    ROOT / "tests" / "ascend_emu_snippets.cpp",
]
INCLUDES = [KERNELS / "emu", KERNELS, ROOT / "csrc"]


def _headers_digest() -> str:
    """torch's JIT cache keys on the .cpp sources only; fold the headers into the flags too."""
    digest = hashlib.sha256()
    for header in sorted([*KERNELS.rglob("*.h"), *(ROOT / "csrc").rglob("*.h")]):
        digest.update(header.read_bytes())
    return digest.hexdigest()[:16]


@functools.cache
def ops():
    from torch.utils.cpp_extension import load

    build = ROOT / "build" / "ascend_emu"
    build.mkdir(parents=True, exist_ok=True)
    load(
        name="dflash_ascend_emu",
        sources=[str(s) for s in SOURCES],
        extra_include_paths=[str(i) for i in INCLUDES],
        # C++17: what the Ascend C compiler accepts, so kernels cannot drift past it.
        # -ffp-contract=off: no fused multiply-adds; every vector op rounds like the reference.
        extra_cflags=["-O1", "-std=c++17", "-ffp-contract=off",
                      f"-DDFLASH_EMU_HEADERS={_headers_digest()}"],
        build_directory=str(build),
        is_python_module=False,
        verbose=False,
    )
    return torch.ops.dflash_emu


def _op_by_op(layer):
    layer.fused = None


class Emulated:
    """The ops as an NPU build serves them: the three fused ops by the emulated Ascend launchers,
    qkv_rope_cache by the PyTorch reference (it has no NPU kernel). `transfers()` counts the
    launchers' device-to-host copies and the reference's slot checks (one copy each on a
    device)."""

    def __init__(self, emu, monkeypatch):
        self.emu, self.slot_checks = emu, 0
        for name in ("context_kv", "rejection_sample"):
            monkeypatch.setattr(dflash.ops, name, getattr(emu, name))

        def paged_attention(*args, out=None, **kwargs):   # dflash.ops' `out` argument
            if out is None:
                return emu.paged_attention(*args, **kwargs)
            emu.paged_attention.out(*args, **kwargs, out=out)
            return out
        monkeypatch.setattr(dflash.ops, "paged_attention", paged_attention)
        monkeypatch.setattr(dflash.ops, "qkv_rope_cache", reference.qkv_rope_cache)
        # an NPU runs the target's layers op by op (DecoderLayer.fuse takes CPU weights only);
        # the emulation's tensors are on CPU, so keep the layers from taking the one call
        monkeypatch.setattr(dflash.models.target.DecoderLayer, "fuse", _op_by_op)
        check = checks.slot_mapping_values

        def counted(*args):
            self.slot_checks += 1
            return check(*args)
        monkeypatch.setattr(checks, "slot_mapping_values", counted)

    def transfers(self):
        return self.emu.transfers() + self.slot_checks
