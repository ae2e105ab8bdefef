"""Build dflash: the CPU extension always; the Ascend NPU kernels with `--device npu`.

    pip install --no-build-isolation -e .              # CPU (default)
    python setup.py build --device npu                  # also the Ascend C kernels (needs CANN)
    DFLASH_DEVICE=npu pip install --no-build-isolation .

CPU kernels (csrc/cpu/*.cpp) are compiled once per CPU capability so one wheel runs everywhere and
uses AVX-512 where the host has it; dflash picks the best library at import time.
`DFLASH_CPU_CAPABILITIES=AVX512` (comma list) limits the set to speed up development builds.
"""

import glob
import os
import sys
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).parent.resolve()
GENERATED = ROOT / "build" / "generated"

# Flags per ATen CPU capability; CPU_CAPABILITY_* selects the at::vec implementation.
CAPABILITY_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
    "DEFAULT": [],
}


def take_device_arg() -> str:
    """`--device X` or `--device=X` (removed from argv), else $DFLASH_DEVICE, else cpu."""
    device = os.environ.get("DFLASH_DEVICE", "cpu")
    argv = sys.argv
    for i, arg in enumerate(list(argv)):
        if arg == "--device" and i + 1 < len(argv):
            device = argv[i + 1]
            del argv[i : i + 2]
            break
        if arg.startswith("--device="):
            device = arg.split("=", 1)[1]
            del argv[i]
            break
    if device not in ("cpu", "npu"):
        sys.exit(f"dflash: unknown --device {device!r}; choose cpu or npu")
    return device


def missing_npu_prerequisites() -> list[str]:
    missing = []
    home = os.environ.get("ASCEND_HOME_PATH")
    if not home:
        missing.append("ASCEND_HOME_PATH is not set (source <CANN>/set_env.sh)")
    elif not Path(home).is_dir():
        missing.append(f"ASCEND_HOME_PATH={home} is not a directory")
    if not os.environ.get("SOC_VERSION"):
        missing.append("SOC_VERSION is not set (e.g. SOC_VERSION=ascend910b1)")
    import importlib.util

    if importlib.util.find_spec("torch_npu") is None:
        missing.append("torch_npu is not installed (pip install torch-npu matching your torch)")
    return missing


def check_npu_build() -> None:
    missing = missing_npu_prerequisites()
    if missing:
        sys.exit("dflash: the NPU build (--device npu) needs the Ascend CANN toolkit "
                 "and torch_npu.\n"
                 "Missing:\n  - " + "\n  - ".join(missing) +
                 "\nThe CPU build needs none of these: drop --device npu / DFLASH_DEVICE=npu.")
    sys.exit("dflash: the Ascend C kernel build (ascend_kernels/ via cmake/) is not part of this "
             "version yet; only the CPU build is available.")


def capabilities() -> list[str]:
    wanted = os.environ.get("DFLASH_CPU_CAPABILITIES")
    if not wanted:
        return list(CAPABILITY_FLAGS)
    caps = [c.strip().upper() for c in wanted.split(",") if c.strip()]
    unknown = [c for c in caps if c not in CAPABILITY_FLAGS]
    if unknown:
        sys.exit(f"dflash: unknown DFLASH_CPU_CAPABILITIES {unknown}; "
                 f"known: {list(CAPABILITY_FLAGS)}")
    return caps


def capability_sources(cap: str, kernels: list[str]) -> list[str]:
    """One generated wrapper per (capability, kernel) so each compiles to its own object file."""
    out = GENERATED / cap.lower()
    out.mkdir(parents=True, exist_ok=True)
    sources = []
    for kernel in kernels:
        wrapper = out / Path(kernel).name
        text = f'#include "{ROOT / kernel}"\n'
        if not wrapper.exists() or wrapper.read_text() != text:
            wrapper.write_text(text)
        sources.append(os.path.relpath(wrapper, ROOT))
    return sources


def extensions():
    from torch.utils.cpp_extension import CppExtension

    common = ["-O3", "-fopenmp", "-Wall", "-Wno-unused-function"]
    exts = [CppExtension("dflash._C", ["csrc/registry.cpp"], extra_compile_args=common)]
    kernels = sorted(glob.glob("csrc/cpu/*.cpp"))
    if kernels:
        for cap in capabilities():
            exts.append(CppExtension(
                f"dflash._cpu_kernels_{cap.lower()}",
                capability_sources(cap, kernels),
                include_dirs=[str(ROOT / "csrc")],
                extra_compile_args=common + CAPABILITY_FLAGS[cap]
                + [f"-DCPU_CAPABILITY={cap}", f"-DCPU_CAPABILITY_{cap}"],
                extra_link_args=["-fopenmp"],
            ))
    return exts


if __name__ == "__main__":
    if take_device_arg() == "npu":
        check_npu_build()
    from torch.utils.cpp_extension import BuildExtension

    setup(ext_modules=extensions(), cmdclass={"build_ext": BuildExtension})
