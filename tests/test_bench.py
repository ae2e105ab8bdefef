"""`dflash bench` end to end on tiny checkpoints: the table, the JSON and the plot."""

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from dflash import bench

from helpers import CharTokenizer, make_tiny_draft, make_tiny_target


def test_accepted_length_histogram_from_prefix_counts():
    # 10 steps; 6 accepted >= 1 draft, 3 >= 2, 1 >= 3
    m = {"num_drafts": 10, "accepted_per_position": [6, 3, 1]}
    assert bench.accepted_length_histogram(m) == [4, 3, 2, 1]


@pytest.fixture
def tiny_bench(tmp_path, monkeypatch):
    """bench.run on tiny checkpoints and 3 prompts; `engines` records each engine built (its
    draft), `measured` each measurement (the engine's draft, the concurrency)."""
    make_tiny_target(tmp_path / "t", "qwen3")
    make_tiny_draft(tmp_path / "d", tmp_path / "t", block_size=4)
    prompts = tmp_path / "q.jsonl"
    prompts.write_text("".join(json.dumps({"question": f"q{i}"}) + "\n" for i in range(3)))
    engines, measured, drafts = [], [], {}
    original_llm, original_run = bench.LLM, bench._run

    def llm(target, draft, **kw):
        engines.append(draft)
        engine = original_llm(target, draft, **kw, tokenizer=CharTokenizer())
        drafts[id(engine)] = draft
        return engine

    def measure(engine, prompts, params, concurrency):
        measured.append((drafts[id(engine)], concurrency))
        return original_run(engine, prompts, params, concurrency)

    monkeypatch.setattr(bench, "LLM", llm)
    monkeypatch.setattr(bench, "_run", measure)
    # file names as on a host of the AVX-512 build, whatever build this host loaded
    monkeypatch.setattr(bench.registry, "CPU_CAPABILITY", bench.NAMELESS_KERNELS)

    def run(concurrencies, temperature=0.0, **kw):
        return bench.run(tmp_path / "t", tmp_path / "d", str(prompts), 3, concurrencies, 12,
                         temperature, None, "float32", tmp_path / "out", **kw)
    return SimpleNamespace(run=run, engines=engines, measured=measured, path=tmp_path)


def test_bench_writes_rows_json_and_plot(tiny_bench):
    rows, tmp_path = tiny_bench.run([1, 2]), tiny_bench.path
    assert [r["concurrency"] for r in rows] == [1, 2]
    for r in rows:
        assert r["prompts"] == 3 and r["generated_tokens"] == 36 and r["identical"] == 3
        assert r["dtype"] == "float32/float32/float32"
        for mode in ("adaptive", "fixed"):
            m = r["modes"][mode]
            assert m["identical"] == 3 and m["generated_tokens"] == 36
            assert sum(m["accepted_length_histogram"]) == m["num_drafts"]
            # a request-step that verifies k > 0 drafts (or tree nodes) counts as one draft
            assert sum(n for k, n in m["verified_histogram"].items() if k) == m["num_drafts"]
        # tree nodes by the draft's confidence, and those only the prompt lookup proposed:
        # every node the adaptive engine verified (the engine's counts: test_tree_engine.py)
        adaptive = r["modes"]["adaptive"]
        assert sum(adaptive["tree_confidence"]["verified"]) + \
            adaptive["tree_lookup_nodes"]["verified"] == \
            sum(k * n for k, n in adaptive["verified_histogram"].items())
        fixed = r["modes"]["fixed"]["verify_length_histogram"]
        assert fixed[:-1] == [0, 0, 0] and fixed[-1] > 0   # block 4: always 3 drafts
        assert r["vs_best_other"] == pytest.approx(
            r["tok_s"] / max(r["fixed_tok_s"], r["target_only_tok_s"]), rel=1e-2)
    saved = json.loads((tmp_path / "out" / "bench_q.json").read_text())
    assert saved["rows"][0]["tau"] == rows[0]["tau"]
    assert saved["host"]["cpu"] and "avx512_bf16" in saved["host"]
    assert saved["engines"]["adaptive"]["cost_model"]["target_ms"]
    assert (tmp_path / "out" / "bench_q.png").stat().st_size > 1000


