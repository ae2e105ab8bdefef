"""Verify lengths chosen per step: the chooser against brute force, exactness under any schedule,
the cost model's calibration cache, and dtype="auto"."""

import itertools
import json
import os
import random
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from dflash import LLM, SamplingParams
from dflash.engine import cost_model, loading
from dflash.engine.cache import BlockAllocator
from dflash.engine.cost_model import CostModel
from dflash.engine.speculation import Acceptance, Planner, choose_num_drafts, step_rate
from dflash.models.layers import build_metadata
from dflash.ops import registry

from helpers import RandomVerifySchedule, make_tiny_draft, make_tiny_pair, make_tiny_target

B = 8
PROMPTS = [[(5 * i + 7 * j) % 90 + 1 for j in range(n)]
           for i, n in enumerate([6, 11, 2, 17, 9, 1, 14, 8])]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return make_tiny_pair(tmp_path_factory.mktemp("speculation"), B)[:2]


# ------------------------------------------------------------------------------- the chooser
def linear(fixed: float, per_row: float):
    return lambda rows: fixed + per_row * rows


def brute_force(cumulative, target_cost, draft_cost):
    best = None
    for ks in itertools.product(*[range(len(row) + 1) for row in cumulative]):
        rate = step_rate(list(ks), cumulative, CostModelFns(target_cost, draft_cost))
        if best is None or rate > best[0] + 1e-12:
            best = (rate, list(ks))
    return best


class CostModelFns:
    """A cost model made of the chooser's two functions (decode is the target's row cost)."""

    def __init__(self, target, draft):
        self.target, self.draft = target, draft

    def step(self, sequences, rows, drafting, longest):
        return self.target(rows) + self.draft(drafting, longest)


def test_flat_cost_verifies_the_whole_block():
    cumulative = [Acceptance([0.3] * 7).cumulative()] * 3
    assert choose_num_drafts(cumulative, lambda rows: 1.0, lambda n, k: 0.05) == [7, 7, 7]


def test_cost_linear_in_rows_with_low_acceptance_verifies_nothing():
    cumulative = [Acceptance([0.2] * 7).cumulative()] * 4
    # every row costs as much as the fixed part: one more row buys 0.2 tokens at full price
    assert choose_num_drafts(cumulative, linear(1.0, 1.0), lambda n, k: 0.1 * n) == [0, 0, 0, 0]


@pytest.mark.parametrize("seed", range(40))
def test_chooser_matches_brute_force(seed):
    rng = random.Random(seed)
    n, k = rng.randint(1, 3), rng.randint(1, 4)
    cumulative = [Acceptance([rng.random() for _ in range(k)]).cumulative() for _ in range(n)]
    target_cost = linear(rng.uniform(0.5, 2), rng.uniform(0, 0.5))
    draft = rng.uniform(0, 1)
    draft_cost = lambda d, k: np.where(d > 0, draft, 0.0)   # noqa: E731  (whether any drafts)
    rate, _ = brute_force(cumulative, target_cost, draft_cost)
    ks = choose_num_drafts(cumulative, target_cost, draft_cost)
    assert step_rate(ks, cumulative, CostModelFns(target_cost, draft_cost)) == \
        pytest.approx(rate, rel=1e-9)


@pytest.mark.parametrize("seed", range(20))
def test_chooser_is_near_brute_force_when_draft_cost_grows_with_sequences(seed):
    rng = random.Random(100 + seed)
    cumulative = [Acceptance([rng.random() for _ in range(3)]).cumulative() for _ in range(3)]
    target_cost, per_seq = linear(1.0, rng.uniform(0, 0.3)), rng.uniform(0, 0.3)
    draft_cost = lambda d, k: per_seq * d   # noqa: E731
    rate, _ = brute_force(cumulative, target_cost, draft_cost)
    ks = choose_num_drafts(cumulative, target_cost, draft_cost)
    assert step_rate(ks, cumulative, CostModelFns(target_cost, draft_cost)) >= 0.97 * rate


