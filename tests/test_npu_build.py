"""The `--device npu` build scripts, checked without CANN: setup.py configures the NPU CMake project
(ascend_kernels/CMakeLists.txt, cmake/) against a stub CANN tree whose ascendc.cmake records what
the project asks of it, and a stub torch_npu package (a directory, never imported by this process).
Nothing is compiled; this catches typos and wiring mistakes in the scripts. The NPU launchers
(csrc/npu) are syntax-checked against stub declarations of the CANN / torch_npu APIs they call, and
loading a built library (dflash.ops.registry) is checked with stand-ins for the library and
torch_npu.
"""

import os
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from dflash.ops import registry

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake is not installed")

STUB_ASCENDC = """
# Stub of CANN's ascendc.cmake: records the calls dflash's project makes.
foreach(var ASCEND_CANN_PACKAGE_PATH SOC_VERSION RUN_MODE)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "stub ascendc.cmake: ${var} must be set before the include")
  endif()
endforeach()
set(CMAKE_SKIP_RPATH TRUE)   # as CANN's host_config.cmake does
set(STUB_LOG "${CMAKE_BINARY_DIR}/stub_cann.txt")
file(WRITE "${STUB_LOG}" "soc=${SOC_VERSION}\\nrun_mode=${RUN_MODE}\\n")
function(ascendc_library name kind)
  file(APPEND "${STUB_LOG}" "ascendc_library=${name} ${kind}\\n")
  foreach(src IN LISTS ARGN)
    file(APPEND "${STUB_LOG}" "kernel=${src}\\n")
  endforeach()
  add_library(${name} INTERFACE)
endfunction()
function(ascendc_include_directories name)
  file(APPEND "${STUB_LOG}" "ascendc_include_directories=${name} ${ARGN}\\n")
endfunction()
"""


def stub_environment(tmp_path: Path, soc: str, ascendc: bool = True) -> dict:
    cann = tmp_path / "cann"
    (cann / "include").mkdir(parents=True)
    (cann / "lib64").mkdir()
    if ascendc:
        cmake_dir = cann / "compiler" / "tikcpp" / "ascendc_kernel_cmake"
        cmake_dir.mkdir(parents=True)
        (cmake_dir / "ascendc.cmake").write_text(STUB_ASCENDC)
    site = tmp_path / "site"
    for sub in ("include", "lib"):
        (site / "torch_npu" / sub).mkdir(parents=True)
    (site / "torch_npu" / "__init__.py").write_text("")
    env = {k: v for k, v in os.environ.items() if k != "DFLASH_DEVICE"}
    env.update(ASCEND_HOME_PATH=str(cann), SOC_VERSION=soc, DFLASH_NPU_DRY_RUN="1",
               DFLASH_NPU_BUILD_DIR=str(tmp_path / "build"),
               PYTHONPATH=os.pathsep.join([str(site), env.get("PYTHONPATH", "")]))
    return env


def dry_run(env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "setup.py", "build_ext", "--device", "npu"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)


def test_setup_configures_the_npu_project_against_a_stub_cann(tmp_path):
    result = dry_run(stub_environment(tmp_path, "Ascend910B3"))
    assert result.returncode == 0, result.stdout + result.stderr
    log = (tmp_path / "build" / "stub_cann.txt").read_text().splitlines()
    assert "soc=ascend910b3" in log and "run_mode=npu" in log
    assert "ascendc_library=dflash_ascend_kernels STATIC" in log
    kernels = sorted(Path(line.split("=", 1)[1]).resolve() for line in log
                     if line.startswith("kernel="))
    assert kernels == sorted((ROOT / "ascend_kernels").glob("*.cpp"))  # every kernel is built
    assert any(line.startswith("ascendc_include_directories=dflash_ascend_kernels")
               for line in log)
    # every NPU launcher is compiled into the library setup.py places in the package
    build_files = "".join(p.read_text(errors="ignore")
                          for p in (tmp_path / "build").rglob("*") if p.is_file())
    for launcher in (ROOT / "csrc" / "npu").glob("*.cpp"):
        assert str(launcher.resolve()) in build_files or str(launcher) in build_files, launcher
    cache = (tmp_path / "build" / "CMakeCache.txt").read_text()
    assert f"DFLASH_NPU_OUTPUT_DIR:PATH={ROOT / 'dflash'}" in cache
    # the library finds torch_npu's and CANN's libraries without LD_LIBRARY_PATH (what
    # `readelf -d` would show as RUNPATH): its link line carries them, despite CANN's
    # CMAKE_SKIP_RPATH
    link = next(p.read_text() for p in (tmp_path / "build").rglob("link.txt")
                if "_npu_kernels" in p.read_text())
    rpath = link.split("-Wl,-rpath,", 1)[1].split()[0].strip("\"'").replace("\\$", "$")
    assert rpath.split(":")[0] == "$ORIGIN", rpath
    assert str(tmp_path / "cann" / "lib64") in rpath and "torch_npu/lib" in rpath


