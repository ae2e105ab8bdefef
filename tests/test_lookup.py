"""The prompt lookup (dflash/engine/lookup.py) and its branch in draft trees (docs/design.md 4.6):
proposals against a brute-force search, grafting and ordering by gain, and greedy output equal to
target-only decoding with the lookup's nodes verified."""

import random
from types import SimpleNamespace

import pytest

from dflash import LLM, SamplingParams
from dflash.engine import lookup, tree
from dflash.engine.cost_model import CostModel
from dflash.engine.speculation import Planner

from helpers import make_tiny_pair

B = 8


def brute_force(tokens, length):
    """The latest start j < len(tokens) after the longest n <= MAX_MATCH with tokens[j-n:j] equal
    to the last n tokens, by trying every start."""
    best, at = 0, None
    for j in range(1, len(tokens)):
        n = 0
        while n < min(lookup.MAX_MATCH, j) and tokens[j - 1 - n] == tokens[-1 - n]:
            n += 1
        if n and n >= best:
            best, at = n, j
    return [] if at is None else tokens[at:at + length]


def test_the_lookup_copies_what_followed_the_longest_latest_match():
    tokens = [1, 2, 3, 9, 8, 3, 7, 1, 2, 3]
    proposal, priors = lookup.propose(tokens, 4)
    assert proposal == [9, 8, 3, 7]                # after the earlier "1 2 3", not after "3"
    assert priors == [lookup.FIRST_TOKEN_PRIOR[2] ** d for d in (1, 2, 3, 4)]
    assert lookup.propose([5, 6, 5, 7, 5], 3)[0] == [7, 5]   # the latest of equal matches
    assert lookup.propose([1, 2, 3, 4], 3) == ([], [])       # nothing repeats
    assert lookup.propose([4], 3) == ([], []) and lookup.propose([4, 4], 0) == ([], [])


@pytest.mark.parametrize("seed", range(30))
def test_the_lookup_equals_a_brute_force_search(seed):
    rng = random.Random(seed)
    tokens = [rng.randrange(4) for _ in range(rng.randrange(2, 60))]
    proposal, priors = lookup.propose(tokens, 5)
    assert proposal == brute_force(tokens, 5)
    assert len(priors) == len(proposal) and priors == sorted(priors, reverse=True)


def paths(t):
    def path(n):
        return () if n == 0 else path(t.parents[n]) + (t.tokens[n],)
    return [path(n) for n in range(len(t))]


def test_a_graft_follows_the_tree_where_it_can_and_branches_where_it_must():
    base = tree.best_first(0, [[5, 6], [7, 8]], [[0.6, 0.3], [0.5, 0.4]], 4)
    grafted = tree.graft(base, [5, 8, 9], [0.8, 0.6, 0.4], 10)
    assert grafted.tokens[:len(base)] == base.tokens and len(grafted) == len(base) + 1
    new = len(base)
    assert paths(grafted)[new] == (5, 8, 9) and grafted.scores[new] == 0.0
    on_path = [paths(grafted).index(p) for p in [(5,), (5, 8), (5, 8, 9)]]
    assert [grafted.lookup[n] for n in on_path] == [0.8, 0.6, 0.4]
    assert sum(p > 0 for p in grafted.lookup) == 3
    assert len(tree.graft(base, [6, 1, 2, 3], [0.5] * 4, len(base) - 1)) == len(base)  # full


@pytest.mark.parametrize("seed", range(10))
def test_ordering_by_gain_keeps_a_tree_whose_prefixes_are_trees(seed):
    rng = random.Random(seed)
    ids = [rng.sample(range(20), 3) for _ in range(4)]
    probs = [sorted((rng.random() for _ in range(3)), reverse=True) for _ in range(4)]
    t = tree.graft(tree.best_first(1, ids, probs, 12), [rng.randrange(20) for _ in range(6)],
                   [0.9 ** d for d in range(1, 7)], 40)
    gains = [rng.random() for _ in range(len(t) - 1)]
    ordered, sorted_gains = tree.by_gain(t, gains)
    assert sorted(paths(ordered)) == sorted(paths(t))   # the same nodes
    assert all(0 <= p < i for i, p in enumerate(ordered.parents) if i)
    assert list(sorted_gains) == sorted(sorted_gains, reverse=True)
    by_path = dict(zip(paths(ordered)[1:], sorted_gains))
    for node in range(1, len(t)):                  # capped by every ancestor's gain
        p = paths(t)[node]
        assert by_path[p] <= min(g for q, g in zip(paths(t)[1:], gains) if p[:len(q)] == q)


