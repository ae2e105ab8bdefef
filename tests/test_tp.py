"""Tensor parallelism: each rank's shard of the checkpoint, and TP=2 runs (two processes, gloo,
CPU, float32) against TP=1 of the same engine; a rank that dies or hangs fails the run."""

import json
import os
import signal
import threading

import pytest
import torch

from dflash import LLM, SamplingParams
from dflash.cli import main
from dflash.engine import distributed
from dflash.engine.engine import PREFILL_CHUNK
from dflash.models import ConfigError, load_target
from dflash.models.layers import QuantizedWeight
from dflash.models.parallel import TensorParallel

from helpers import RandomVerifySchedule, make_tiny_draft, make_tiny_target

PROMPTS = [[(7 * i + 3 * j) % 90 + 1 for j in range(n)] for i, n in enumerate([5, 12, 3, 20])]
# the MoE target also has an odd vocabulary (a zero-padded last shard), tied embeddings and a
# draft vocabulary (its lm_head rows are gathered from both ranks)
MOE = dict(vocab_size=95, tie_word_embeddings=True)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """TP=2 gives each of its two processes one of the two cores; the TP=1 references get one
    too (many tiny GEMMs on two OpenMP threads crawl when other jobs share the cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    make_tiny_target(root / "qwen3", "qwen3")
    make_tiny_draft(root / "qwen3-draft", root / "qwen3", block_size=8)
    make_tiny_target(root / "qwen3_moe", "qwen3_moe", **MOE)
    make_tiny_draft(root / "qwen3_moe-draft", root / "qwen3_moe", block_size=8,
                    mask_token_id=94)
    (root / "qwen3_moe-draft" / "draft_vocab.json").write_text(
        json.dumps({"token_ids": list(range(0, 95, 2))}))
    return {k: (root / k, root / f"{k}-draft") for k in ("qwen3", "qwen3_moe")}


def _llm(target, draft, **kw):
    # fixed blocks: sampled tokens are compared, and an adaptive schedule follows each engine's
    # own cost model
    kw.setdefault("speculation", "fixed")
    kw.setdefault("draft_sampling", "sample")
    return LLM(target, draft, dtype="float32", max_num_seqs=3, **kw)


# ------------------------------------------------------------------ shards (no processes)

@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe"])
def test_rank_shards_reassemble_the_checkpoint(tmp_path, kind):
    make_tiny_target(tmp_path, kind, **(MOE if kind == "qwen3_moe" else {}))
    full = dict(load_target(tmp_path, torch.float32).named_parameters())
    ranks = [dict(load_target(tmp_path, torch.float32, tp=TensorParallel(r, 2))
                  .named_parameters()) for r in range(2)]
    q, kv = 4 * 16 // 2, 2 * 16 // 2   # rows per rank: heads (of 4) and kv heads (of 2) x D 16
    for name, value in full.items():
        parts = [r[name] for r in ranks]
        if name in ("embed", "lm_head"):     # vocabulary rows, the last shard zero-padded
            rows = torch.cat(parts)
            torch.testing.assert_close(rows[:value.shape[0]], value, rtol=0, atol=0)
            assert not rows[value.shape[0]:].any()
        elif name.endswith("attn.qkv"):      # [q | k | v] of each rank's heads
            pieces = [p.split([q, kv, kv]) for p in parts]
            rebuilt = torch.cat([torch.cat([p[i] for p in pieces]) for i in range(3)])
            torch.testing.assert_close(rebuilt, value, rtol=0, atol=0)
        elif name.endswith(("attn.o", "mlp.down")) and value.dim() == 2:   # input columns
            torch.testing.assert_close(torch.cat(parts, 1), value, rtol=0, atol=0)
        elif name.endswith("mlp.gate_up") and value.dim() == 2:   # [gate | up] rows
            gates, ups = zip(*(p.chunk(2) for p in parts))
            torch.testing.assert_close(torch.cat([*gates, *ups]), value, rtol=0, atol=0)
        elif name.endswith(("mlp.gate_up", "mlp.down")):   # experts 0-3 on rank 0, 4-7 on 1
            torch.testing.assert_close(torch.cat(parts), value, rtol=0, atol=0)
        else:                                # norms and the router are replicated
            for p in parts:
                torch.testing.assert_close(p, value, rtol=0, atol=0)


@pytest.mark.parametrize("kind, overrides, tp, field", [
    ("qwen3", {}, 4, "num_key_value_heads"),
    ("qwen3", {"num_key_value_heads": 4, "intermediate_size": 130}, 4, "intermediate_size"),
    ("qwen3_moe", {"num_key_value_heads": 4, "num_experts": 6}, 4, "num_experts"),
])
def test_splits_that_do_not_divide_are_named(tmp_path, kind, overrides, tp, field):
    make_tiny_target(tmp_path, kind, **overrides)
    with pytest.raises(ConfigError, match=f"tp_size {tp} must divide the target's {field}"):
        load_target(tmp_path, torch.float32, tp=TensorParallel(0, tp))


def test_bad_parallel_sizes_are_rejected_before_spawning(models):
    target, draft = models["qwen3"]
    with pytest.raises(ValueError, match="tp_size must be an integer >= 1"):
        LLM(target, draft, tp_size=0)
    with pytest.raises(ValueError, match="context parallelism"):
        LLM(target, draft, cp_size=2, tp_size=2)
    for timeout in (0, -5, None, float("inf"), float("nan"), "60", True):
        with pytest.raises(ValueError, match="tp_timeout must be a positive finite number"):
            LLM(target, draft, tp_size=2, tp_timeout=timeout)


def test_more_ranks_than_devices_are_refused_before_spawning(models, monkeypatch):
    """Rank r uses device r: on a host with fewer, the ranks past them would fail only once
    spawned, with rank 0 waiting tp_timeout for them."""
    import multiprocessing

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="tp_size 2 needs 2 cuda devices .*found 1"):
        LLM(*models["qwen3"], dtype="float32", device="cuda", tp_size=2)
    assert not multiprocessing.active_children()


# ------------------------------------------------------------------- two processes

@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe"])
def test_tp2_generates_exactly_what_tp1_does(models, kind):
    target, draft = models[kind]
    greedy = [SamplingParams(max_tokens=12 + 6 * i) for i in range(len(PROMPTS))]
    sampled = SamplingParams(temperature=1.5, max_tokens=24, seed=11)
    tp1 = _llm(target, draft)
    expected = [[o.token_ids for o in tp1.generate(PROMPTS, p)] for p in (greedy, sampled)]
    with _llm(target, draft, tp_size=2, tp_timeout=60) as llm:
        got = [[o.token_ids for o in llm.generate(PROMPTS, p)] for p in (greedy, sampled)]
        assert got == expected
        # same draws on rank 0, and the ranks' caches followed them: the same acceptance
        m1, m2 = tp1.metrics(), llm.metrics()
        assert m2["num_accepted_tokens"] == m1["num_accepted_tokens"] > 0
        assert m2["accepted_per_position"] == m1["accepted_per_position"]
        assert llm.allocator.num_free == llm.allocator.num_blocks
        with pytest.raises(RuntimeError, match="already initialized"):
            _llm(target, draft, tp_size=2)
        llm.worker.proposer = lambda inputs: None
        with pytest.raises(ValueError, match="proposer is not supported"):
            llm.generate(PROMPTS[0], SamplingParams(max_tokens=4))
        llm.worker.proposer = None   # the group is still usable
        assert llm.generate(PROMPTS, greedy)[2].token_ids == expected[0][2]
        # a prompt past PREFILL_CHUNK prefills in chunks on every rank
        long = [[(13 * j) % 90 + 1 for j in range(PREFILL_CHUNK + 40)], PROMPTS[1]]
        assert [o.token_ids for o in llm.generate(long, greedy[:2])] == \
            [o.token_ids for o in tp1.generate(long, greedy[:2])]


def test_tp2_adaptive_calibrates_through_the_group_and_stays_exact(models):
    """The cost model is measured with every rank taking part, and a ragged verify schedule
    (the planner's choices) keeps TP=2 greedy output equal to TP=1's."""
    target, draft = models["qwen3"]
    greedy = [SamplingParams(max_tokens=10 + 5 * i) for i in range(len(PROMPTS))]
    expected = [o.token_ids for o in _llm(target, draft).generate(PROMPTS, greedy)]
    with _llm(target, draft, tp_size=2, tp_timeout=60, speculation="adaptive") as llm:
        assert sorted(llm.cost_model.draft_s) == [1, 2, 3]
        llm.engine.planner = RandomVerifySchedule(3, k_max=7)
        assert [o.token_ids for o in llm.generate(PROMPTS, greedy)] == expected
        assert llm.metrics()["draft_skipped_steps"] > 0
        assert llm.allocator.num_free == llm.allocator.num_blocks


def test_tp2_quantized_target_stays_exact(models):
    """An int8 target split over two ranks (the row-parallel projections' K halves hold whole
    groups of 32), with an int8 draft on every rank: DFlash, verifying blocks of 8 rows, equals
    target-only decoding of the same split, token for token."""
    target, draft = models["qwen3"]
    greedy = [SamplingParams(max_tokens=10 + 5 * i) for i in range(len(PROMPTS))]
    with LLM(target, None, dtype="float32", max_num_seqs=3, tp_size=2, tp_timeout=60,
             quantization="int8") as base:
        expected = [o.token_ids for o in base.generate(PROMPTS, greedy)]
    with _llm(target, draft, tp_size=2, tp_timeout=60, draft_sampling="greedy",
              quantization="int8", draft_quantization="int8") as llm:
        assert isinstance(llm.target.layers[0].attn.o, QuantizedWeight)
        assert isinstance(llm.draft.layers[0].q, QuantizedWeight)
        outs = llm.generate(PROMPTS, greedy)
        assert [o.token_ids for o in outs] == expected
        # every step verified a full block (the random draft's tokens are rarely accepted)
        assert sum(o.metrics.num_drafts for o in outs) > 0


def test_tp2_trees_stay_exact_and_follow_rank_0(models):
    """Tree steps under TP=2: every rank verifies rank 0's trees (the followers' own choice is
    discarded) and commits rank 0's paths, so greedy output equals TP=1 target-only decoding
    and seeded sampled requests reproduce TP=1's tree steps on the same schedule."""
    target, draft = models["qwen3_moe"]   # a draft vocabulary: tree ids are mapped
    greedy = [SamplingParams(max_tokens=10 + 5 * i) for i in range(len(PROMPTS))]
    sampled = SamplingParams(temperature=1.2, max_tokens=16, seed=5)
    plain = LLM(target, None, dtype="float32", max_num_seqs=3)
    expected = [o.token_ids for o in plain.generate(PROMPTS, greedy)]
    tp1 = _llm(target, draft, speculation="adaptive", draft_sampling="greedy")
    tp1.engine.planner = RandomVerifySchedule(5, k_max=7)
    expected_sampled = [o.token_ids for o in tp1.generate(PROMPTS, sampled)]
    with _llm(target, draft, tp_size=2, tp_timeout=60, speculation="adaptive",
              draft_sampling="greedy") as llm:
        llm.engine.planner = RandomVerifySchedule(3, k_max=7)
        assert [o.token_ids for o in llm.generate(PROMPTS, greedy)] == expected
        assert sum(map(sum, llm.engine.planner.trees)) > 0
        llm.engine.planner = RandomVerifySchedule(5, k_max=7)
        assert [o.token_ids for o in llm.generate(PROMPTS, sampled)] == expected_sampled
        assert llm.metrics()["tree_steps"] > 0
        assert llm.allocator.num_free == llm.allocator.num_blocks