@pytest.mark.parametrize("seed", range(20))
def test_chooser_is_near_brute_force_when_draft_cost_grows_with_the_longest_verify(seed):
    # the draft's lm_head runs over the longest verify's rows of every drafting sequence
    rng = random.Random(200 + seed)
    cumulative = [Acceptance([rng.random() for _ in range(4)]).cumulative() for _ in range(3)]
    target_cost, fixed, per_row = linear(1.0, rng.uniform(0, 0.3)), *(rng.uniform(0, 0.2),) * 2
    draft_cost = lambda d, k: np.where(d > 0, fixed + per_row * d * k, 0.0)   # noqa: E731
    rate, _ = brute_force(cumulative, target_cost, draft_cost)
    ks = choose_num_drafts(cumulative, target_cost, draft_cost)
    assert step_rate(ks, cumulative, CostModelFns(target_cost, draft_cost)) >= 0.97 * rate


def test_a_dear_lm_head_shortens_the_verify():
    cumulative = [Acceptance([0.9, 0.5, 0.5, 0.5]).cumulative()]
    target_cost = lambda rows: 1.0 + 0.01 * rows   # noqa: E731
    assert choose_num_drafts(cumulative, target_cost, lambda d, k: 0.1 * d) == [4]
    # each draft's lm_head row costs what a token is worth past the second draft
    assert choose_num_drafts(cumulative, target_cost, lambda d, k: 0.1 * d + 0.28 * k) == [2]


def test_acceptance_estimates_count_only_what_was_verified():
    a = Acceptance([0.5, 0.5, 0.5])
    a.observe(verified=2, accepted=2, alpha=1.0)   # both verified drafts accepted, 3rd unseen
    assert a.rates == [1.0, 1.0, 0.5]
    a.observe(verified=3, accepted=0, alpha=1.0)   # the first rejected: nothing after it seen
    assert a.rates == [0.0, 1.0, 0.5]
    assert a.cumulative() == [0.0, 0.0, 0.0]


def test_planner_stops_speculating_when_it_cannot_pay_and_probes_later():
    model = CostModel({1: 1.0, 16: 16.0}, {1: 0.5})   # every row costs a full step
    planner = Planner(7, model)
    requests = [type("R", (), {"request_id": i})() for i in range(2)]
    plans = []
    for _ in range(200):
        ks = planner.plan(requests)
        planner.observe(requests, ks, [0] * len(ks))   # nothing is ever accepted
        plans.append(ks)
    off = [ks for ks in plans[50:] if not any(ks)]
    assert len(off) > 140                               # speculation switched off ...
    assert any(any(ks) for ks in plans[50:])            # ... with an occasional probe


def test_planner_learns_that_speculative_steps_cost_more_than_calibrated():
    model = CostModel({1: 1.0, 64: 1.0}, {1: 0.01, 4: 0.04})   # flat: verify every draft
    planner = Planner(7, model)
    requests = [type("R", (), {"request_id": i})() for i in range(4)]
    for r in requests:
        planner._estimate(r.request_id).rates = [0.5] * 7
    assert planner.plan(requests) == [7] * 4
    for _ in range(200):   # decoding costs what was calibrated, speculating 3 s more
        planner.observe_time([7] * 4, model.step(4, 32, 4) + 3.0)
        planner.observe_time([0] * 4, model.step(4, 4, 0))
    # the draft (the only speculation cost calibrated) takes 3 s more than its 0.04 s
    assert planner.time.a == pytest.approx(1.0, rel=0.05)
    assert planner.time.b * model.draft(4) == pytest.approx(3.04, rel=0.05)
    assert planner.plan(requests) == [0] * 4   # 4 tokens in 1 s beat ~7.9 in 4 s


def test_time_correction_separates_a_slow_decode_from_the_price_of_speculating():
    """Every step runs 2x the calibration (longer contexts than calibrated): both factors
    become 2, and the decision is the calibration's. One factor per kind of step would instead
    price speculation by the ratio of a speculating step's time to its whole prediction."""
    model = CostModel({1: 1.0, 4: 1.0, 8: 1.2, 32: 2.0}, {1: 0.1, 4: 0.3}, 8,
                      {1: 1.0, 4: 1.0})
    planner = Planner(7, model)
    random_steps = random.Random(0)
    for _ in range(300):
        ks = [random_steps.choice([0, 0, 1, 7]) for _ in range(4)]
        planner.observe_time(ks, 2.0 * model.step(4, 4 + sum(ks), sum(k > 0 for k in ks)))
    assert planner.time.a == pytest.approx(2.0, rel=0.02)
    assert planner.time.b == pytest.approx(2.0, rel=0.02)