class AllCandidates:
    """A planner that drafts every step, offers 3 draft nodes a sequence and verifies every
    candidate: each lookup branch the worker grafts is verified."""

    def plan(self, requests):
        return [B - 1] * len(requests)

    def tree_size(self):
        return 3

    def choose_nodes(self, candidates, requests, drafting, depth):
        return candidates

    def observe(self, *args):
        pass

    observe_time = observe_trees = observe

    def forget(self, request_id):
        pass


def test_lookup_nodes_are_verified_and_greedy_output_stays_the_target_s(tmp_path):
    """Prompts that repeat themselves give the lookup matches: its nodes are verified, some
    accepted, and the output is target-only's, alone and in a batch."""
    models = make_tiny_pair(tmp_path, B)[:2]
    prompts = [[(3 * i + j) % 7 + 1 for j in range(30)] for i in range(3)]
    params = SamplingParams(max_tokens=60)
    expected = [o.token_ids for o in LLM(models[0], dtype="float32").generate(prompts, params)]
    for max_num_seqs in (1, 3):
        llm = LLM(*models, dtype="float32", max_num_seqs=max_num_seqs, speculation="adaptive")
        llm.engine.planner = AllCandidates()
        outs = llm.generate(prompts, params)
        assert [o.token_ids for o in outs] == expected
        m = llm.metrics()["tree_lookup_nodes"]
        assert m["verified"] > 0 and 0 < m["accepted"] <= m["verified"]
    # sampled requests walk trees with lookup children too, and a seeded one reproduces itself
    sampled = SamplingParams(max_tokens=40, temperature=0.8, seed=3)
    runs = []
    for _ in range(2):
        llm.reset_metrics()
        runs.append([o.token_ids for o in llm.generate(prompts, sampled)])
        assert llm.metrics()["tree_lookup_nodes"]["verified"] > 0
    assert runs[0] == runs[1]


def chain_and_branch():
    """A root with a draft chain 1-2 (scores 0.3, 0.2) and a lookup-only branch 7-8 (priors
    0.87, 0.76)."""
    base = tree.best_first(0, [[1], [2]], [[0.3], [0.67]], 2)
    return tree.graft(base, [7, 8], [0.87, 0.87 ** 2], 10)


def test_the_planner_takes_lookup_nodes_as_far_as_they_are_accepted():
    """The chooser calibrates the lookup's priors on the nodes only the lookup proposed: taught
    that they are always accepted it verifies them before the draft's; taught that they never
    are (the negative control), it drops them."""
    cost = CostModel({1: 1.0, 2: 1.1, 3: 1.2, 4: 5.0}, {1: 0.01}, B, {1: 1.0}, {1: 0.01})
    request = [SimpleNamespace(request_id=0, params=SamplingParams())]
    candidate = chain_and_branch()
    lookup_nodes = [n for n in range(1, len(candidate)) if candidate.scores[n] == 0.0]

    def trained(lookup_accepted: bool) -> list[tuple[int, ...]]:
        planner = Planner(B - 1, cost, trees=True)
        for _ in range(300):
            path = [0, *lookup_nodes] if lookup_accepted else [0]
            planner.observe_trees(request, [candidate], [path], [2], 1.0)
        chosen = planner.choose_nodes([candidate], request, 1, 2)[0]
        return paths(chosen)[1:]

    assert trained(True)[:2] == [(7,), (7, 8)]
    assert (7,) not in trained(False)
