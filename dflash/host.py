"""What this host is: the CPU model and the instruction-set flags that decide how fast each dtype
decodes (bf16 matrix units or not), as recorded next to every benchmark figure and in the key of
the engine's calibration cache."""

from __future__ import annotations

import os
import platform
from functools import cache

import torch

# the flags that change which GEMM path is fast: AMX tiles, AVX-512 bf16 dot products, the vector
# widths of the CPU kernels
FLAGS = ("amx_bf16", "amx_tile", "avx512_bf16", "avx512f", "avx2")


@cache
def _cpuinfo() -> tuple[str, str, frozenset[str]]:
    """(model name, 'family F model M', flags) of the first processor. VMs often hide the model
    name's generation ('AMD EPYC'); the family and model numbers still tell them apart."""
    model, fields, flags = platform.processor() or platform.machine(), {}, frozenset()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name":
                    model = value.strip()
                elif key in ("cpu family", "model"):
                    fields[key] = value.strip()
                elif key == "flags":
                    flags = frozenset(value.split())
                if key == "" and flags:   # the first processor's block is enough
                    break
    except OSError:
        pass
    family = f"family {fields['cpu family']} model {fields['model']}" \
        if len(fields) == 2 else ""
    return model, family, flags


# oneDNN ISA limits (ONEDNN_MAX_CPU_ISA) that still admit AMX, and those that still admit the
# AVX512-BF16 dot products
AMX_ISA_LIMITS = ("", "ALL", "DEFAULT", "AVX512_CORE_AMX", "AVX512_CORE_AMX_FP16")
BF16_DOT_ISA_LIMITS = (*AMX_ISA_LIMITS, "AVX512_CORE_BF16", "AVX512_CORE_FP16")


def bf16_gemm() -> str:
    """How the engine multiplies bf16 weights on this CPU (`layers.pack_linear_weight`), from its
    flags as ONEDNN_MAX_CPU_ISA leaves them:
    * "onednn": AMX tiles; oneDNN's blocked GEMM makes a 16-row pass cost about a 1-row one;
    * "pairs": AVX512-BF16 without AMX; panel_linear's pair panels through the bf16 dot-product
      instruction (as fast as oneDNN there from 8 rows on, faster below, and row-invariant);
    * "panels": neither; panel_linear's column panels, float32 math on weights widened as they
      load (oneDNN would emulate bf16 products, slower than float32)."""
    *_, flags = _cpuinfo()
    limit = os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper()
    if "amx_bf16" in flags and limit in AMX_ISA_LIMITS:
        return "onednn"
    if "avx512_bf16" in flags and limit in BF16_DOT_ISA_LIMITS:
        return "pairs"
    return "panels"


def describe() -> dict:
    """The CPU model and its family / model numbers, its FLAGS (True / False), oneDNN's runtime
    ISA limit (ONEDNN_MAX_CPU_ISA, which hides AMX / AVX512-BF16 from oneDNN and from dflash's
    own matrix path), the threads torch uses and torch's version."""
    model, family, flags = _cpuinfo()
    return {"cpu": model, "cpu_family": family, **{flag: flag in flags for flag in FLAGS},
            "onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA", ""),
            "threads": torch.get_num_threads(), "torch": torch.__version__}


def summary(info: dict | None = None) -> str:
    """One line naming the CPU and its flags, e.g. 'AMD EPYC family 25 model 17 (avx512_bf16
    avx512f avx2; no amx_bf16, amx_tile), 2 threads'."""
    info = info or describe()
    have = [f for f in FLAGS if info[f]]
    lacks = [f for f in FLAGS if not info[f]]
    limit = f", ONEDNN_MAX_CPU_ISA={info['onednn_max_cpu_isa']}" \
        if info["onednn_max_cpu_isa"] else ""
    cpu = " ".join(filter(None, (info["cpu"], info["cpu_family"])))
    return (f"{cpu} ({' '.join(have) or 'none of ' + ' '.join(FLAGS)}"
            f"{'; no ' + ', '.join(lacks) if have and lacks else ''}){limit}, "
            f"{info['threads']} threads")