def test_time_correction_keeps_the_calibration_for_what_it_has_not_seen():
    model = CostModel({1: 1.0, 32: 2.0}, {1: 0.1, 4: 0.3}, 8, {1: 1.0, 4: 1.5})
    planner = Planner(7, model)
    for _ in range(300):   # only steps without speculation, each 1.5x the calibration
        planner.observe_time([0] * 4, 1.5 * model.decode(4))
    assert planner.time.a == pytest.approx(1.5, rel=0.02)
    assert planner.time.b == pytest.approx(1.0)


def test_unverified_positions_do_not_keep_an_optimistic_prior():
    a = Acceptance([0.75] * 4)
    a.observe(verified=1, accepted=0, alpha=1.0)   # position 1: rejected, 2..4 never seen
    a.rates[0] = 0.4
    assert a.cumulative() == pytest.approx([0.4, 0.16, 0.064, 0.0256])


# ------------------------------------------------------------------ exactness under any schedule
@pytest.mark.parametrize("max_num_seqs, dtype, bf16_gemm", [
    (1, "float32", None), (8, "float32", None), (8, "bfloat16", "panels"),
    (8, "bfloat16", "pairs")])
def test_any_verify_schedule_gives_target_only_greedy_output(models, max_num_seqs, dtype,
                                                             bf16_gemm, monkeypatch):
    """bfloat16 as on a CPU without bf16 units (column panels) and on one with AVX512-BF16 but
    no AMX (pair panels): panel_linear, like every float32 op, computes a row the same way
    whatever the rows beside it."""
    from dflash.models import layers

    monkeypatch.setattr(layers.host, "bf16_gemm", lambda: bf16_gemm)
    target, draft = models
    baseline = LLM(target, dtype=dtype, max_num_seqs=8)
    # mixed lengths: requests join and leave while others run
    sp = [SamplingParams(max_tokens=8 + 7 * i) for i in range(len(PROMPTS))]
    expected = [o.token_ids for o in baseline.generate(PROMPTS, sp)]
    llm = LLM(target, draft, dtype=dtype, max_num_seqs=max_num_seqs, speculation="chain")
    llm.engine.planner = RandomVerifySchedule(max_num_seqs, k_max=B - 1)
    outs = llm.generate(PROMPTS, sp)
    assert [o.token_ids for o in outs] == expected
    steps = llm.planner.steps
    assert any(not any(ks) for ks in steps) and any(0 < k < B - 1 for ks in steps for k in ks)
    m = llm.metrics()
    assert m["draft_skipped_steps"] == sum(not any(ks) for ks in steps)
    assert m["verify_length_histogram"] == [sum(k == j for ks in steps for k in ks)
                                            for j in range(B)]
    assert m["num_draft_tokens"] == sum(map(sum, steps))
    assert llm.allocator.num_free == llm.allocator.num_blocks


def test_sampled_tokens_follow_the_target_distribution_under_a_random_schedule(tmp_path):
    """As in test_engine's chi-square test, with ragged verification (each request's bonus and
    residual rows at its own k)."""
    from scipy.stats import chisquare

    vocab = 12
    hf = make_tiny_target(tmp_path / "t", "qwen3", vocab_size=vocab, seed=5)
    with torch.no_grad():
        hf.lm_head.weight.mul_(0.15)
    hf.save_pretrained(tmp_path / "t")
    make_tiny_draft(tmp_path / "d", tmp_path / "t", block_size=4, mask_token_id=vocab - 1)
    prompt = [2, 7, 1, 8]
    with torch.no_grad():
        p1 = torch.softmax(hf(torch.tensor([prompt])).logits[0, -1].double(), -1)
        seq2 = torch.tensor([prompt + [t] for t in range(vocab)])
        p2 = p1 @ torch.softmax(hf(seq2).logits[:, -1].double(), -1)
    n = 3000
    llm = LLM(tmp_path / "t", tmp_path / "d", dtype="float32", max_num_seqs=200,
              draft_sampling="sample")
    llm.engine.planner = RandomVerifySchedule(7, k_max=3)
    outs = llm.generate([prompt] * n, [SamplingParams(temperature=1.0, max_tokens=2, seed=s)
                                       for s in range(n)])
    observed = torch.bincount(torch.tensor([o.token_ids[1] for o in outs]),
                              minlength=vocab).double()
    assert chisquare(observed.numpy(), (p2 * n).numpy()).pvalue > 1e-3
    assert llm.metrics()["num_accepted_tokens"] > n // 20


