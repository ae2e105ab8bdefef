"""Build flags: the NPU build stops early with a clear message when CANN / torch_npu are missing."""

import os
import subprocess
import sys
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
