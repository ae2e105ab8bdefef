"""The engine end to end on tiny random checkpoints (float32): losslessness against target-only
decoding and Hugging Face greedy generation, scripted acceptance, sampling, cache accounting."""

import pytest
import torch

from dflash import LLM, SamplingParams
from dflash.engine.request import Request
from dflash.engine.worker import prefill_passes
from dflash.models.layers import PANEL_MAX_ROWS

from helpers import (
    CharTokenizer,
    hf_greedy,
    make_small_vocabulary,
    make_tiny_draft,
    make_tiny_pair,
    make_tiny_target,
    second_token_pvalue,
)

B = 8
PROMPTS = [[(7 * i + 3 * j) % 90 + 1 for j in range(n)]
           for i, n in enumerate([5, 12, 3, 20, 9, 1, 15, 7])]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return make_tiny_pair(tmp_path_factory.mktemp("engine"), B)


@pytest.fixture(scope="module")
def baseline(models):
    return LLM(models[0], dtype="float32", max_num_seqs=8)


@pytest.mark.parametrize("speculation", ["fixed", "chain", "adaptive"])
def test_greedy_batch_1_equals_target_only_and_transformers(models, baseline, speculation):
    target, draft, hf = models
    sp = SamplingParams(max_tokens=40)
    llm = LLM(target, draft, dtype="float32", max_num_seqs=1, speculation=speculation)
    dflash = llm.generate(PROMPTS[1], sp)[0]
    assert dflash.token_ids == baseline.generate(PROMPTS[1], sp)[0].token_ids \
        == hf_greedy(hf, PROMPTS[1], 40)
    assert dflash.finish_reason == "length"
    if speculation == "fixed":
        assert dflash.metrics.num_drafts > 0


@pytest.mark.parametrize("speculation", ["fixed", "chain", "adaptive"])
def test_greedy_continuous_batching_equals_target_only(models, baseline, speculation):
    target, draft, hf = models
    sp = [SamplingParams(max_tokens=10 + 5 * i) for i in range(len(PROMPTS))]
    llm = LLM(target, draft, dtype="float32", max_num_seqs=3, speculation=speculation)
    outs = llm.generate(PROMPTS, sp)
    expected = baseline.generate(PROMPTS, sp)
    for o, e, p, s in zip(outs, expected, PROMPTS, sp):
        assert o.token_ids == e.token_ids == hf_greedy(hf, p, s.max_tokens)
    assert llm.allocator.num_free == llm.allocator.num_blocks


class ScriptedProposer:
    """Proposes the target's own greedy continuation with the token at a planned position
    corrupted, so the number of accepted drafts is chosen by the test."""

    def __init__(self, continuations: dict, plans: dict, vocab: int):
        self.continuations, self.plans, self.vocab = continuations, plans, vocab
        self.used = {k: [] for k in plans}

    def __call__(self, inputs):
        rows = []
        for r in inputs.requests:
            key = tuple(r.prompt_ids)
            plan = self.plans[key]
            accept = plan[len(self.used[key]) % len(plan)]
            self.used[key].append(accept)
            n = len(r.output_ids)
            drafts = list(self.continuations[key][n:n + inputs.block_size - 1])
            if accept < len(drafts):
                drafts[accept] = (drafts[accept] + 1) % self.vocab
            rows.append(drafts)
        return torch.tensor(rows), None


def test_scripted_acceptance_every_length_and_exact_metrics(models, baseline):
    target, _, _ = models
    prompts = PROMPTS[:4]
    long = baseline.generate(prompts, SamplingParams(max_tokens=60 + B))
    plans = {tuple(p): plan for p, plan in zip(prompts, [
        list(range(B)), [B - 1, 0, 3], [0, 0, 6, 2], [5, B - 1, 1]])}
    llm = LLM(target, dtype="float32", max_num_seqs=4, block_size=B)
    llm.worker.proposer = ScriptedProposer({tuple(p): o.token_ids for p, o in zip(prompts, long)},
                                    plans, 96)
    outs = llm.generate(prompts, SamplingParams(max_tokens=60))
    seen = set()
    for p, o, ref in zip(prompts, outs, long):
        assert o.token_ids == ref.token_ids[:60]
        used = llm.worker.proposer.used[tuple(p)]
        seen.update(used)
        # the last step may commit past max_tokens; acceptance is what the sampler decided
        assert o.metrics.num_drafts == len(used)
        assert o.metrics.num_accepted_tokens == sum(used)
        assert o.metrics.accepted_per_position == [sum(a > i for a in used) for i in range(B - 1)]
    assert seen == set(range(B))
    totals = llm.metrics()
    assert totals["num_accepted_tokens"] == sum(sum(u) for u in llm.worker.proposer.used.values())
    assert totals["mean_acceptance_length"] == pytest.approx(
        1 + totals["num_accepted_tokens"] / totals["num_drafts"])


