"""docs/performance.md is what bench/render.py renders from bench/results/*.json: a benchmark
rerun without re-rendering, or a hand edit of the page or of the README's results table, fails
here."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def render():
    sys.path.insert(0, str(ROOT))
    from bench import render

    return render


def test_performance_doc_is_rendered_from_the_results(render):
    assert render.OUT.read_text() == render.render(), \
        "docs/performance.md is out of date: run python bench/render.py"


def test_the_readme_results_table_is_rendered_from_the_results(render):
    text = render.README.read_text()
    assert render.readme(text) == text, "README.md's results table is out of date: run " \
        "python bench/render.py"


def test_every_result_json_is_rendered(render):
    """A new bench/results/*.json shows up in docs/performance.md, or is named as not rendered."""
    stems = {p.stem for p in render.RESULTS.glob("*.json")}
    assert stems - render.NOT_RENDERED == set(render.rendered())
    text = render.OUT.read_text()
    assert all(f"`bench/results/{stem}.json`" in text for stem in render.rendered())


@pytest.mark.parametrize("host, prefix", [
    ({"onednn_max_cpu_isa": "", "capability": "AVX2", "avx512f": False}, ""),   # an AVX2 CPU
    ({"onednn_max_cpu_isa": "", "capability": "AVX2", "avx512f": True},
     "ATEN_CPU_CAPABILITY=avx2 "),                                              # chosen so
    ({"onednn_max_cpu_isa": "AVX512_CORE", "capability": "AVX512", "avx512f": True},
     "ONEDNN_MAX_CPU_ISA=AVX512_CORE "),
])
def test_a_bench_command_names_the_limits_it_ran_under(render, host, prefix):
    data = {"host": host, "max_tokens": 8, "dtype": "auto", "temperature": 0.0,
            "engines": {"adaptive": {}, "fixed": {}, "target_only": {}},
            "rows": [{"dataset": "q.jsonl", "prompts": 3, "concurrency": 1, "rounds": 1}]}
    assert render.bench_command(data, "") == prefix + "dflash bench --dataset q.jsonl " \
        "--num-prompts 3 --concurrency 1 --rounds 1 --max-tokens 8"
