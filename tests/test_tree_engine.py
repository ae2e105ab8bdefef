"""Draft trees in the engine (docs/design.md 4.6): construction, acceptance, the node chooser,
and greedy output equal to target-only decoding whatever trees are verified."""

import itertools
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from dflash import LLM, SamplingParams, sampling
from dflash.engine import RequestMetrics, tree
from dflash.engine.cost_model import CostModel
from dflash.engine.speculation import TREE_MARGIN, Planner
from dflash.engine.stats import Stats

from helpers import (
    RandomVerifySchedule,
    make_small_vocabulary,
    make_tiny_pair,
    second_token_pvalue,
)

B = 8
PROMPTS = [[(5 * i + 7 * j) % 90 + 1 for j in range(n)]
           for i, n in enumerate((5, 12, 3, 9, 17, 7, 4, 11))]


def ranked(seed, depths=4, k=3):
    """Random per-depth candidates: distinct ids, probabilities descending."""
    rng = random.Random(seed)
    ids = [rng.sample(range(100), k) for _ in range(depths)]
    probs = [sorted((rng.random() for _ in range(k)), reverse=True) for _ in range(depths)]
    return ids, probs


def all_paths(ids, probs):
    """Every node of the full tree: (score, token path)."""
    out = []
    for d in range(1, len(ids) + 1):
        for ranks in itertools.product(range(len(ids[0])), repeat=d):
            out.append((float(np.prod([probs[i][r] for i, r in enumerate(ranks)])),
                        tuple(ids[i][r] for i, r in enumerate(ranks))))
    return out


def paths_of(t):
    def path(n):
        return () if n == 0 else path(t.parents[n]) + (t.tokens[n],)
    return [path(n) for n in range(1, len(t))]


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("size", [1, 4, 13, 40])
def test_best_first_takes_the_highest_scoring_nodes_and_stays_a_tree(seed, size):
    ids, probs = ranked(seed)
    t = tree.best_first(7, ids, probs, size)
    assert len(t) == size + 1 and t.tokens[0] == 7 and t.parents[0] == -1
    assert all(0 <= p < i for i, p in enumerate(t.parents) if i)      # parents come first
    assert all(t.depths[i] == t.depths[t.parents[i]] + 1 for i in range(1, len(t)))
    assert t.scores[1:] == sorted(t.scores[1:], reverse=True)       # best-first order
    best = sorted(all_paths(ids, probs), reverse=True)
    assert sorted(t.scores[1:], reverse=True) == pytest.approx([s for s, _ in best[:size]])
    assert set(paths_of(t)) <= {p for _, p in all_paths(ids, probs)}
    assert len(set(paths_of(t))) == size                            # no node twice


def test_one_candidate_per_depth_is_the_chain():
    ids, probs = [[5], [6], [7]], [[0.9], [0.5], [0.4]]
    t = tree.best_first(1, ids, probs, 10)
    assert t.tokens == [1, 5, 6, 7] and t.parents == [-1, 0, 1, 2]


def test_greedy_acceptance_follows_the_target_s_argmax():
    # root -> a(1) -> c(3); root -> b(2) -> d(4)
    t = tree.Tree([0, 10, 20, 11, 21], [-1, 0, 0, 1, 2], [0, 1, 1, 2, 2], [1, .5, .4, .3, .2])
    assert tree.accept_greedy(t, [20, 99, 21, 99, 99]) == [0, 2, 4]
    assert tree.accept_greedy(t, [10, 11, 0, 5, 0]) == [0, 1, 3]
    assert tree.accept_greedy(t, [30, 0, 0, 0, 0]) == [0]