def test_worker_rejects_a_bad_schedule(models):
    target, draft = models
    llm = LLM(target, draft, dtype="float32", speculation="fixed")
    # one more draft than a block has
    llm.engine.planner = SimpleNamespace(plan=lambda rs: [B] * len(rs),
                                         observe=lambda *a: None, observe_time=lambda *a: None,
                                         forget=lambda i: None)
    with pytest.raises(ValueError, match=r"num_drafts must hold one count in \[0, 7\]"):
        llm.generate(PROMPTS[0], SamplingParams(max_tokens=4))
    assert llm.allocator.num_free == llm.allocator.num_blocks


# -------------------------------------------------------------------------- the calibration
def test_calibration_is_cached_reused_and_a_corrupted_file_is_ignored(models, monkeypatch,
                                                                       tmp_path):
    target, draft = models
    monkeypatch.setenv("DFLASH_CALIBRATION_DIR", str(tmp_path))
    calls = []
    real = cost_model.calibrate
    monkeypatch.setattr(cost_model, "calibrate", lambda *a: calls.append(1) or real(*a))
    first = LLM(target, draft, dtype="float32", max_num_seqs=2).cost_model
    files = list(tmp_path.glob("*.json"))
    assert len(calls) == 1 and len(files) == 1
    # every row count of a block (8), then its multiples
    assert sorted(first.target_s) == [*range(1, 9), 16] and sorted(first.draft_s) == [1, 2]
    assert sorted(first.decode_s) == sorted(first.draft_one_s) == [1, 2]
    assert LLM(target, draft, dtype="float32", max_num_seqs=2).cost_model == first
    assert len(calls) == 1                                    # reused
    LLM(target, draft, dtype="float32", max_num_seqs=2, recalibrate=True)
    assert len(calls) == 2                                    # --recalibrate measures again
    files[0].write_text("{not json")
    with pytest.warns(UserWarning, match="ignoring the calibration cache file"):
        LLM(target, draft, dtype="float32", max_num_seqs=2)
    assert len(calls) == 3 and json.loads(files[0].read_text())["cost_model"]["target_ms"]


def test_a_calibration_cache_that_cannot_be_written_is_a_warning(models, monkeypatch, tmp_path):
    # a read-only home (a container) made every engine with a cost model fail to start: the
    # cache only saves the next start its measurements
    target, draft = models
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("DFLASH_CALIBRATION_DIR", str(tmp_path / "file" / "calibration"))
    with pytest.warns(UserWarning, match="cannot cache the calibration at .*file/calibration"):
        llm = LLM(target, draft, dtype="float32", max_num_seqs=2)
    assert llm.cost_model.target_s
    want = LLM(target, dtype="float32").generate(PROMPTS[0], SamplingParams(max_tokens=8))
    assert llm.generate(PROMPTS[0], SamplingParams(max_tokens=8))[0].token_ids == \
        want[0].token_ids


def test_the_calibration_key_names_the_kernel_build(tmp_path):
    """ATEN_CPU_CAPABILITY=avx2 runs the AVX2 build of the kernels on an AVX-512 host: other
    costs, so not the cost model cached for the host's best build."""
    if registry.CPU_CAPABILITY == "DEFAULT":
        pytest.skip("this platform has one build of the kernels")
    (tmp_path / "target").write_bytes(b"weights")
    script = ("import json, sys; from dflash.engine import cost_model; "
              "print(json.dumps(cost_model.cache_key(sys.argv[1], None, 'float32')))")
    keys = {}
    for capability in ("avx2", "default"):
        out = subprocess.run([sys.executable, "-c", script, str(tmp_path / "target")],
                             env={**os.environ, "ATEN_CPU_CAPABILITY": capability},
                             capture_output=True, text=True, check=True).stdout
        keys[capability] = json.loads(out)
    assert keys["default"]["kernels"] == "DEFAULT"
    assert keys["avx2"]["kernels"] == "AVX2" and keys["avx2"] != keys["default"]


