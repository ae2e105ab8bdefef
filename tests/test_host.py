"""The host description recorded with every benchmark: the CPU model and flags as lscpu sees
them."""

import shutil
import subprocess

import pytest

from dflash import host


@pytest.mark.skipif(shutil.which("lscpu") is None, reason="lscpu (util-linux) is not installed")
def test_flags_and_model_match_lscpu(monkeypatch):
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE")
    out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    flags = set(fields["Flags"].split())
    info = host.describe()
    assert info["cpu"] == fields["Model name"].strip()
    assert info["cpu_family"] == \
        f"family {fields['CPU family'].strip()} model {fields['Model'].strip()}"
    assert {f: info[f] for f in host.FLAGS} == {f: f in flags for f in host.FLAGS}
    assert info["onednn_max_cpu_isa"] == "AVX512_CORE"
    line = host.summary(info)
    assert line.startswith(info["cpu"]) and "ONEDNN_MAX_CPU_ISA=AVX512_CORE" in line
    assert all(f in line for f in host.FLAGS)   # each flag named, as present or as missing


@pytest.mark.parametrize("flags, limit, expected", [
    ({"avx512f", "avx512_bf16"}, "", "pairs"),
    ({"avx512f", "avx512_bf16"}, "avx512_core_bf16", "pairs"),
    ({"avx512f", "avx512_bf16", "amx_bf16"}, "", "onednn"),
    ({"avx512f", "avx512_bf16", "amx_bf16"}, "AVX512_CORE_AMX", "onednn"),
    ({"avx512f", "avx512_bf16", "amx_bf16"}, "AVX512_CORE_BF16", "pairs"),  # AMX hidden
    ({"avx512f", "avx512_bf16"}, "AVX512_CORE", "panels"),   # the limit hides the bf16 units
    ({"avx512f", "amx_bf16", "amx_tile"}, "AVX2", "panels"),
    ({"avx512f", "avx2"}, "", "panels"),                     # none to hide
])
def test_bf16_gemm_follows_the_flags_and_onednns_limit(monkeypatch, flags, limit, expected):
    monkeypatch.setattr(host, "_cpuinfo", lambda: ("a CPU", "", frozenset(flags)))
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", limit)
    assert host.bf16_gemm() == expected