def test_a_sampled_walk_tries_children_in_order_on_the_residual():
    # root -> a(10), b(20); a -> c(11); masses: a 0.4 and b 0.3 in the root's, c 0.5 in a's
    t = tree.Tree([0, 10, 20, 11], [-1, 0, 0, 1], [0, 1, 1, 2], [1, .5, .3, .2])
    totals, masses = [1.0, 1.0, 1.0, 1.0], [0.4, 0.3, 0.5]
    # 0.5 * 1.0 >= 0.4 rejects a; then 0.7 * (1.0 - 0.4) >= 0.3 rejects b: the root's residual
    assert tree.walk_sampled(t, totals, masses, [[0.5, 0.7], [0.0]]) == ([0], [10, 20])
    # a rejected, then 0.4 * 0.6 < 0.3 accepts b, a leaf
    assert tree.walk_sampled(t, totals, masses, [[0.5, 0.4], [0.0]]) == ([0, 2], [])
    # 0.3 accepts a; at a, 0.6 >= 0.5 rejects c
    assert tree.walk_sampled(t, totals, masses, [[0.3, 0.0], [0.6]]) == ([0, 1], [11])


def test_the_chooser_is_the_brute_force_optimum():
    rng = random.Random(0)
    for _ in range(30):
        gains = [sorted((rng.random() for _ in range(rng.randint(0, 4))), reverse=True)
                 for _ in range(rng.randint(1, 3))]
        a, b = rng.random(), rng.random() * 0.3
        cost = lambda rows, a=a, b=b: a + b * np.asarray(rows)  # noqa: E731
        counts = tree.choose_nodes(gains, cost)
        n = len(gains)
        best = max((n + sum(sum(g[:c]) for g, c in zip(gains, cs))) / cost(n + sum(cs))
                   for cs in itertools.product(*[range(len(g) + 1) for g in gains]))
        got = (n + sum(sum(g[:c]) for g, c in zip(gains, counts))) / cost(n + sum(counts))
        assert got == pytest.approx(best)


def test_flat_costs_grow_trees_and_steep_ones_take_none():
    gains = [[0.9, 0.6, 0.5, 0.3, 0.2, 0.1]]
    assert tree.choose_nodes(gains, lambda rows: np.ones(np.shape(rows))) == [6]
    assert tree.choose_nodes(gains, lambda rows: np.asarray(rows, dtype=float)) == [0]


def test_the_planner_offers_twice_the_nodes_it_took_lately():
    """Building candidates costs per node: the planner offers twice what a sequence took lately
    plus a margin, shrinking while it takes none and doubling when it takes every one."""
    steep = CostModel({1: 1e-3, 64: 1.0}, {1: 1e-4, 8: 1e-4}, B, {1: 1e-3, 8: 1e-3})
    flat = CostModel({1: 1e-3, 64: 1e-3}, {1: 1e-4, 8: 1e-4}, B, {1: 1e-3, 8: 1e-3})
    def star(n, score):   # a root and n candidates at depth 1
        return tree.Tree([0] * (n + 1), [-1] + [0] * n, [0] + [1] * n, [1.0] + [score] * n)

    planner = Planner(B - 1, steep)
    assert planner.tree_size() == tree.MAX_NODES
    for _ in range(tree.MAX_NODES):
        assert sizes(planner.choose_nodes([star(planner.tree_size(), 0.5)], requests(1), 1, 1)) \
            == [0]
    assert planner.tree_size() == TREE_MARGIN
    planner.cost_model = flat
    assert sizes(planner.choose_nodes([star(planner.tree_size(), 0.9)], requests(1), 1, 1)) == \
        [TREE_MARGIN]
    assert planner.tree_size() == 3 * TREE_MARGIN


def sizes(trees):
    """Draft nodes of each tree."""
    return [len(t) - 1 for t in trees]


def requests(n):
    """Planner-side stand-ins of n greedy requests."""
    return [SimpleNamespace(request_id=i, params=SamplingParams()) for i in range(n)]


