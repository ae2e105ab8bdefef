"""How many drafts each sequence verifies this step: the choice that maximises expected committed
tokens per second under the host's measured cost model.

Verifying the first k drafts of a sequence commits 1 + E[accepted] tokens, where
E[accepted] = sum_{j<=k} P(drafts 1..j all accepted), and costs k more verify rows. A step over n
sequences with k_i verified drafts each costs the cost model's decode(n), plus what the
n + sum k_i rows add to it, plus draft(#{k_i > 0}, max k_i) (`CostModel.step`). Speculation
that cannot pay on this host (expensive rows, low acceptance, large batches) is thereby switched
off by itself, and turned back on when it pays again.

Acceptance is estimated per draft position as the conditional probability that draft j is
accepted given that drafts 1..j-1 were, exponentially weighted, per request (starting from, and
drifting back to, the engine-wide estimate) and engine-wide. The cost model is corrected by the
measured time of every step: measured = a * decode part + b * speculation part, a and b fitted
online (`TimeCorrection`), so that a calibration taken at another context length or layout, or
on a busier machine, is not taken at its word. Choosing k from past acceptance and
timings only (never from the current drafts) keeps verification exact: greedy output is the
target's own, and sampled output keeps the target distribution.
"""

from __future__ import annotations

import numpy as np

from . import tree

PRIOR = 0.75            # conditional acceptance assumed before anything is observed
REQUEST_ALPHA = 0.2     # weight of one observation in a request's own estimate
ENGINE_ALPHA = 0.02     # ... in the engine-wide estimate
RELAX = 0.05            # per unobserved step, how far a request's estimate drifts to the engine's
PROBE_EVERY = 64        # steps with speculation off before one sequence verifies a full block
TIME_ALPHA = 0.05       # weight of one step in the time correction's moments
TIME_RIDGE = 0.01       # pull of the calibration (a = b = 1), relative to each part's own data
TIME_OUTLIER = 4.0      # a step is counted as at most this many times its prediction (or 1/x)
TIME_LIMITS = (0.1, 100.0)   # how far the fit may move a and b from the calibration
TREE_MARGIN = 8         # candidate nodes built beyond twice the most a sequence took lately
KINDS = ("greedy", "sampled")   # requests whose tree nodes are calibrated apart


def kind_of(request) -> str:
    """The calibration a request's tree nodes go by (KINDS)."""
    return "greedy" if request.params.is_greedy else "sampled"


class Acceptance:
    """Conditional acceptance rates of draft positions 1..K, exponentially weighted."""

    def __init__(self, rates: list[float]):
        self.rates = list(rates)

    def observe(self, verified: int, accepted: int, alpha: float) -> None:
        """A step verified `verified` drafts and accepted the first `accepted`: positions
        1..accepted were accepted, position accepted + 1 (if verified) rejected, the rest unseen."""
        for j in range(min(accepted + 1, verified)):
            hit = 1.0 if j < accepted else 0.0
            self.rates[j] += alpha * (hit - self.rates[j])

    def relax_to(self, other: Acceptance, weight: float) -> None:
        self.rates = [a + weight * (b - a) for a, b in zip(self.rates, other.rates)]

    def cumulative(self) -> list[float]:
        """P(drafts 1..j all accepted) for j = 1..K, with each conditional rate capped by the
        ones before it: later drafts are rarely better than earlier ones, and positions that were
        never verified would otherwise keep their optimistic prior."""
        out, p, cap = [], 1.0, 1.0
        for r in self.rates:
            cap = min(cap, r)
            p *= cap
            out.append(p)
        return out