@pytest.mark.parametrize("speculation", ["fixed", "chain", "adaptive"])
def test_greedy_output_reaches_max_model_len_exactly(models, speculation):
    """A sequence ends at max_model_len tokens with target-only decoding's tokens, whatever the
    last steps would verify: their drafts and tree nodes stop at the positions left."""
    target, draft, _ = models
    sp = SamplingParams(max_tokens=500, ignore_eos=True)
    ref = [o.token_ids for o in LLM(target, dtype="float32", max_num_seqs=4,
                                    max_model_len=48).generate(PROMPTS[:4], sp)]
    assert all(len(p) + len(r) == 48 for p, r in zip(PROMPTS[:4], ref))
    llm = LLM(target, draft, dtype="float32", max_num_seqs=4, max_model_len=48,
              speculation=speculation)
    outs = llm.generate(PROMPTS[:4], sp)
    assert [o.token_ids for o in outs] == ref
    assert all(o.finish_reason == "length" for o in outs)
    # every draft accepted: each step could commit a whole block past the limit
    full = LLM(target, dtype="float32", max_num_seqs=4, max_model_len=48, block_size=B)
    full.worker.proposer = ScriptedProposer({tuple(p): r + [0] * B for p, r in
                                             zip(PROMPTS[:4], ref)},
                                            {tuple(p): [B - 1] for p in PROMPTS[:4]}, 96)
    assert [o.token_ids for o in full.generate(PROMPTS[:4], sp)] == ref


def test_a_prompt_takes_max_model_len_as_target_only_decoding_does(models):
    """A prompt within a block of max_model_len runs (its last tokens decode without a draft
    pass) and gives target-only decoding's tokens, up to max_model_len."""
    target, draft, _ = models
    sp = SamplingParams(max_tokens=100, ignore_eos=True)
    prompts = [list(range(1, 32)), list(range(1, 30)), list(range(3, 28))]
    ref = [o.token_ids for o in LLM(target, dtype="float32", max_num_seqs=3,
                                    max_model_len=32).generate(prompts, sp)]
    assert [len(r) for r in ref] == [1, 3, 7]
    llm = LLM(target, draft, dtype="float32", max_num_seqs=3, max_model_len=32)
    assert [o.token_ids for o in llm.generate(prompts, sp)] == ref


def test_stop_token_inside_accepted_block(models, baseline):
    target, _, _ = models
    ref = baseline.generate(PROMPTS[3], SamplingParams(max_tokens=40 + B))[0].token_ids
    stop = ref[13]
    first = ref.index(stop)
    llm = LLM(target, dtype="float32", block_size=B)
    llm.worker.proposer = ScriptedProposer({tuple(PROMPTS[3]): ref},
                                           {tuple(PROMPTS[3]): [B - 1]}, 96)
    out = llm.generate(PROMPTS[3], SamplingParams(max_tokens=40, stop_token_ids=[stop]))[0]
    assert out.token_ids == ref[:first + 1] and out.finish_reason == "stop"