def test_greedy_and_sampled_requests_calibrate_apart():
    """At the same draft confidence a sampled request's target token matches the draft's less
    often than a greedy one's: the chooser learns each kind's acceptance from its own trees and
    sizes the two requests' trees apart. With both kinds accepting alike (the negative control),
    it sizes them alike."""
    rows = CostModel({1: 1.0, 64: 2.26}, {1: 0.1}, B, {1: 1.0}, {1: 0.1})   # 0.02 s a row
    star = tree.Tree([0] * 9, [-1] + [0] * 8, [0] + [1] * 8, [1.0] + [0.45] * 8)
    greedy, sampled = requests(1), [SimpleNamespace(request_id=1,
                                                    params=SamplingParams(temperature=0.7))]

    seconds = float(rows.decode(2) + rows.extra(2, 18) + rows.draft(2, 1))   # as priced

    def trained(sampled_accepts: bool) -> list[int]:
        planner = Planner(B - 1, rows, trees=True)
        # greedy: one of the 8 children accepted every step; sampled: every 8th step
        for step in range(300):
            hit = [0, 1] if sampled_accepts or step % 8 == 0 else [0]
            planner.observe_trees(greedy + sampled, [star, star], [[0, 1], hit], [1, 1], seconds)
        return sizes(planner.choose_nodes([star, star], greedy + sampled, 2, 1))

    apart = trained(sampled_accepts=False)
    assert apart[0] > apart[1]
    alike = trained(sampled_accepts=True)
    assert alike[0] == alike[1]


def test_the_tree_planner_prices_the_draft_pass_a_tree_step_runs():
    """A tree step's draft pass reaches tree.EXTRA_DEPTH positions beyond the chain length
    planned (`tree.depth_limits`): one draft is nearly free here and three cost most of a step,
    so a chain of one pays and the same plan as a tree step does not."""
    model = CostModel({1: 1.0, 64: 1.0}, {1: 2.0}, B, {1: 1.0}, {1: 0.05})
    assert model.draft(1, 1 + tree.EXTRA_DEPTH) > 0.5
    plans = {}
    for trees in (False, True):
        planner = Planner(B - 1, model, trees=trees)
        for step in range(40):   # the first draft accepted every other step, never the second
            planner.observe(requests(1), [B - 1], [step % 2])
        plans[trees] = planner.plan(requests(1))
    assert plans == {False: [1], True: [0]}


def test_a_tree_steps_time_is_fitted_with_its_draft_at_the_depth_it_reached():
    """Steps that take exactly what the cost model prices them at, a draft pass of 3 positions
    included, leave the time correction at the calibration."""
    model = CostModel({1: 1.0, 64: 2.0}, {1: 2.0, 4: 2.0}, B, {1: 1.0, 4: 1.0}, {1: 0.05, 4: 0.05})
    planner = Planner(B - 1, model, trees=True)
    chain = tree.Tree([5, 6, 7], [-1, 0, 1], [0, 1, 2], [1.0, 0.9, 0.8])
    root = tree.Tree([5], [-1], [0], [1.0])
    seconds = float(model.decode(2) + model.extra(2, 4) + model.draft(1, 3))
    for _ in range(300):
        planner.observe_trees(requests(2), [chain, root], [[0, 1], [0]], [3, 0], seconds)
    assert planner.time.a == pytest.approx(1.0, rel=0.01)
    assert planner.time.b == pytest.approx(1.0, rel=0.01)


def test_calibration_learns_acceptance_by_score():
    cal = tree.Calibration()
    assert cal([0.95], [1])[0] == pytest.approx(0.975)   # starts at the draft's own probability
    for _ in range(500):
        cal.observe([0.95, 0.05], [3, 3], [False, True])   # overconfident at depth 3
    assert cal([0.95], [3])[0] < 0.1 and cal([0.05], [3])[0] > 0.9
    assert cal([0.95], [5])[0] < 0.2        # a depth never seen borrows from the others
    for _ in range(500):                     # steps where depth 3 is overconfident, depth 1 right
        cal.observe([0.95, 0.95], [3, 1], [False, True])
    assert cal([0.95], [1])[0] > 0.8 and cal([0.95], [3])[0] < 0.2
    assert cal([0.95], [40])[0] == cal([0.95], [tree.DEPTHS])[0]   # deep ones share


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return make_tiny_pair(tmp_path_factory.mktemp("trees"), B)[:2]


def target_only(models, dtype):
    baseline = LLM(models[0], dtype=dtype, max_num_seqs=8)
    params = [SamplingParams(max_tokens=10 + 5 * i) for i in range(len(PROMPTS))]
    return [o.token_ids for o in baseline.generate(PROMPTS, params)]


@pytest.fixture(scope="module")
def expected(models):
    return target_only(models, "float32")


