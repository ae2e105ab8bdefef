"""Build dflash: the CPU extension always; the Ascend NPU kernels with `--device npu`.

    pip install --no-build-isolation -e .                    # CPU (default)
    python setup.py build_ext --inplace --device npu          # also the Ascend C kernels (CANN)
    DFLASH_DEVICE=npu pip install --no-build-isolation .

The NPU part is a CMake project (ascend_kernels/CMakeLists.txt, modules in cmake/) built into
build/npu (DFLASH_NPU_BUILD_DIR overrides) whose library, _npu_kernels.so, lands next to the
package's other extensions. `DFLASH_NPU_DRY_RUN=1` only configures that project and stops: the CI
check of the build scripts against a stub CANN tree.

CPU kernels (csrc/cpu/*.cpp) are compiled once per CPU capability the machine's architecture has
(x86-64: AVX512, AVX2 and DEFAULT, so one wheel runs on every x86 CPU and uses AVX-512 where it
can; elsewhere, e.g. aarch64 (Kunpeng): DEFAULT, where ATen's at::vec uses NEON); dflash picks the
best library at import time. `DFLASH_CPU_CAPABILITIES=AVX512` (comma list) limits the set to
speed up development builds.
"""

import glob
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).parent.resolve()
GENERATED = ROOT / "build" / "generated"

# Flags per ATen CPU capability; CPU_CAPABILITY_* selects the at::vec implementation. The x86
# flags exist only on x86-64 compilers (GCC for aarch64 rejects -mavx512f).
CAPABILITY_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
    "DEFAULT": [],
}
X86_64 = ("x86_64", "amd64")
COMMON_FLAGS = ["-O3", "-fopenmp", "-Wall", "-Wno-unused-function"]
# dflash._C: the op schemas and the composite ops, one build for every CPU
C_SOURCES = ["csrc/registry.cpp", "csrc/decoder_layer.cpp"]


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
    if shutil.which("cmake") is None:
        missing.append("cmake is not on PATH (pip install cmake)")
    return missing


def check_npu_build() -> None:
    missing = missing_npu_prerequisites()
    if missing:
        sys.exit("dflash: the NPU build (--device npu) needs the Ascend CANN toolkit "
                 "and torch_npu.\n"
                 "Missing:\n  - " + "\n  - ".join(missing) +
                 "\nThe CPU build needs none of these: drop --device npu / DFLASH_DEVICE=npu.")


def build_npu(output_dir: Path, configure_only: bool = False) -> None:
    """Configure (and unless `configure_only`, build) ascend_kernels/ with CMake; the library
    goes to `output_dir`."""
    build_dir = Path(os.environ.get("DFLASH_NPU_BUILD_DIR", ROOT / "build" / "npu"))
    configure = ["cmake", "-S", str(ROOT / "ascend_kernels"), "-B", str(build_dir),
                 f"-DSOC_VERSION={os.environ['SOC_VERSION']}",
                 f"-DASCEND_HOME_PATH={os.environ['ASCEND_HOME_PATH']}",
                 f"-DPython3_EXECUTABLE={sys.executable}",
                 f"-DDFLASH_NPU_OUTPUT_DIR={output_dir}", "-DCMAKE_BUILD_TYPE=Release"]
    steps = [configure] if configure_only else \
        [configure, ["cmake", "--build", str(build_dir), "-j", str(os.cpu_count() or 1)]]
    for step in steps:
        if subprocess.run(step).returncode != 0:
            sys.exit(f"dflash: the NPU build failed at: {' '.join(step)}")


def capabilities(machine: str | None = None) -> list[str]:
    """The capabilities built for `machine` (default: this one), as limited by
    DFLASH_CPU_CAPABILITIES."""
    machine = (machine or platform.machine()).lower()
    available = list(CAPABILITY_FLAGS) if machine in X86_64 else ["DEFAULT"]
    wanted = os.environ.get("DFLASH_CPU_CAPABILITIES")
    if not wanted:
        return available
    caps = [c.strip().upper() for c in wanted.split(",") if c.strip()]
    unknown = [c for c in caps if c not in available]
    if unknown:
        sys.exit(f"dflash: DFLASH_CPU_CAPABILITIES {unknown} cannot be built on {machine}; "
                 f"it builds {available}")
    return caps


def kernel_compile_args(cap: str) -> list[str]:
    return COMMON_FLAGS + CAPABILITY_FLAGS[cap] + [f"-DCPU_CAPABILITY={cap}",
                                                   f"-DCPU_CAPABILITY_{cap}"]


def capability_sources(cap: str, kernels: list[str]) -> list[str]:
    """One generated wrapper per (capability, kernel) so each compiles to its own object file.

    A wrapper names its kernel relative to csrc/ (an include directory of the extension), never
    by an absolute path, so the generated sources stay valid wherever the tree is unpacked."""
    out = GENERATED / cap.lower()
    out.mkdir(parents=True, exist_ok=True)
    sources = []
    for kernel in kernels:
        wrapper = out / Path(kernel).name
        text = f'#include "{Path(kernel).relative_to("csrc").as_posix()}"\n'
        if not wrapper.exists() or wrapper.read_text() != text:
            wrapper.write_text(text)
        sources.append(os.path.relpath(wrapper, ROOT))
    return sources


def extensions():
    from torch.utils.cpp_extension import CppExtension

    exts = [CppExtension("dflash._C", C_SOURCES, extra_compile_args=COMMON_FLAGS)]
    kernels = sorted(glob.glob("csrc/cpu/*.cpp", root_dir=ROOT))
    if kernels:
        for cap in capabilities():
            exts.append(CppExtension(
                f"dflash._cpu_kernels_{cap.lower()}",
                capability_sources(cap, kernels),
                include_dirs=[str(ROOT / "csrc")],
                extra_compile_args=kernel_compile_args(cap),
                extra_link_args=["-fopenmp"],
            ))
    return exts


def build_ext_with_npu(base):
    """`base` (torch's BuildExtension), then the NPU library into the same package directory."""
    class BuildExtWithNpu(base):
        def run(self):
            super().run()
            build_npu(ROOT / "dflash" if self.inplace else Path(self.build_lib) / "dflash")

    return BuildExtWithNpu


if __name__ == "__main__":
    npu = take_device_arg() == "npu"
    if npu:
        check_npu_build()
        if os.environ.get("DFLASH_NPU_DRY_RUN"):
            build_npu(ROOT / "dflash", configure_only=True)
            sys.exit(0)
    from torch.utils.cpp_extension import BuildExtension

    build_ext = build_ext_with_npu(BuildExtension) if npu else BuildExtension
    setup(ext_modules=extensions(), cmdclass={"build_ext": build_ext})