def test_cost_model_interpolates_and_extrapolates():
    m = CostModel({1: 1.0, 4: 1.3, 16: 2.5}, {1: 0.2, 4: 0.5}, 16, {1: 1.0, 4: 1.6})
    assert m.target(2) == pytest.approx(1.1)
    assert m.target(32) == pytest.approx(2.5 + 16 * 0.1)
    assert m.draft(0) == 0 and m.draft(8) == pytest.approx(0.9)
    assert list(m.target(np.array([2, 32]))) == pytest.approx([1.1, 4.1])
    # 4 sequences, 16 rows, 2 drafting: decoding the 4, the 12 more rows at the packed slope
    assert m.step(4, 16, 2) == pytest.approx(1.6 + (2.5 - 1.3) + 0.3)
    assert m.step(4, 4, 0) == pytest.approx(1.6)
    assert CostModel.from_json(m.to_json()) == m
    assert CostModel({1: 1.0, 8: 1.5}, {}).decode(8) == 1.5   # one row a sequence: the same
    # measured at 1 and B-1 = 15 drafts a sequence: linear in the drafts between
    m = CostModel({1: 1.0}, {1: 0.5, 4: 2.0}, 16, {}, {1: 0.3, 4: 1.0})
    assert m.draft(4) == m.draft(4, 15) == pytest.approx(2.0)
    assert m.draft(4, 1) == pytest.approx(1.0)
    assert m.draft(2, 8) == pytest.approx((1.6 / 3 + 1.0) / 2)   # halfway from 1 to 15 drafts
    assert list(m.draft(np.array([0, 1]), np.array([0, 15]))) == pytest.approx([0.0, 0.5])
    assert CostModel.from_json(m.to_json()) == m


def test_calibration_times_every_point_in_turn(monkeypatch):
    calls, clock = [], iter(range(1000))
    monkeypatch.setattr(cost_model.time, "perf_counter", lambda: next(clock))
    slow = {"a": 1, "b": 1}

    def fn(key):
        calls.append(key)
        for _ in range(slow[key]):   # each call of `a` ticks the clock once more than `b`'s
            next(clock)
    slow["a"] = 2
    seconds = cost_model.fastest_each({"a": lambda: fn("a"), "b": lambda: fn("b")}, 3)
    assert calls == ["a", "b"] * 4   # a warm-up each, then rounds of one call each
    assert seconds == {"a": 3, "b": 2}


def test_the_cost_grid_measures_every_row_count_of_a_block():
    assert cost_model.timing_grid(256, 16) == list(range(1, 17)) + [32, 64, 128, 256]
    assert cost_model.timing_grid(12, 16) == list(range(1, 12)) + [12]
    assert cost_model.timing_grid(64) == [1, 2, 4, 8, 16, 32, 64]


def test_calibration_times_a_preempted_point_again(monkeypatch):
    calls = []

    class Worker:
        def measure_costs(self, tables, context, rows, seqs, repeats):
            calls.append((rows, seqs))
            slow = 10.0 if len(calls) == 1 else 1.0   # the first pass of 4 rows was preempted
            return ({r: (slow if r == 4 else 1.0) * (1 + r / 8) for r in rows},
                    {n: 0.1 * n for n in seqs}, {n: 1.0 + n / 8 for n in seqs},
                    {n: 0.05 * n for n in seqs})

    allocator = BlockAllocator(64, 16)
    model = cost_model.calibrate(Worker(), allocator, 2, 8, 512)
    assert calls == [([*range(1, 9), 16], [1, 2]), ([4], [])]
    assert model.target_s[4] == pytest.approx(1.5) and allocator.num_free == 64


def test_auto_dtype_takes_the_fastest_measured_and_an_explicit_dtype_is_honoured(
        models, monkeypatch, caplog, tmp_path):
    target, draft = models
    caplog.set_level("INFO", logger="dflash")
    monkeypatch.setenv("DFLASH_CALIBRATION_DIR", str(tmp_path))
    fast_rows = {torch.float32: 0.01, torch.bfloat16: 0.001}   # fp32: every row costs a lot
    monkeypatch.setattr(cost_model, "calibrate", lambda worker, *a: CostModel(
        {1: 1e-3, 64: 1e-3 + 63 * fast_rows[worker.target.embed.dtype]}, {1: 1e-4, 8: 8e-4}, B))
    monkeypatch.setattr(loading, "_announced", set())
    llm = LLM(target, draft, max_num_seqs=8)
    assert llm.dtype == torch.bfloat16 and llm.metrics()["dtype"] == "bfloat16"
    assert "dtype auto -> bfloat16" in caplog.text
    builds = []
    real_load = loading.load_target
    monkeypatch.setattr(loading, "load_target",
                        lambda path, dtype, *a: builds.append(dtype) or real_load(path, dtype, *a))
    assert LLM(target, draft, max_num_seqs=8).dtype == torch.bfloat16
    assert builds == [torch.bfloat16]   # both measurements cached: one model loaded
    fast_rows[torch.float32], fast_rows[torch.bfloat16] = 0.001, 0.01
    assert LLM(target, draft, max_num_seqs=8, recalibrate=True).dtype == torch.float32
    assert LLM(target, draft, dtype="bfloat16", max_num_seqs=8).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="dtype must be 'auto' or one of"):
        LLM(target, draft, dtype="int8")
    with pytest.raises(ValueError, match="speculation must be 'adaptive', 'chain' or 'fixed'"):
        LLM(target, draft, speculation="sometimes")