@pytest.mark.parametrize("stop_string", [None, "never"])
def test_a_stop_token_ends_the_ids_but_not_the_text(models, baseline, stop_string):
    """As vLLM does by default: the stop token is the last id, and its text is not output (with
    stop strings, which stream the text, and without)."""
    target, draft, _ = models
    ref = baseline.generate(PROMPTS[3], SamplingParams(max_tokens=40))[0].token_ids
    stop = ref[13]
    first = ref.index(stop)
    tokenizer = CharTokenizer()
    llm = LLM(target, draft, dtype="float32", tokenizer=tokenizer)
    out = llm.generate(PROMPTS[3], SamplingParams(max_tokens=40, stop_token_ids=[stop],
                                                  stop=stop_string or ()))[0]
    assert out.token_ids == ref[:first + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert out.text == tokenizer.decode(ref[:first])


def test_sampling_is_reproducible_with_a_seed(models):
    """A seed reproduces its tokens under the same verify schedule (an adaptive schedule follows
    the engine's acceptance history, so this holds for the fixed one)."""
    target, draft, _ = models
    llm = LLM(target, draft, dtype="float32", max_num_seqs=4, speculation="fixed")
    sp = SamplingParams(temperature=0.8, top_k=20, max_tokens=20, seed=1234)
    a = [o.token_ids for o in llm.generate(PROMPTS[:3], sp)]
    b = [o.token_ids for o in llm.generate(PROMPTS[:3], sp)]
    c = [o.token_ids for o in llm.generate(PROMPTS[:3], SamplingParams(temperature=0.8, top_k=20,
                                                                         max_tokens=20, seed=99))]
    assert a == b and a != c


@pytest.mark.parametrize("draft_sampling", ["greedy", "sample"])
def test_seeded_sampling_is_independent_of_batch_and_concurrency(models, draft_sampling):
    """Under the fixed schedule a seeded request's tokens do not depend on what runs with it:
    alone, in a batch of 8 (greedy and other temperatures beside it, requests finishing at
    different steps) and with 3 running at a time give the same tokens."""
    target, draft, _ = models
    sp = [SamplingParams(temperature=0.0 if i == 5 else 0.6 + 0.1 * i, top_k=30 * (i % 2),
                         max_tokens=12 + 3 * i, seed=1000 + i) for i in range(len(PROMPTS))]

    def run(max_num_seqs, prompts, params):
        llm = LLM(target, draft, dtype="float32", max_num_seqs=max_num_seqs,
                  speculation="fixed", draft_sampling=draft_sampling)
        return [o.token_ids for o in llm.generate(prompts, params)]

    alone = [run(1, [p], [s])[0] for p, s in zip(PROMPTS, sp)]
    assert run(8, PROMPTS, sp) == alone
    assert run(3, PROMPTS[::-1], sp[::-1]) == alone[::-1]
    other_seeds = [SamplingParams(**{**vars(s), "seed": s.seed + 100}) for s in sp]
    # every sampled request's tokens have probability < 1e-10 here: other seeds give other
    # tokens, except for the greedy request, which ignores its seed
    changed = [a != b for a, b in zip(run(8, PROMPTS, other_seeds), alone)]
    assert changed == [i != 5 for i in range(len(PROMPTS))]


def test_a_prompt_prefills_alike_whatever_it_is_batched_with(tmp_path):
    """Prompts that together pass PANEL_MAX_ROWS rows (past it a linear takes torch's blocked
    GEMM, which sums a long dot product in another order than panel_linear) prefill each as it
    prefills alone: the same target K/V and draft context bit for bit, so what a request decodes
    cannot depend on the requests admitted with it."""
    make_tiny_target(tmp_path / "target", intermediate_size=1536)
    make_tiny_draft(tmp_path / "draft", tmp_path / "target", num_layers=1, block_size=B)
    llm = LLM(tmp_path / "target", tmp_path / "draft", dtype="float32", max_num_seqs=3)
    n = PANEL_MAX_ROWS // 3 + 60
    prompts = [[(5 * j + 11 * i) % 90 + 1 for j in range(n)] for i in range(3)]

    def prefilled(batch):
        """Each prompt's target K/V and draft context after one prefill of `batch`."""
        requests = [Request(i, p, SamplingParams(), 0, frozenset()) for i, p in enumerate(batch)]
        for r in requests:
            assert llm.allocator.grow(r.block_table, n)
        llm.worker.prefill(requests)
        caches = (llm.worker.target_cache, llm.worker.draft_cache)
        out = [[c[:, :, r.block_table].flatten(2, 3)[:, :, :n].clone() for c in caches]
               for r in requests]
        for r in requests:
            llm.allocator.free(r.block_table)
        return out

    alone = [prefilled([p])[0] for p in prompts]
    together = prefilled(prompts)
    for a, b in zip(alone, together):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("lengths, passes", [
    ([], []), ([5], [[0]]), ([300, 700, 24, 2000, 5, 6], [[0, 1, 2], [3], [4, 5]]),
    ([1024, 1, 1023, 2], [[0], [1, 2], [3]])])
def test_prefill_passes_fill_up_to_the_limit(lengths, passes):
    assert prefill_passes(lengths, 1024) == passes


def test_no_cache_leak_after_200_requests(models):
    target, draft, _ = models
    llm = LLM(target, draft, dtype="float32", max_num_seqs=16)
    prompts = [PROMPTS[i % 8] for i in range(200)]
    outs = llm.generate(prompts, [SamplingParams(max_tokens=1 + i % 7) for i in range(200)])
    assert [len(o.token_ids) for o in outs] == [1 + i % 7 for i in range(200)]
    assert llm.allocator.num_free == llm.allocator.num_blocks


def test_requests_wait_for_cache_blocks(models, baseline):
    target, draft, _ = models
    # room for about one sequence at a time: the others wait, outputs are unchanged
    llm = LLM(target, draft, dtype="float32", max_num_seqs=4, kv_block_size=4,
              num_kv_blocks=16, max_model_len=64)
    sp = SamplingParams(max_tokens=30)
    assert [o.token_ids for o in llm.generate(PROMPTS[:3], sp)] == \
        [o.token_ids for o in baseline.generate(PROMPTS[:3], sp)]


def test_a_request_larger_than_the_cache_is_a_clear_error(models):
    target, draft, _ = models
    llm = LLM(target, draft, dtype="float32", kv_block_size=4, num_kv_blocks=5)
    with pytest.raises(ValueError, match="does not fit in the 5 cache blocks of 4 tokens"):
        llm.generate(PROMPTS[0], SamplingParams(max_tokens=100))
    assert llm.allocator.num_free == llm.allocator.num_blocks


def test_guards(models):
    target, draft, _ = models
    with pytest.raises(ValueError, match="context parallelism"):
        LLM(target, draft, cp_size=2)
    llm = LLM(target, draft, dtype="float32", max_model_len=32)
    with pytest.raises(ValueError, match="prompt of 32 tokens does not fit"):
        llm.generate([list(range(1, 33))])
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate("hello")
    with pytest.raises(ValueError, match="token ids must be in"):
        llm.generate([[1, 500]])


def test_draft_vocabulary_limits_proposals_and_stays_lossless(models, baseline, tmp_path):
    import json
    import shutil
    target, draft, _ = models
    shutil.copytree(draft, tmp_path / "draft")
    vocab = list(range(0, 96, 2))
    (tmp_path / "draft" / "draft_vocab.json").write_text(json.dumps({"token_ids": vocab}))
    # fixed: every step drafts (the adaptive planner may skip every draft on a loaded host)
    llm = LLM(target, tmp_path / "draft", dtype="float32", max_num_seqs=4, speculation="fixed")
    proposed = []
    llm.worker.proposer = lambda inputs: proposed.append(llm.worker.draft_forward(inputs)) or \
        proposed[-1]
    sp = SamplingParams(max_tokens=24)
    assert [o.token_ids for o in llm.generate(PROMPTS[:4], sp)] == \
        [o.token_ids for o in baseline.generate(PROMPTS[:4], sp)]
    assert set(torch.cat([d.flatten() for d, _ in proposed]).tolist()) <= set(vocab)
    llm.worker.draft_sampling = "sample"
    drafts, q = llm.worker.draft_forward(llm.worker.block_inputs(
        [r for r in _running(llm, PROMPTS[:2])]))
    assert torch.allclose(q.sum(-1), torch.ones(())) and (q[..., 1::2] == 0).all()


def _running(llm, prompts):
    """Requests after prefill, ready for a decode step."""
    params = SamplingParams(temperature=1.0, seed=0)
    requests = [llm.engine.processor.request(p, params) for p in prompts]
    for r in requests:
        llm.allocator.grow(r.block_table, len(r.prompt_ids) + 32)
    for r, t in zip(requests, llm.worker.prefill(requests)):
        r.append([t])
    return requests


@pytest.fixture(scope="module")
def small_vocabulary(tmp_path_factory):
    return make_small_vocabulary(tmp_path_factory.mktemp("small_vocabulary"))


def _second_token_pvalue(small_vocabulary, draft_sampling, n):
    return second_token_pvalue(small_vocabulary, n, draft_sampling=draft_sampling,
                               speculation="fixed")


@pytest.mark.parametrize("draft_sampling", ["greedy", "sample"])
def test_sampled_tokens_follow_the_target_distribution(small_vocabulary, draft_sampling):
    """The second token's marginal is the target's own (chi-square, significance 1e-3)."""
    n = 3000
    pvalue, metrics = _second_token_pvalue(small_vocabulary, draft_sampling, n)
    assert pvalue > 1e-3
    # speculation really happened: about 0.09 n drafts (greedy) and 2.4 n (sampled) are accepted
    # here; n / 20 is about 7 standard deviations below the smaller
    assert metrics["num_accepted_tokens"] > n // 20


def test_chi_square_catches_coins_that_reuse_the_race_noise(small_vocabulary, monkeypatch):
    """Negative control: acceptance coins taken from the words of the target's race (the two
    streams made dependent) bias the resampled token; the same test must fail. Here a rejected
    draft means a large coin for element 0, hence a large Exp(1) for token 0, which then rarely
    wins the race: its frequency falls from 0.074 to about 0.035. With twice the draws of the
    test above the chi-square statistic is expected near 165 (176 with these seeds), over 5
    standard deviations above the threshold of 31 (at 3000 draws about 3)."""
    from dflash.sampling import noise

    monkeypatch.setattr(noise, "COINS", noise.TARGET_RACE)
    pvalue, _ = _second_token_pvalue(small_vocabulary, "greedy", 6000)
    assert pvalue < 1e-3


def _step_until(llm, done, limit=400):
    outputs = []
    for _ in range(limit):
        outputs.append({o.request_id: o for o in llm.engine.step()})
        if done(outputs[-1]):
            return outputs
    raise AssertionError("the engine did not get there")


@pytest.mark.parametrize("speculation", ["fixed", "adaptive"])
def test_a_long_prompt_prefills_a_chunk_a_step_while_the_others_decode(models, baseline,
                                                                       speculation,
                                                                       monkeypatch):
    """A prompt of several PREFILL_CHUNKs prefills one chunk a step: the running request gets
    tokens every step meanwhile (it waited for the whole prefill), and both outputs are the
    target's own greedy continuations (transformers and target-only decoding)."""
    import dflash.engine.engine as engine_module

    monkeypatch.setattr(engine_module, "PREFILL_CHUNK", 64)
    target, draft, hf = models
    llm = LLM(target, draft, dtype="float32", max_num_seqs=4, speculation=speculation)
    engine, sp = llm.engine, SamplingParams(max_tokens=60, ignore_eos=True)
    short = engine.add_request(PROMPTS[3], sp)
    long_prompt = [(13 * j) % 90 + 1 for j in range(3 * 64 + 20)]
    _step_until(llm, lambda out: short in out)
    long = engine.add_request(long_prompt, SamplingParams(max_tokens=20))
    steps = _step_until(llm, lambda out: long in out)
    assert len(steps) == 4   # four chunks: three of 64 tokens, then 20 and the first token
    assert all(short in out and out[short].new_token_ids for out in steps[:3])
    outputs = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                outputs[o.request_id] = o.output.token_ids
    assert outputs[long] == baseline.generate([long_prompt], SamplingParams(max_tokens=20))[
        0].token_ids == hf_greedy(hf, long_prompt, 20)
    assert outputs[short] == hf_greedy(hf, PROMPTS[3], 60)
    assert llm.allocator.num_free == llm.allocator.num_blocks


def test_a_request_aborted_while_its_prompt_prefills_frees_its_blocks(models, monkeypatch):
    import dflash.engine.engine as engine_module

    monkeypatch.setattr(engine_module, "PREFILL_CHUNK", 64)
    target, draft, hf = models
    llm = LLM(target, draft, dtype="float32", max_num_seqs=1, speculation="fixed")
    engine = llm.engine
    long = engine.add_request([(13 * j) % 90 + 1 for j in range(200)],
                              SamplingParams(max_tokens=20))
    waiting = engine.add_request(PROMPTS[1], SamplingParams(max_tokens=12))
    engine.step()
    assert engine.num_running == 1 and engine.num_waiting == 1   # max_num_seqs holds
    assert engine.abort(long)
    outputs = {o.request_id: o for o in _step_until(llm, lambda out: waiting in out
                                                    and out[waiting].finished)[-1].values()}
    assert outputs[waiting].output.token_ids == hf_greedy(hf, PROMPTS[1], 12)
    assert llm.allocator.num_free == llm.allocator.num_blocks and not engine.has_unfinished()