@pytest.mark.parametrize("max_num_seqs, dtype", [(1, "float32"), (3, "float32"), (8, "float32"),
                                                 (8, "bfloat16")])
def test_any_trees_give_target_only_greedy_output(models, expected, max_num_seqs, dtype):
    """float32, and bfloat16 too: every row of a verify pass is computed as in decoding."""
    if dtype != "float32":
        expected = target_only(models, dtype)
    llm = LLM(*models, dtype=dtype, max_num_seqs=max_num_seqs, speculation="adaptive")
    schedule = RandomVerifySchedule(max_num_seqs, k_max=B - 1)
    llm.engine.planner = schedule
    params = [SamplingParams(max_tokens=10 + 5 * i) for i in range(len(PROMPTS))]
    outs = llm.generate(PROMPTS, params)   # mixed lengths: requests join and leave
    assert [o.token_ids for o in outs] == expected
    sizes = [c for step in schedule.trees for c in step]
    assert max(sizes) > B - 1 and 0 in sizes   # trees larger than a block, and empty ones
    m = llm.metrics()
    assert m["tree_steps"] > 0 and max(m["tree_node_histogram"]) > B - 1
    assert llm.allocator.num_free == llm.allocator.num_blocks


def test_tree_steps_count_nodes_by_the_draft_confidence_in_them():
    """Stats bins each verified draft node by its path probability (bins of 1/20, the last
    closed) and counts it accepted when it lies on its tree's accepted path."""
    stats = Stats(B)
    requests = [SimpleNamespace(metrics=RequestMetrics()) for _ in range(2)]
    # node scores: root, 1.0 (bin 19), 0.5 (bin 10), 0.93 (bin 18, child of 1), 0.04 (bin 0)
    t1 = tree.Tree([5, 6, 7, 8, 9], [-1, 0, 0, 1, 2], [0, 1, 1, 2, 2], [1.0, 1.0, 0.5, 0.93, 0.04])
    t2 = tree.Tree([3], [-1], [0], [1.0])   # a sequence that did not draft
    stats.record_tree_step(requests, [t1, t2], [[0, 1, 3], [0]])
    c = stats.summary()["tree_confidence"]
    assert c["bin_upper"][0] == 0.05 and c["bin_upper"][-1] == 1.0 and len(c["bin_upper"]) == 20
    assert {i: n for i, n in enumerate(c["verified"]) if n} == {0: 1, 10: 1, 18: 1, 19: 1}
    assert {i: n for i, n in enumerate(c["accepted"]) if n} == {18: 1, 19: 1}
    assert stats.tree_nodes == {4: 1, 0: 1} and stats.tree_depths == {2: 1, 0: 1}
    assert stats.summary()["draft_skipped_steps"] == 0
    stats.record_tree_step(requests, [t2, t2], [[0], [0]])   # no sequence verified a node
    assert stats.summary()["draft_skipped_steps"] == 1 and stats.summary()["tree_steps"] == 2


def test_the_confidence_counts_add_up_to_the_nodes_verified_and_accepted(models):
    """llm.metrics()'s confidence bins hold every verified draft node once and every accepted
    one once, and its lookup counts every other node (those only the prompt lookup proposed):
    together their totals equal those of the node and accepted-depth histograms."""
    llm = LLM(*models, dtype="float32", max_num_seqs=3, speculation="adaptive")
    llm.engine.planner = RandomVerifySchedule(3, k_max=B - 1)
    llm.generate(PROMPTS, [SamplingParams(max_tokens=12)] * len(PROMPTS))
    m = llm.metrics()
    c, lookup = m["tree_confidence"], m["tree_lookup_nodes"]
    assert sum(c["verified"]) + lookup["verified"] == \
        sum(k * n for k, n in m["tree_node_histogram"].items()) > 0
    assert sum(c["accepted"]) + lookup["accepted"] == \
        sum(d * n for d, n in m["tree_accepted_depth_histogram"].items()) > 0
    assert all(a <= v for a, v in zip(c["accepted"], c["verified"]))
    assert lookup["accepted"] <= lookup["verified"]