def test_cli_generate_tp2(models, tmp_path, capsys):
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers import models as tok_models
    from transformers import PreTrainedTokenizerFast

    target, draft = models["qwen3"]
    word_level = Tokenizer(tok_models.WordLevel({f"w{i}": i for i in range(96)}, unk_token="w0"))
    word_level.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=word_level, unk_token="w0").save_pretrained(target)
    prompt = "w5 w17 w3 w40 w8"
    expected = LLM(target, draft, dtype="float32").generate(
        prompt, SamplingParams(max_tokens=16))[0].text
    assert main(["generate", "--target", str(target), "--draft", str(draft), "--dtype",
                 "float32", "--max-tokens", "16", "--tp", "2", prompt]) == 0
    assert capsys.readouterr().out.strip() == expected.strip()


def _fail_follower_mid_run(signal_number, **kw):
    """Generate with TP=2 and send `signal_number` to rank 1 once tokens flow; returns the
    error raised (within 60 s) and the stopped LLM."""
    llm = LLM(kw.pop("target"), dtype="float32", tp_size=2, **kw)
    follower = llm.engine.group.procs[0]
    result = {}

    def run():
        def on_tokens(index, tokens):
            if follower.is_alive():
                os.kill(follower.pid, signal_number)
        try:
            llm.generate(PROMPTS, SamplingParams(max_tokens=40), on_tokens=on_tokens)
        except Exception as e:
            result["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(60)
    assert not thread.is_alive(), "the run hung"
    return result.get("error"), llm


def test_a_killed_rank_fails_the_run_at_once(models):
    error, llm = _fail_follower_mid_run(signal.SIGKILL, target=models["qwen3"][0],
                                        tp_timeout=300)
    assert isinstance(error, RuntimeError)
    assert "tensor-parallel run failed" in str(error) and \
        "rank 1 was killed by signal 9" in str(error)
    with pytest.raises(RuntimeError, match="group is stopped"):
        llm.generate(PROMPTS[0])


def test_a_hung_rank_fails_the_run_after_the_timeout(models):
    error, llm = _fail_follower_mid_run(signal.SIGSTOP, target=models["qwen3"][0],
                                        tp_timeout=3)
    assert isinstance(error, RuntimeError)
    assert "Timed out" in str(error) and "rank 1 was still running" in str(error)
    assert not llm.engine.group.procs[0].is_alive()


def test_a_rank_that_raises_reports_its_traceback(models):
    llm = LLM(models["qwen3"][0], dtype="float32", tp_size=2, tp_timeout=60)
    llm.engine.group.send(("step", [None]))   # a command no follower can replay
    with pytest.raises(RuntimeError, match=r"rank 1 raised:\n.*Traceback(.|\n)*TypeError"):
        llm.generate(PROMPTS[0], SamplingParams(max_tokens=4))


def _start_worker(group, target, num_blocks=8):
    """Rank 0's part of loading (as `dflash.engine.loading` does): its shard and its worker."""
    return group.worker(load_target(target, torch.float32, "cpu", group.tp, 64), None,
                        num_blocks, 16, 1, "greedy")


def _start_in_thread(group, target):
    """`_start_worker` in a thread, and where the error it raises will be (result["error"])."""
    result = {}

    def start():
        try:
            _start_worker(group, target)
        except Exception as e:
            result["error"] = e

    thread = threading.Thread(target=start, daemon=True)
    thread.start()
    return thread, result


def test_a_rank_that_hangs_while_loading_fails_the_start(models):
    """A follower that stops before reporting its worker ready fails the start after the
    timeout (rank 0's own load done, it waits as it would in a collective), never hangs."""
    target = models["qwen3"][0]
    group = distributed.Group(2, target, None, torch.float32, "cpu", 3, 64)
    follower = group.procs[0]
    os.kill(follower.pid, signal.SIGSTOP)
    thread, result = _start_in_thread(group, target)
    thread.join(30)
    if thread.is_alive():   # leave no stopped process behind
        os.kill(follower.pid, signal.SIGKILL)
        thread.join(30)
    assert "error" in result and "did not report 'ready' within 3 s" in str(result["error"])
    assert "rank 1 was still running" in str(result["error"])
    assert not follower.is_alive()


def test_a_rank_killed_while_loading_fails_the_start_clearly(models):
    """A follower killed while it loads, with rank 0's worker arguments unread in its pipe
    (which then reads as a reset, not EOF), fails the start with the group's error."""
    target = models["qwen3"][0]
    group = distributed.Group(2, target, None, torch.float32, "cpu", 60, 64)
    follower = group.procs[0]
    os.kill(follower.pid, signal.SIGSTOP)   # still loading when rank 0 sends its arguments
    thread, result = _start_in_thread(group, target)
    thread.join(2)   # rank 0 has sent its arguments and waits
    os.kill(follower.pid, signal.SIGKILL)
    thread.join(30)
    assert not thread.is_alive(), "the start hung"
    assert isinstance(result.get("error"), RuntimeError), result
    assert "rank 1 was killed by signal 9" in str(result["error"])


class _FollowersCannotLoad(int):
    """An int to rank 0, whose unpickling raises (in a follower, while it builds its worker)."""

    def __reduce__(self):
        return _refuse, ()


def _refuse():
    raise ValueError("refused on this rank")


def test_a_rank_that_raises_while_loading_reports_its_traceback(models):
    target = models["qwen3"][0]
    group = distributed.Group(2, target, None, torch.float32, "cpu", 60, 64)
    with pytest.raises(RuntimeError, match=r"rank 1 raised(.|\n)*ValueError: refused on this"):
        _start_worker(group, target, num_blocks=_FollowersCannotLoad(8))
    assert not group.procs[0].is_alive()


def test_an_error_after_the_ranks_started_stops_them(models, tmp_path, monkeypatch):
    """An engine that fails to start once its ranks run (here while it calibrates) stops them:
    no follower is left, and the process group is released for the next LLM."""
    import multiprocessing

    from dflash.engine import cost_model

    def fails(*args):
        raise MemoryError("calibration ran out of memory")

    target, draft = models["qwen3"]
    monkeypatch.setenv("DFLASH_CALIBRATION_DIR", str(tmp_path))
    monkeypatch.setattr(cost_model, "calibrate", fails)
    with pytest.raises(MemoryError):
        _llm(target, draft, tp_size=2, tp_timeout=60, speculation="chain")
    assert not multiprocessing.active_children()
    assert not torch.distributed.is_initialized()