@pytest.mark.parametrize("backlog_rows", [2, 128])
def test_held_back_draft_context_gives_the_draft_what_an_immediate_write_gives(
        models, backlog_rows):
    """Sequences that verify no drafts hold their draft-context rows back until they draft
    again: every draft forward must then see what it sees when every row is written at once
    (float32; up to the GEMM rounding of context_kv calls of other row counts, where a missing
    or misplaced row would change the draft's output by O(1)), and a sequence holds back at
    most backlog_rows rows."""
    target, draft = models
    sp = [SamplingParams(max_tokens=8 + 7 * i) for i in range(len(PROMPTS))]
    hidden, tokens, flushed = {}, {}, []
    for defer in (True, False):
        llm = LLM(target, draft, dtype="float32", max_num_seqs=4, speculation="chain")
        llm.worker.defer_context = defer
        llm.worker.backlog_rows = backlog_rows
        llm.engine.planner = RandomVerifySchedule(3, k_max=B - 1)
        calls = hidden[defer] = []
        llm.worker.draft.register_forward_hook(lambda m, args, out, calls=calls:
                                               calls.append(out.clone()))
        flush = llm.worker._flush_context

        def counting_flush(requests, flush=flush):
            assert all(len(r.context_backlog) <= backlog_rows for r in requests)
            flushed.append(sum(len(r.context_backlog) for r in requests))
            flush(requests)

        llm.worker._flush_context = counting_flush
        tokens[defer] = [o.token_ids for o in llm.generate(PROMPTS, sp)]
    assert tokens[True] == tokens[False]
    assert len(hidden[True]) == len(hidden[False]) > 10
    assert max((a - b).abs().max().item() for a, b in zip(hidden[True], hidden[False])) < 1e-5
    assert max(flushed) >= 2   # rows were held back and written late


def test_a_step_drafts_from_a_block_cut_to_the_drafts_it_can_verify(models):
    """A step whose sequences verify at most k drafts runs the draft over [pending, MASK * k] at
    positions n .. n+k, and proposes the argmax of its k mask rows: what the draft model computes
    for that (k + 1)-token block, every row through the head (float32). The full block still
    gives B-1 drafts, and a lone sequence keeps its whole block."""
    target, draft = models
    llm = LLM(target, draft, dtype="float32", max_num_seqs=4, speculation="fixed")
    requests = [llm.engine.processor.request(p, SamplingParams()) for p in PROMPTS[:3]]
    for r in requests:
        llm.allocator.grow(r.block_table, len(r.prompt_ids) + 2 * B)
    for r, t in zip(requests, llm.worker.prefill(requests)):
        r.append([t])
    worker, k = llm.worker, 2
    assert worker.draft_head is None   # the head below is the target's
    full, _ = worker.draft_forward(worker.block_inputs(requests))
    assert full.shape == (3, B - 1)
    inputs = worker.block_inputs(requests, k)
    mask = worker.mask_token_id
    assert inputs.tokens.view(3, -1).tolist() == [[r.output_ids[-1]] + [mask] * k
                                                  for r in requests]
    assert inputs.meta.positions.view(3, -1).tolist() == [
        list(range(r.num_cached, r.num_cached + k + 1)) for r in requests]
    few, _ = worker.draft_forward(inputs)
    meta = build_metadata([r.block_table for r in requests], [r.num_cached for r in requests],
                          [k + 1] * 3, llm.allocator.block_size)
    with torch.inference_mode():
        hidden = worker.draft(worker.target.embed_tokens(inputs.tokens), meta,
                              worker.draft_cache)
        expected = worker.target.logits(hidden).view(3, k + 1, -1)[:, 1:].argmax(-1)
    assert torch.equal(few, expected)
    alone = worker.block_inputs(requests[:1], k)
    assert alone.tokens.tolist() == [requests[0].output_ids[-1]] + [mask] * (B - 1)
    assert alone.num_drafts == k and worker.draft_forward(alone)[0].shape == (1, k)