def test_a_sampled_run_is_saved_beside_the_greedy_one(tiny_bench):
    modes = ("fixed", "target_only")
    tiny_bench.run([1], modes=modes)
    tiny_bench.run([1], temperature=0.7, modes=modes)
    out = tiny_bench.path / "out"
    assert json.loads((out / "bench_q.json").read_text())["temperature"] == 0.0
    assert json.loads((out / "bench_q-t0.7.json").read_text())["temperature"] == 0.7
    assert (out / "bench_q-t0.7.png").stat().st_size > 1000


def test_a_run_under_an_isa_limit_is_saved_under_its_name(tiny_bench, monkeypatch):
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE")
    tiny_bench.run([1], modes=("fixed", "target_only"))
    saved = json.loads((tiny_bench.path / "out" / "bench_q-avx512_core.json").read_text())
    assert saved["host"]["onednn_max_cpu_isa"] == "AVX512_CORE"
    assert not (tiny_bench.path / "out" / "bench_q.json").exists()


def test_a_run_on_other_kernels_is_saved_under_their_name(tiny_bench, monkeypatch):
    monkeypatch.setattr(bench.registry, "CPU_CAPABILITY", "AVX2")
    tiny_bench.run([1], modes=("fixed", "target_only"))
    saved = json.loads((tiny_bench.path / "out" / "bench_q-avx2.json").read_text())
    assert saved["host"]["capability"] == "AVX2"
    assert not (tiny_bench.path / "out" / "bench_q.json").exists()


@pytest.mark.parametrize("kernels, isa, suffix", [
    ("AVX512", None, ""), ("AVX2", None, "_avx2"), ("DEFAULT", None, "_default"),
    ("AVX512", "AVX512_CORE", "_avx512_core")])
def test_micro_benchmarks_name_their_files_by_the_kernels_they_ran(monkeypatch, kernels, isa,
                                                                   suffix):
    """bench/common.build_suffix follows the kernels that loaded, not only ATEN_CPU_CAPABILITY:
    a micro-benchmark on an AVX2-only CPU must not overwrite the AVX-512 host's tables."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bench import common

    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    monkeypatch.setattr(bench.registry, "CPU_CAPABILITY", kernels)
    if isa:
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", isa)
    else:
        monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    assert common.build_suffix() == suffix


def test_modes_of_a_concurrency_run_back_to_back_in_alternating_order(tiny_bench):
    [row] = tiny_bench.run([1], rounds=3, modes=("fixed", "target_only"))
    draft = tiny_bench.path / "d"
    assert tiny_bench.engines == [draft, None]   # one engine per mode for the whole run
    assert tiny_bench.measured == [(draft, 1), (None, 1), (None, 1), (draft, 1), (draft, 1),
                                   (None, 1)]
    assert "fixed_tok_s" not in row and row["modes"].keys() == {"fixed", "target_only"}
    assert len(row["speedup_per_round"]) == 3 and row["rounds"] == 3
    assert row["generated_tokens"] == 36 and row["identical"] == 3
    assert row["same_in_every_round"] == 3   # float32 greedy: every round the same tokens
    with pytest.raises(ValueError, match="rounds must be >= 1, got 0"):
        tiny_bench.run([1], rounds=0)
    with pytest.raises(ValueError, match="modes must include target_only"):
        tiny_bench.run([1], modes=("adaptive", "fixed"))


def test_rounds_repeat_every_concurrency_with_the_order_mirrored(tiny_bench):
    rows = tiny_bench.run([1, 2], rounds=2, modes=("fixed", "target_only"))
    draft = tiny_bench.path / "d"
    assert tiny_bench.measured == [(draft, 1), (None, 1), (None, 2), (draft, 2),
                                   (None, 1), (draft, 1), (draft, 2), (None, 2)]
    assert [len(r["speedup_per_round"]) for r in rows] == [2, 2]


def test_combine_flags_prompts_whose_tokens_changed_between_rounds():
    def outputs(*token_ids):
        return [SimpleNamespace(token_ids=t) for t in token_ids]
    metrics = {"generated_tokens": 4}
    runs = [(outputs([1, 2], [3, 4]), metrics, 2.0, 0.5),
            (outputs([1, 2], [3, 5]), metrics, 1.0, 0.25)]
    _, _, tokens, wall, prefill, rates, repeated = bench._combine(runs)
    assert (tokens, wall, prefill, rates) == (8, 3.0, 0.75, [2.0, 4.0])
    assert repeated == [True, False]


def test_unknown_dataset_is_named():
    with pytest.raises(ValueError, match="'nope' is neither a JSONL file"):
        bench.load_dataset("nope", 3)
