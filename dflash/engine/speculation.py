"""How many drafts each sequence verifies this step: the choice that maximises expected committed
tokens per second under the host's measured cost model.

Verifying the first k drafts of a sequence commits 1 + E[accepted] tokens, where
E[accepted] = sum_{j<=k} P(drafts 1..j all accepted), and costs k more verify rows. A step over n
sequences with k_i verified drafts each costs target(n + sum k_i) + draft(#{k_i > 0}). Speculation
that cannot pay on this host (expensive rows, low acceptance, large batches) is thereby switched
off by itself, and turned back on when it pays again.

Acceptance is estimated per draft position as the conditional probability that draft j is
accepted given that drafts 1..j-1 were, exponentially weighted, per request (starting from, and
drifting back to, the engine-wide estimate) and engine-wide. The cost model is corrected by the
measured time of every step (an exponentially weighted ratio of measured to predicted time, one
for steps that speculate and one for steps that do not). Choosing k from past acceptance and
timings only (never from the current drafts) keeps verification exact: greedy output is the
target's own, and sampled output keeps the target distribution.
"""

from __future__ import annotations

import numpy as np

PRIOR = 0.75            # conditional acceptance assumed before anything is observed
REQUEST_ALPHA = 0.2     # weight of one observation in a request's own estimate
ENGINE_ALPHA = 0.02     # ... in the engine-wide estimate
RELAX = 0.05            # per unobserved step, how far a request's estimate drifts to the engine's
PROBE_EVERY = 64        # steps with speculation off before one sequence verifies a full block
TIME_ALPHA = 0.05       # weight of one step's measured / predicted time in the correction


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
    (target_cost(n + sum k_i) + draft_cost(#{k_i > 0})).

    Each row of `cumulative` is non-increasing, so for a given total of verified drafts among a
    given set of drafting sequences the most valuable choice takes the largest values, a prefix
    of each row. For each d, the d sequences most likely to accept their first draft form the
    set, and every prefix of their values in decreasing order is scored. With d = n this visits
    the best choice for every total, so the result is the exact optimum when draft_cost depends
    only on whether any sequence drafts, and near it when it grows with their number."""
    n = len(cumulative)
    if n == 0 or not cumulative[0]:
        return [0] * n
    values = np.asarray(cumulative, dtype=np.float64)
    k = values.shape[1]
    target = np.array([target_cost(rows) for rows in range(n, n + n * k + 1)])
    best_rate, best = n / target[0], None
    by_first = np.argsort(-values[:, 0], kind="stable")
    for d in range(1, n + 1):
        chosen = by_first[:d]
        flat = values[chosen].ravel()
        order = np.argsort(-flat, kind="stable")   # row-major ties keep each row's prefix
        rates = (n + np.cumsum(flat[order])) / (target[1: d * k + 1] + draft_cost(d))
        m = int(np.argmax(rates))
        if rates[m] > best_rate:
            best_rate, best = float(rates[m]), (chosen, order[: m + 1])
    ks = [0] * n
    if best is not None:
        chosen, picked = best
        for i in chosen[picked // k]:
            ks[int(i)] += 1
    return ks


class Planner:
    """Per-step verify lengths for the running requests, learned from their acceptance."""

    def __init__(self, num_positions: int, cost_model):
        self.k_max, self.cost_model = num_positions, cost_model
        self.engine = Acceptance([PRIOR] * num_positions)
        self._requests: dict[int, Acceptance] = {}
        self._off_steps = 0
        self._probe = 0
        # measured / predicted step time, for steps that speculate and steps that do not: the
        # calibration times one layout of rows at one context length, real batches differ
        self.time_factor = {True: 1.0, False: 1.0}

    def plan(self, requests) -> list[int]:
        estimates = [self._estimate(r.request_id) for r in requests]
        n, factor = len(requests), self.time_factor
        ks = choose_num_drafts(
            [e.cumulative() for e in estimates],
            lambda rows: self.cost_model.target(rows) * factor[rows > n],
            lambda d: self.cost_model.draft(d) * factor[True])
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
        """Correct the cost model by a step's measured time (EW ratio to its prediction)."""
        speculating = any(num_drafts)
        predicted = self.cost_model.target(len(num_drafts) + sum(num_drafts)) + \
            self.cost_model.draft(sum(k > 0 for k in num_drafts))
        ratio = min(max(seconds / predicted, 0.25), 4.0)   # one preempted step moves it little
        self.time_factor[speculating] += TIME_ALPHA * (ratio - self.time_factor[speculating])

    def forget(self, request_id: int) -> None:
        self._requests.pop(request_id, None)

    def _estimate(self, request_id: int) -> Acceptance:
        if request_id not in self._requests:
            self._requests[request_id] = Acceptance(self.engine.rates)
        return self._requests[request_id]


def step_rate(ks: list[int], cumulative: list[list[float]], cost_model) -> float:
    """Expected committed tokens per second of one step verifying ks[i] drafts of sequence i."""
    gain = len(ks) + sum(sum(row[:k]) for row, k in zip(cumulative, ks))
    cost = cost_model.target(len(ks) + sum(ks)) + cost_model.draft(sum(k > 0 for k in ks))
    return gain / cost


def expected_rate(cost_model, block_size: int, max_num_seqs: int) -> tuple[float, float]:
    """Expected tokens per second at concurrency 1 and max_num_seqs, with the best verify
    lengths for PRIOR acceptance (no drafts when block_size is 1): how dtypes are compared."""
    rates = []
    for n in (1, max_num_seqs):
        cumulative = [Acceptance([PRIOR] * (block_size - 1)).cumulative()] * n
        ks = choose_num_drafts(cumulative, cost_model.target, cost_model.draft) \
            if block_size > 1 else [0] * n
        rates.append(step_rate(ks, cumulative, cost_model))
    return rates[0], rates[1]
