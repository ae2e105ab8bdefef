"""Build flags: the NPU build stops early with a clear message when CANN / torch_npu are missing;
the CPU kernels build for the machine's architecture (x86-64 capabilities only on x86-64), and
compile for aarch64 with a cross compiler."""

import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _setup(*args, **env):
    environ = {k: v for k, v in os.environ.items()
               if k not in ("ASCEND_HOME_PATH", "SOC_VERSION", "DFLASH_DEVICE")}
    environ.update(env)
    return subprocess.run([sys.executable, "setup.py", *args], cwd=ROOT, env=environ,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("args, env", [
    (("build", "--device", "npu"), {}),
    (("build", "--device=npu"), {}),
    (("build",), {"DFLASH_DEVICE": "npu"}),
])
def test_npu_build_without_cann_names_what_is_missing(args, env):
    result = _setup(*args, **env)
    assert result.returncode != 0
    for missing in ("ASCEND_HOME_PATH", "SOC_VERSION", "torch_npu"):
        assert missing in result.stderr
    assert "build/" not in result.stdout   # stopped before compiling anything


def test_npu_build_names_a_bad_soc_or_path(tmp_path):
    result = _setup("build", "--device", "npu", ASCEND_HOME_PATH=str(tmp_path / "nope"),
                    SOC_VERSION="ascend910b1")
    assert result.returncode != 0
    assert "is not a directory" in result.stderr and "SOC_VERSION is not set" not in result.stderr


def test_unknown_device_is_rejected():
    result = _setup("build", "--device", "gpu")
    assert result.returncode != 0 and "unknown --device 'gpu'" in result.stderr


def _setup_module():
    spec = importlib.util.spec_from_file_location("dflash_setup", ROOT / "setup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)   # setup() itself runs only under __main__
    return module


def test_cpu_capabilities_follow_the_machine(monkeypatch):
    setup = _setup_module()
    monkeypatch.delenv("DFLASH_CPU_CAPABILITIES", raising=False)
    assert setup.capabilities("x86_64") == ["AVX512", "AVX2", "DEFAULT"]
    assert setup.capabilities("aarch64") == setup.capabilities("arm64") == ["DEFAULT"]
    monkeypatch.setenv("DFLASH_CPU_CAPABILITIES", "avx512")
    assert setup.capabilities("x86_64") == ["AVX512"]
    with pytest.raises(SystemExit, match="cannot be built on aarch64"):
        setup.capabilities("aarch64")


CROSS = shutil.which("aarch64-linux-gnu-g++")


def _cross_compile(setup, source: str, cap: str, out: Path):
    from torch.utils.cpp_extension import include_paths

    includes = [f"-I{p}" for p in [ROOT / "csrc", *include_paths(),
                                   sysconfig.get_paths()["include"]]]
    return subprocess.run([CROSS, "-std=c++17", "-c", *setup.kernel_compile_args(cap),
                           *includes, str(ROOT / source), "-o", str(out)],
                          capture_output=True, text=True, timeout=600)


@pytest.mark.skipif(CROSS is None, reason="no aarch64 cross compiler "
                                          "(apt-get install g++-aarch64-linux-gnu)")
def test_cpu_kernels_compile_for_aarch64(tmp_path):
    """What `pip install` compiles on an aarch64 (Kunpeng) host, compiled by GCC for aarch64
    against torch's headers; the x86 capabilities' flags fail there (the negative control)."""
    setup = _setup_module()
    sources = [*setup.C_SOURCES, *sorted(
        p.relative_to(ROOT).as_posix() for p in (ROOT / "csrc" / "cpu").glob("*.cpp"))]
    for cap in setup.capabilities("aarch64"):
        for source in sources:
            result = _cross_compile(setup, source, cap, tmp_path / f"{cap}.o")
            assert result.returncode == 0, (source, cap, result.stderr[-3000:])
    result = _cross_compile(setup, "csrc/cpu/layer_ops.cpp", "AVX512", tmp_path / "x.o")
    assert result.returncode != 0 and "avx512" in result.stderr.lower()


@pytest.mark.skipif(CROSS is None, reason="no aarch64 cross compiler "
                                          "(apt-get install g++-aarch64-linux-gnu)")
@pytest.mark.parametrize("source", ["ascend_kernels/emu/launchers.cpp",
                                    "ascend_kernels/paged_attention.cpp"])
def test_ascend_emulator_compiles_for_aarch64(source):
    """tests/ascend_emu.py on an Ascend host's own (Kunpeng) CPU: there torch's headers include
    <arm_neon.h>, whose global `bfloat16_t` typedef the emulator's own must not clash with."""
    from torch.utils.cpp_extension import include_paths

    includes = [f"-I{p}" for p in [ROOT / "ascend_kernels" / "emu", ROOT / "ascend_kernels",
                                   ROOT / "csrc", *include_paths(),
                                   sysconfig.get_paths()["include"]]]
    result = subprocess.run([CROSS, "-std=c++17", "-fsyntax-only", "-ffp-contract=off",
                             *includes, str(ROOT / source)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