def choose_num_drafts(cumulative: list[list[float]], target_cost, draft_cost) -> list[int]:
    """Verify lengths k_i maximising (n + sum_i sum_{j<=k_i} cumulative[i][j-1]) /
    (target_cost(n + sum k_i) + draft_cost(#{k_i > 0}, max k_i)). Both costs are called with
    numpy arrays of every choice at once.

    Each row of `cumulative` is non-increasing, so for a given total of verified drafts among a
    given set of drafting sequences the most valuable choice takes the largest values, a prefix
    of each row. For each d, the d sequences most likely to accept their first draft form the
    set, and every prefix of their values in decreasing order is scored (all d at once, from
    one sort of all the values). With d = n this visits the best choice for every total, so
    the result is the exact optimum when draft_cost depends only on whether any sequence
    drafts, and near it when it grows with their number or their longest verify."""
    n = len(cumulative)
    if n == 0 or not cumulative[0]:
        return [0] * n
    values = np.asarray(cumulative, dtype=np.float64)
    k = values.shape[1]
    totals = np.arange(n, n + n * k + 1)
    target = _full(target_cost(totals), totals.shape)
    drafting = np.arange(1, n + 1)
    # draft_cost priced once per (drafting, longest) pair, [n + 1, k + 1], and looked up
    draft = _full(draft_cost(np.arange(n + 1)[:, None], np.arange(k + 1)[None, :]), (n + 1, k + 1))
    by_first = np.argsort(-values[:, 0], kind="stable")
    rank = np.empty(n, dtype=np.int64)
    rank[by_first] = np.arange(n)
    flat = values.ravel()
    order = np.argsort(-flat, kind="stable")   # row-major ties keep each row's prefix
    # an upper bound of every choice verifying m drafts: the m best values, at the draft cost of
    # the fewest sequences that can hold m drafts, one draft each; when it cannot beat no
    # speculation (large batches, low acceptance), the [n, n*k] search below is skipped
    m = np.arange(1, n * k + 1)
    cheapest = np.minimum.accumulate(draft[:0:-1, 1])[::-1]   # the least cost of >= d sequences
    if ((n + np.cumsum(flat[order])) / (target[1:] + cheapest[(m - 1) // k])).max() <= \
            n / target[0]:
        return [0] * n
    row = order // k
    # member[d - 1, j]: the j-th largest value is one of the first d sequences' (by first value)
    member = rank[row][None, :] < drafting[:, None]
    # a row's values are taken in order, so taking order[j] makes its row verify order[j] % k + 1
    longest = np.maximum.accumulate(np.where(member, order % k + 1, 0), axis=1)
    started = np.cumsum(member & (order % k == 0), axis=1)   # sequences that draft
    gains = np.cumsum(np.where(member, flat[order], 0.0), axis=1)
    rates = np.where(member, (n + gains) / (target[np.cumsum(member, axis=1)] +
                                            draft[started, longest]), -np.inf)
    d, j = np.unravel_index(int(np.argmax(rates)), rates.shape)
    if rates[d, j] <= n / target[0]:
        return [0] * n
    return np.bincount(row[: j + 1][member[d, : j + 1]], minlength=n).tolist()


def _full(costs, shape) -> np.ndarray:
    """costs as a float64 array of `shape` (a cost function may return a scalar)."""
    costs = np.asarray(costs, dtype=np.float64)
    return costs if costs.shape == shape else np.broadcast_to(costs, shape)


class TimeCorrection:
    """Measured step time ~ a * (its predicted decode part) + b * (its predicted speculation
    part: extra rows and draft), a and b fitted by exponentially weighted least squares with a
    small pull towards the calibration (a = b = 1) that is relative to each part's share of the
    data, so a part that is small or never seen stays near its calibration and an ambiguous fit
    (every step alike) shares the misfit. Steps without speculation pin a; speculating steps
    then pin b. One factor per kind of step would instead fold a mismatch of the decode part
    (longer contexts than calibrated, another batch layout) into the price of speculating."""

    def __init__(self):
        self.a = self.b = 1.0
        # exponentially weighted moments: x0^2, x0 x1, x1^2, x0 y, x1 y (x the step's two
        # predicted parts over their sum, y its measured time over that sum); plain floats, as
        # every step updates them
        self._xx = [0.0, 0.0, 0.0]
        self._xy = [0.0, 0.0]

    def observe(self, decode: float, speculation: float, seconds: float) -> None:
        scale = decode + speculation   # every step weighs alike, however long
        x0, x1 = decode / scale, speculation / scale
        predicted = self.a * x0 + self.b * x1
        y = min(max(seconds / scale, predicted / TIME_OUTLIER), predicted * TIME_OUTLIER)
        xx, xy = self._xx, self._xy
        for i, v in enumerate((x0 * x0, x0 * x1, x1 * x1)):
            xx[i] += TIME_ALPHA * (v - xx[i])
        for i, v in enumerate((x0 * y, x1 * y)):
            xy[i] += TIME_ALPHA * (v - xy[i])
        p0, p1 = TIME_RIDGE * (xx[0] + 1e-6), TIME_RIDGE * (xx[2] + 1e-6)
        # the 2 x 2 ridge system [[xx0 + p0, xx1], [xx1, xx2 + p1]] (a, b) = (xy0 + p0, xy1 + p1)
        m00, m01, m11 = xx[0] + p0, xx[1], xx[2] + p1
        r0, r1 = xy[0] + p0, xy[1] + p1
        det = m00 * m11 - m01 * m01
        a, b = (r0 * m11 - m01 * r1) / det, (m00 * r1 - m01 * r0) / det
        self.a, self.b = (min(max(v, TIME_LIMITS[0]), TIME_LIMITS[1]) for v in (a, b))

    def as_dict(self) -> dict[str, float]:
        return {"decode": round(self.a, 4), "speculation": round(self.b, 4)}


class Planner:
    """Per-step verify lengths for the running requests, learned from their acceptance."""

    def __init__(self, num_positions: int, cost_model, trees: bool = False):
        self.k_max, self.cost_model = num_positions, cost_model
        # whether steps verify trees, whose draft pass reaches as deep as `tree.depth_limits`
        # says (beyond the chain length chosen here), and is priced so
        self.trees = trees
        self.engine = Acceptance([PRIOR] * num_positions)
        self._requests: dict[int, Acceptance] = {}
        self._off_steps = 0
        self._probe = 0
        self.time = TimeCorrection()
        # the draft's confidence calibrated apart for greedy and for sampled requests: a sampled
        # target token matches the draft's less often at the same confidence (design.md 4.6)
        self.calibrations = {kind: tree.Calibration() for kind in KINDS}
        # and the lookup's priors (design.md 4.6), likewise
        self.lookups = {kind: tree.Calibration() for kind in KINDS}
        self._largest = tree.MAX_NODES   # the most nodes a sequence took lately (tree_size)

    def plan(self, requests) -> list[int]:
        estimates = [self._estimate(r.request_id) for r in requests]
        ks = choose_num_drafts([e.cumulative() for e in estimates],
                               *step_costs(self.cost_model, len(requests), self.time, self.k_max,
                                           self.trees))
        if any(ks):
            self._off_steps = 0
        else:
            self._off_steps += 1
            if self._off_steps >= PROBE_EVERY:   # look again: acceptance may have changed
                self._off_steps = 0
                self._probe = (self._probe + 1) % len(ks)
                ks[self._probe] = self.k_max
        return ks

    def observe(self, requests, num_drafts: list[int], accepted: list[int]) -> None:
        for r, k, a in zip(requests, num_drafts, accepted):
            estimate = self._estimate(r.request_id)
            if k == 0:
                estimate.relax_to(self.engine, RELAX)
                continue
            estimate.observe(k, a, REQUEST_ALPHA)
            self.engine.observe(k, a, ENGINE_ALPHA)

    def observe_time(self, num_drafts: list[int], seconds: float) -> None:
        """Correct the cost model by a step's measured time."""
        decode, extra, draft = self.cost_model.step_tables(len(num_drafts), self.k_max)
        self.time.observe(decode, float(extra[sum(num_drafts)] + draft[
            sum(k > 0 for k in num_drafts), max(num_drafts, default=0)]), seconds)

    def tree_size(self) -> int:
        """Candidate nodes to build per drafting sequence: twice the most a sequence took
        lately, and a margin (building costs per node, and the chooser seldom takes more than it
        lately did; one that takes every candidate doubles the next offer)."""
        return min(tree.MAX_NODES, 2 * self._largest + TREE_MARGIN)

    def choose_nodes(self, candidates: list[tree.Tree], requests, drafting: int, depth: int
                     ) -> list[tree.Tree]:
        """The trees `requests` verify in a step whose draft pass ran for `drafting` of them
        over `depth` positions: of their candidate trees, the nodes of highest expected
        acceptance (the draft's path probability, or the lookup's prior, calibrated for the
        request's kind and the node's depth; the larger where both propose a node), as many as
        pay under the corrected cost of verify rows and of the draft pass
        (`tree.choose_nodes`)."""
        sequences = len(requests)
        decode, _, draft = self.cost_model.step_tables(sequences, self.k_max)
        a, b = self.time.a, self.time.b
        ranked = [tree.by_gain(t, self._gains(t, kind_of(r)))
                  for t, r in zip(candidates, requests)]
        counts = tree.choose_nodes(
            [gains for _, gains in ranked],
            lambda rows: a * decode + b * (self.cost_model.extra(sequences, rows) +
                                           draft[drafting, depth]),
            sequences)
        self._largest = max(max(counts, default=0), self._largest - 1)
        return [t.prefix(count + 1) for (t, _), count in zip(ranked, counts)]

    def _gains(self, candidate: tree.Tree, kind: str) -> np.ndarray:
        depths = candidate.depths[1:]
        scores = np.asarray(candidate.scores[1:], dtype=np.float64)
        gains = np.where(scores > 0.0, self.calibrations[kind](scores, depths), 0.0)
        priors = np.asarray(candidate.lookup_priors()[1:], dtype=np.float64)
        if priors.any():
            gains = np.where(priors > 0.0,
                             np.maximum(gains, self.lookups[kind](priors, depths)), gains)
        return gains

    def observe_trees(self, requests, trees, paths, reach: list[int], seconds: float) -> None:
        """Learn from a tree step whose draft pass reached reach[i] positions for sequence i
        (0: it did not draft): the calibration of each request's kind from every verified
        node, the per-position acceptance as for a chain as deep as the tree, the time
        correction from its rows and its draft pass (priced as `plan` and `choose_nodes` price
        it)."""
        for kind in KINDS:
            mine = [i for i, r in enumerate(requests) if kind_of(r) == kind]
            for calibration, lookup in ((self.calibrations[kind], False),
                                        (self.lookups[kind], True)):
                scores, depths, accepted = tree.verified_nodes(
                    [trees[i] for i in mine], [paths[i] for i in mine], lookup)
                if scores:
                    calibration.observe(scores, depths, accepted)
        # the per-position acceptance is the draft's: sequences that did not draft relax
        self.observe(requests, [max(t.depths) if d else 0 for t, d in zip(trees, reach)],
                     [len(p) - 1 for p in paths])
        n, drafting = len(trees), sum(d > 0 for d in reach)
        decode, _, draft = self.cost_model.step_tables(n, self.k_max)
        rows = sum(len(t) for t in trees)   # a tree may hold more rows than extra's table
        self.time.observe(decode, float(self.cost_model.extra(n, rows) +
                                        draft[drafting, max(reach, default=0)]), seconds)

    def forget(self, request_id: int) -> None:
        self._requests.pop(request_id, None)

    def _estimate(self, request_id: int) -> Acceptance:
        if request_id not in self._requests:
            self._requests[request_id] = Acceptance(self.engine.rates)
        return self._requests[request_id]


def step_costs(cost_model, n: int, time: TimeCorrection, positions: int, trees: bool = False):
    """The chooser's (target_cost(rows), draft_cost(drafting, longest)) for a step over n
    sequences of up to `positions` drafts each, corrected by `time`; with `trees`, the draft pass
    for a longest chain of k reaches the depth `tree.depth_limits` gives k."""
    decode, extra, draft = cost_model.step_tables(n, positions)
    if trees:
        draft = draft[:, tree.depth_limits(list(range(positions + 1)), positions)]
    return (lambda rows: time.a * decode + time.b * extra[np.asarray(rows) - n],
            lambda d, longest: time.b * draft[d, longest])


def step_rate(ks: list[int], cumulative: list[list[float]], cost_model) -> float:
    """Expected committed tokens per second of one step verifying ks[i] drafts of sequence i."""
    gain = len(ks) + sum(sum(row[:k]) for row, k in zip(cumulative, ks))
    return gain / cost_model.step(len(ks), len(ks) + sum(ks), sum(k > 0 for k in ks),
                                  max(ks, default=0))


def expected_rate(cost_model, block_size: int, max_num_seqs: int) -> tuple[float, float]:
    """Expected tokens per second at concurrency 1 and max_num_seqs, with the best verify
    lengths for PRIOR acceptance (no drafts when block_size is 1): how dtypes are compared."""
    rates = []
    for n in (1, max_num_seqs):
        cumulative = [Acceptance([PRIOR] * (block_size - 1)).cumulative()] * n
        ks = choose_num_drafts(cumulative, *step_costs(cost_model, n, TimeCorrection(),
                                                       block_size - 1)) \
            if block_size > 1 else [0] * n
        rates.append(step_rate(ks, cumulative, cost_model))
    return rates[0], rates[1]