def test_the_cache_after_tree_steps_equals_one_token_decoding(models):
    """Only the accepted paths' K/V remain, at the positions target-only decoding gives them."""
    llm = LLM(*models, dtype="float32", max_num_seqs=1, speculation="adaptive")
    llm.engine.planner = RandomVerifySchedule(5, k_max=B - 1)
    baseline = LLM(models[0], dtype="float32", max_num_seqs=1)
    caches = []
    for engine in (llm.engine, baseline.engine):
        engine.add_request(PROMPTS[4], SamplingParams(max_tokens=40, ignore_eos=True))
        while engine.running == [] or len(engine.running[0].output_ids) < 30:
            engine.step()
        r = engine.running[0]
        slots = torch.tensor([r.block_table[p // 16] * 16 + p % 16 for p in range(r.num_cached)])
        cache = engine.worker.target_cache
        caches.append((r.tokens[:r.num_cached],
                       cache.view(*cache.shape[:2], -1, *cache.shape[4:])[:, :, slots]))
        engine.abort(r.request_id)
        engine.step()
    (tokens, tree_kv), (base_tokens, base_kv) = caches
    n = min(len(tokens), len(base_tokens))
    assert tokens[:n] == base_tokens[:n] and n >= 28
    torch.testing.assert_close(tree_kv[:, :, :n], base_kv[:, :, :n], atol=1e-5, rtol=1e-5)


def test_the_planner_grows_trees_where_rows_are_free_and_chain_keeps_chains(models):
    """The real planner (node chooser, calibration, time fit) on a host where verify rows cost
    nothing: large trees, and still the target's own tokens."""
    llm = LLM(*models, dtype="float32", max_num_seqs=2, speculation="adaptive")
    flat = CostModel({1: 1e-3, 64: 1e-3}, {1: 1e-4, 8: 1e-4}, B, {1: 1e-3, 8: 1e-3})
    llm.engine.planner = Planner(B - 1, flat)
    # long requests: a tree takes no more slots than its request has left
    params = [SamplingParams(max_tokens=70 + 5 * i) for i in range(4)]
    expected = [o.token_ids for o in LLM(models[0], dtype="float32").generate(PROMPTS[:4],
                                                                              params)]
    outs = llm.generate(PROMPTS[:4], params)
    assert [o.token_ids for o in outs] == expected
    m = llm.metrics()
    assert m["speculation"] == "adaptive" and m["tree_steps"] > 0
    assert max(m["tree_node_histogram"]) == tree.MAX_NODES
    assert m["tree_calibration"]["greedy"]["acceptance"] != \
        tree.Calibration().as_dict()["acceptance"]
    assert m["tree_calibration"]["sampled"] == tree.Calibration().as_dict()   # none sampled
    chain = LLM(*models, dtype="float32", max_num_seqs=2, speculation="chain")
    chain.engine.planner = Planner(B - 1, flat)
    outs = chain.generate(PROMPTS[:4], params)
    assert [o.token_ids for o in outs] == expected
    assert chain.metrics()["tree_steps"] == 0 and chain.metrics()["speculation"] == "chain"


@pytest.fixture(scope="module")
def small_vocabulary(tmp_path_factory):
    return make_small_vocabulary(tmp_path_factory.mktemp("small_vocabulary"))


class FullTrees(RandomVerifySchedule):
    """A planner stand-in: every sequence drafts and verifies its whole candidate tree (up to 32
    nodes over a 12-token vocabulary: bushy)."""

    def plan(self, requests):
        return [self.k_max] * len(requests)

    def tree_size(self):
        return 32

    def choose_nodes(self, candidates, requests, drafting, depth):
        return candidates


def _bushy_trees(llm):
    llm.engine.planner = FullTrees(0, k_max=3)


def test_sampled_trees_keep_the_target_distribution(small_vocabulary):
    """The second token's marginal is the target's own (chi-square, significance 1e-3) when it
    comes from sampled tree verification."""
    n = 3000
    pvalue, metrics = second_token_pvalue(small_vocabulary, n, setup=_bushy_trees,
                                          speculation="adaptive")
    assert pvalue > 1e-3
    assert sum(metrics["tree_node_histogram"].values()) == n      # every second token
    assert max(metrics["tree_node_histogram"]) > 3
    assert metrics["num_accepted_tokens"] > n // 20


def test_chi_square_catches_a_residual_that_keeps_rejected_tokens(small_vocabulary,
                                                                  monkeypatch):
    """Negative control: a rejected child left in the residual gets a second chance, as a later
    sibling's rival and as the bonus token; the same test must fail."""
    from dflash.engine import worker

    monkeypatch.setattr(worker, "reject", lambda residual, token: residual)
    pvalue, _ = second_token_pvalue(small_vocabulary, 3000, setup=_bushy_trees,
                                    speculation="adaptive")
    assert pvalue < 1e-3


def test_sampled_roots_alone_draw_what_a_plain_sampled_step_draws(models):
    """A step can verify trees of their roots alone (the chooser took no node): sampled requests
    then emit the token a target-only step draws from the same distribution, seed and position
    (`sampling.sample`'s race), and their paths are the roots."""
    llm = LLM(*models, dtype="float32", max_num_seqs=4, speculation="adaptive")
    params = [SamplingParams(temperature=t, seed=s) for t, s in ((0.8, 3), (1.0, 4), (0.5, 5))]
    requests = [llm.engine.processor.request(p, sp) for p, sp in zip(PROMPTS, params)]
    for r, n in zip(requests, (5, 9, 2)):
        r.num_cached, r.output_ids = n, [7]
    trees = [tree.Tree([7], [-1], [0], [1.0]) for _ in requests]
    logits = torch.randn(3, llm.target.cfg.vocab_size, generator=torch.Generator().manual_seed(0))
    emitted, paths = llm.worker.accept_trees(requests, trees, logits)
    probs = sampling.target_probs(logits[:, None], params)[:, 0]
    drawn = sampling.sample(probs, torch.zeros(3, dtype=torch.bool), [3, 4, 5], [6, 10, 3])
    assert paths == [[0]] * 3
    assert emitted == [[t] for t in drawn.tolist()]


def test_full_trees_stop_at_max_model_len_with_target_only_tokens(models):
    """Trees near max_model_len (the prompt lookup's branch included) reach no deeper than the
    positions left, and each request's acceptance per position has one entry per block
    position, however many nodes its trees held."""
    target, draft = models
    sp = SamplingParams(max_tokens=500, ignore_eos=True)
    prompts = PROMPTS[:4] + [[5, 6, 7] * 4]   # a repeating prompt: the lookup proposes
    ref = [o.token_ids for o in LLM(target, dtype="float32", max_num_seqs=5,
                                    max_model_len=40).generate(prompts, sp)]
    llm = LLM(target, draft, dtype="float32", max_num_seqs=5, max_model_len=40,
              speculation="adaptive")
    llm.engine.planner = FullTrees(0, k_max=B - 1)
    outs = llm.generate(prompts, sp)
    assert [o.token_ids for o in outs] == ref
    assert all(len(p) + len(o.token_ids) == 40 for p, o in zip(prompts, outs))
    assert max(llm.metrics()["tree_node_histogram"]) > B
    assert all(len(o.metrics.accepted_per_position) <= B - 1 for o in outs)


def test_greedy_requests_in_a_batch_with_sampled_ones_stay_exact(models, expected):
    llm = LLM(*models, dtype="float32", max_num_seqs=8, speculation="adaptive")
    llm.engine.planner = FullTrees(0, k_max=B - 1)
    params = [SamplingParams(max_tokens=10 + 5 * i) if i % 2 == 0 else
              SamplingParams(max_tokens=10 + 5 * i, temperature=0.8, seed=i)
              for i in range(len(PROMPTS))]
    outs = llm.generate(PROMPTS, params)
    assert [outs[i].token_ids for i in range(0, len(PROMPTS), 2)] == expected[::2]
    assert all(len(outs[i].token_ids) == 10 + 5 * i for i in range(1, len(PROMPTS), 2))
    again = llm.generate(PROMPTS, params)   # seeded sampled requests reproduce themselves
    assert [o.token_ids for o in again] == [o.token_ids for o in outs]
    assert llm.metrics()["tree_steps"] > 0