def test_a_manual_configure_defaults_to_a_release_build(tmp_path):
    # The command in ascend_kernels/CMakeLists.txt's header, without CMAKE_BUILD_TYPE.
    env = stub_environment(tmp_path, "ascend910b1")
    build = tmp_path / "manual"
    result = subprocess.run(
        ["cmake", "-S", str(ROOT / "ascend_kernels"), "-B", str(build),
         "-DSOC_VERSION=ascend910b1", f"-DASCEND_HOME_PATH={env['ASCEND_HOME_PATH']}",
         f"-DPython3_EXECUTABLE={sys.executable}", f"-DDFLASH_NPU_OUTPUT_DIR={tmp_path}"],
        env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "CMAKE_BUILD_TYPE:STRING=Release" in (build / "CMakeCache.txt").read_text()


@pytest.mark.parametrize("given, resolved", [
    ("ascend910b1", "ascend910b1"), ("Ascend910B4", "ascend910b4"), ("910b", "ascend910b1"),
    ("A2", "ascend910b1"), ("a3", "ascend910_9391"), ("Ascend910_9382", "ascend910_9382"),
])
def test_soc_version_is_lower_case_with_aliases(tmp_path, given, resolved):
    script = tmp_path / "soc.cmake"
    script.write_text(f'list(APPEND CMAKE_MODULE_PATH "{ROOT / "cmake"}")\n'
                      "include(DflashSocVersion)\n"
                      f'dflash_soc_version("{given}" soc)\nmessage(STATUS "soc=${{soc}}")\n')
    result = subprocess.run(["cmake", "-P", str(script)], capture_output=True, text=True)
    assert result.returncode == 0 and f"soc={resolved}" in result.stdout, result.stderr


@pytest.mark.parametrize("soc", ["ascend310p3", "gpu"])
def test_unsupported_soc_is_rejected(tmp_path, soc):
    result = dry_run(stub_environment(tmp_path, soc))
    assert result.returncode != 0
    assert f"SOC_VERSION={soc} is not an Ascend SoC these kernels support" in result.stderr


def test_a_cann_without_ascendc_cmake_is_named(tmp_path):
    result = dry_run(stub_environment(tmp_path, "ascend910b1", ascendc=False))
    assert result.returncode != 0 and "ascendc.cmake not found under" in result.stderr


def test_npu_launchers_compile_against_stub_headers(tmp_path):
    # csrc/npu is otherwise only compiled by a real NPU build: check its C++ against our reading of
    # the CANN / torch_npu APIs (tests/npu_stub_headers), all launchers in one translation unit.
    from torch.utils.cpp_extension import include_paths

    unit = tmp_path / "launchers.cpp"
    launchers = sorted((ROOT / "csrc" / "npu").glob("*.cpp"))
    unit.write_text("".join(f'#include "{f}"\n' for f in launchers))
    flags = [f"-isystem{p}" for p in include_paths()] + [
        f"-I{ROOT / 'tests' / 'npu_stub_headers'}", f"-I{ROOT / 'csrc'}",
        f"-I{ROOT / 'ascend_kernels'}"]
    result = subprocess.run(["c++", "-std=c++20", "-fsyntax-only", "-Wall", "-Wextra", "-Werror",
                             *flags, str(unit)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr


def _launch_declarations(text: str) -> dict[str, list[str]]:
    """name -> parameter types of each `extern "C" ... name(...)` declaration in C++ text."""
    found = {}
    for name, params in re.findall(r'extern\s+"C"[^;{(]*?\b(\w+)\s*\(([^)]*)\)', text):
        # a parameter's type: all but its last word; spacing around `*` normalised
        found[name] = [re.sub(r"\s*\*", "*", " ".join(p.split()[:-1]))
                       for p in params.split(",") if p.strip()]
    return found


def test_the_launch_declarations_are_what_cann_generates_from_the_kernels(tmp_path):
    """ascendc_library generates aclrtlaunch_<kernel>(blockDim, stream, params...) from each
    kernel's signature in the preprocessed source: a GM_ADDR becomes void*, and a parameter whose
    type is a struct defined there (a tiling struct) becomes a pointer to it, copied into the
    launch arguments (asc-devkit cmake/asc/legacy_modules/util/extract_host_stub.py:
    match_tiling_struct, tiling_add_pointer). The stub header the launchers are compiled against
    must say the same, or a launcher that passes the tiling by value compiles here and not with
    CANN."""
    stub = _launch_declarations(
        (ROOT / "tests" / "npu_stub_headers" / "aclrtlaunch_all.h").read_text())
    kernels = {}
    for source in sorted((ROOT / "ascend_kernels").glob("*.cpp")):
        # the kernels as the emulation's headers expand them (its GM_ADDR is uint8_t*)
        includes = [f"-I{ROOT / d}" for d in ("ascend_kernels/emu", "ascend_kernels", "csrc")]
        text = subprocess.run(["c++", "-E", "-P", "-std=c++17", *includes, str(source)],
                              capture_output=True, text=True, check=True, timeout=120).stdout
        structs = set(re.findall(r"\bstruct\s+(\w+)\s*\{", text))
        for name, types_ in _launch_declarations(text).items():
            if name.startswith("dflash_"):
                kernels[name] = [f"{t}*" if t in structs else
                                 "void*" if t == "uint8_t*" else t for t in types_]
    assert sorted(kernels) == sorted(name.removeprefix("aclrtlaunch_") for name in stub)
    for name, params in kernels.items():
        assert stub[f"aclrtlaunch_{name}"] == ["uint32_t", "aclrtStream", *params], name


@pytest.fixture(scope="module")
def launcher_check(tmp_path_factory):
    """tests/npu_launcher_check.cpp built against the stub headers: csrc/npu's launchers with
    stand-ins for torch_npu and CANN, run on CPU tensors."""
    from torch.utils.cpp_extension import include_paths, library_paths

    program = tmp_path_factory.mktemp("npu") / "launcher_check"
    flags = [f"-isystem{p}" for p in include_paths()] + [
        f"-I{ROOT / 'tests' / 'npu_stub_headers'}", f"-I{ROOT / 'csrc'}",
        f"-I{ROOT / 'ascend_kernels'}"]
    libs = [f"-L{p}" for p in library_paths()] + [f"-Wl,-rpath,{p}" for p in library_paths()]
    result = subprocess.run(["c++", "-std=c++20", "-O0", *flags,
                             str(ROOT / "tests" / "npu_launcher_check.cpp"), "-o", str(program),
                             *libs, "-lc10", "-ltorch_cpu", "-ltorch", "-pthread"],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    return lambda mode: subprocess.run([str(program), mode], stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, text=True,
                                       timeout=60).stdout.strip()


def test_the_launch_goes_to_the_callers_stream(launcher_check):
    # torch_npu runs OpCommand's handler on its task-queue thread, whose current stream is not the
    # caller's (torch.npu.stream(s), graph capture): the launchers must read it before queueing.
    assert launcher_check("stream") == "caller"


def test_every_launcher_guards_its_inputs_device(launcher_check):
    """The stream, the platform queries and the allocations of a launch are the current device's:
    each launcher makes its inputs' device current first (c10_npu::OptionalNPUGuard); the .out
    overloads of paged_attention and rejection_sample are launchers of their own."""
    assert launcher_check("guards").splitlines() == ["cpu"] * 5


def test_a_failed_launch_fails_the_op_and_names_it(launcher_check):
    """Each launcher launches through the generated aclrtlaunch_<kernel>, which returns the
    runtime's status: a failure is reported with the op's name and status, and the handler
    returns it, so torch_npu's task fails (it never did: the handler returned 0)."""
    lines = launcher_check("status").splitlines()
    for op in ("paged_attention", "rejection_sample", "context_kv"):
        assert f"dflash: launching dflash::{op} failed: aclrtlaunch returned 507015" in lines
    assert sum("task failed: its handler returned 507015" in line for line in lines) == 5


def test_a_missing_cann_platform_is_a_clear_error(launcher_check):
    assert "CANN's platform information is unavailable" in launcher_check("platform")


def test_a_built_npu_library_is_loaded_after_torch_npu(monkeypatch):
    loaded = []
    spec = types.SimpleNamespace(origin="/site/dflash/_npu_kernels.so")
    monkeypatch.setattr(registry.importlib.util, "find_spec",
                        lambda name: spec if name == "dflash._npu_kernels" else None)
    fake_torch_npu = types.ModuleType("torch_npu")
    monkeypatch.setitem(sys.modules, "torch_npu", fake_torch_npu)
    monkeypatch.setattr(torch.ops, "load_library",
                        lambda path: loaded.append((path, "torch_npu" in sys.modules)))
    assert registry._load_npu_kernels() == spec.origin
    assert loaded == [(spec.origin, True)]

    def broken(path):
        raise OSError("libascendcl.so: cannot open shared object file")

    monkeypatch.setattr(torch.ops, "load_library", broken)
    with pytest.warns(RuntimeWarning, match="NPU kernels .* not loaded .*libascendcl"):
        assert registry._load_npu_kernels() is None


def test_without_an_npu_build_nothing_is_loaded():
    assert registry.NPU_KERNELS is None and "torch_npu" not in sys.modules
