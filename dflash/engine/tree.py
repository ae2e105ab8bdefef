"""Draft trees (docs/design.md 4.6): verify the draft's best candidates, not one chain.

One DFlash pass gives a distribution at every block position. A tree holds, under the pending
token (the root, node 0), the draft nodes of highest path probability: a node at depth d is a
token of position d, its score the product of the draft probabilities along its path. Children
of every node are the same ranked tokens of the next position, so best-first expansion visits
nodes in non-increasing score and any prefix of that order is a tree (prefix-closed). With one
token per position the tree is today's chain.

A tree may also hold a branch the prompt lookup proposes (`graft`, `dflash.engine.lookup`).

How many nodes each sequence verifies is chosen after the draft pass, from the draft's own
scores and the lookup's priors, calibrated online against acceptance (`Calibration`), and the
measured cost of verify rows (`choose_nodes`): information from the draft and the committed
tokens only, so greedy output stays the target's own.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np

BINS = 20                 # calibration bins over the draft's path probability, per depth
BIN_UPPERS = [round((i + 1) / BINS, 3) for i in range(BINS)]   # each bin's upper bound
DEPTHS = 16               # depths calibrated apart (deeper nodes share the last)
CALIBRATION_PRIOR = 4.0   # pseudo-observations of a bin's prior (the raw score; per depth: the
                          # estimate over all depths)
CALIBRATION_ALPHA = 0.01  # weight of one step in a bin's running counts
EXTRA_DEPTH = 2           # levels a tree may reach beyond the planner's chain length
MAX_NODES = 64            # draft nodes a sequence may verify in one tree step


@dataclass
class Tree:
    tokens: list[int]     # node 0: the pending token; nodes 1..: drafts
    parents: list[int]    # parents[0] = -1; parents[i] < i
    depths: list[int]     # depths[0] = 0
    scores: list[float]   # draft path probability of each node (root 1.0; 0.0: not a draft
    #                       candidate, a node only the lookup proposed)
    # the lookup's prior acceptance of each node it proposed (0.0 for the others); empty: none
    lookup: list[float] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.tokens)

    def prefix(self, size: int) -> Tree:
        """The first `size` nodes (root included): a tree, since parents come first."""
        return Tree(self.tokens[:size], self.parents[:size], self.depths[:size],
                    self.scores[:size], self.lookup[:size])

    def lookup_priors(self) -> list[float]:
        return self.lookup or [0.0] * len(self)


def best_first(root: int, ids: list[list[int]], probs: list[list[float]], size: int) -> Tree:
    """The tree of the root and the `size` draft nodes of highest path probability.

    ids[d][r], probs[d][r]: the draft's r-th most likely token at depth d + 1 and its
    probability (non-increasing in r). A popped node offers its first child and its next
    sibling to the frontier, which therefore always holds the best node not yet taken."""
    tree = Tree([root], [-1], [0], [1.0])
    if not ids or size <= 0:
        return tree
    frontier = [(-probs[0][0], 0, 0, 0)]   # (-score, parent node, depth index, rank)
    while frontier and len(tree) <= size:
        neg, parent, d, r = heapq.heappop(frontier)
        node, score = len(tree), -neg
        tree.tokens.append(ids[d][r])
        tree.parents.append(parent)
        tree.depths.append(d + 1)
        tree.scores.append(score)
        if d + 1 < len(ids):
            heapq.heappush(frontier, (-score * probs[d + 1][0], node, d + 1, 0))
        if r + 1 < len(ids[d]):
            base = tree.scores[parent]
            heapq.heappush(frontier, (-base * probs[d][r + 1], parent, d, r + 1))
    return tree


def graft(tree: Tree, tokens: list[int], priors: list[float], size: int) -> Tree:
    """`tree` with the lookup's path `tokens` (priors: each one's prior acceptance) under its
    root: a token its node already has as a child follows that child (which takes the prior),
    another one becomes a new node (draft score 0.0), up to `size` nodes besides the root."""
    out = Tree(list(tree.tokens), list(tree.parents), list(tree.depths), list(tree.scores),
               tree.lookup_priors())
    children = {(p, t): i for i, (p, t) in enumerate(zip(out.parents, out.tokens)) if i}
    node = 0
    for token, prior in zip(tokens, priors):
        child = children.get((node, token))
        if child is None:
            if len(out) > size:
                break
            child = len(out)
            out.tokens.append(token)
            out.parents.append(node)
            out.depths.append(out.depths[node] + 1)
            out.scores.append(0.0)
            out.lookup.append(0.0)
        out.lookup[child] = prior
        node = child
    return out


def by_gain(tree: Tree, gains) -> tuple[Tree, np.ndarray]:
    """The tree's nodes reordered by non-increasing expected acceptance, and those gains (roots
    left out). A node is accepted only if its parent is, so each gain is first capped by its
    parent's; the order, stable over node indices (parents first), then keeps parents first
    and each prefix is a tree."""
    capped = np.asarray(gains, dtype=np.float64).copy()
    for node in range(1, len(tree)):
        parent = tree.parents[node]
        if parent > 0:
            capped[node - 1] = min(capped[node - 1], capped[parent - 1])
    order = np.argsort(-capped, kind="stable") + 1
    index = np.empty(len(tree), dtype=np.int64)
    index[0], index[order] = 0, np.arange(1, len(tree))
    nodes = [0, *order.tolist()]
    priors = tree.lookup_priors()
    return Tree([tree.tokens[n] for n in nodes],
                [-1, *(int(index[tree.parents[n]]) for n in nodes[1:])],
                [tree.depths[n] for n in nodes], [tree.scores[n] for n in nodes],
                [priors[n] for n in nodes]), capped[order - 1]


def depth_limits(num_drafts: list[int], positions: int) -> list[int]:
    """How deep each sequence's tree may reach: the chain length the planner chose from
    per-position acceptance and cost (0: no draft pass) and EXTRA_DEPTH levels more, which a
    confident draft's paths can use, within the block's `positions`. Positions beyond the
    deepest limit skip the draft's lm_head and top-k, the tree step's own cost per level."""
    return [min(k + EXTRA_DEPTH, positions) if k else 0 for k in num_drafts]


def accept_greedy(tree: Tree, target_ids: list[int]) -> list[int]:
    """The accepted path (node indices from the root): from each node, the child whose token is
    the target's argmax there, until no child is. The target's token after the path's last node
    is the bonus (or correction) token."""
    children: dict[tuple[int, int], int] = {}
    for node in range(1, len(tree)):
        children.setdefault((tree.parents[node], tree.tokens[node]), node)
    path = [0]
    while (path[-1], target_ids[path[-1]]) in children:
        path.append(children[(path[-1], target_ids[path[-1]])])
    return path


def walk_sampled(tree: Tree, totals: list[float], masses: list[float],
                 coins: list[list[float]]) -> tuple[list[int], list[int]]:
    """A sampled request's accepted path through `tree` (node indices from the root) and the
    tokens rejected at its last node (design.md 4.6): at each node, its children in the draft's
    order are one-hot proposals on the residual; child x is accepted when coin * sum(residual) <
    residual(x), else x leaves the residual. totals[n]: the sum of node n's target distribution;
    masses[n - 1]: node n's mass in its parent's (a rejection zeroes another token than any
    sibling's, so only the sums move); coins[d][k]: the coin of the child of rank k at depth d."""
    children: list[list[int]] = [[] for _ in range(len(tree))]
    for node in range(1, len(tree)):
        children[tree.parents[node]].append(node)
    path = [0]
    while True:
        node, refused = path[-1], []
        total = totals[node]
        for rank, child in enumerate(children[node]):
            mass = masses[child - 1]
            if coins[tree.depths[node]][rank] * total < mass:
                path.append(child)
                break
            refused.append(tree.tokens[child])
            total -= mass
        else:
            return path, refused


def verified_nodes(trees: list[Tree], paths: list[list[int]], lookup: bool = False
                   ) -> tuple[list[float], list[int], list[bool]]:
    """Every draft node of verified trees (or, with `lookup`, every node only the lookup
    proposed: where the draft proposed a node too, it is accepted more often than the lookup's
    own nodes are): its draft path probability (or the lookup's prior), its depth, and whether
    it lies on its tree's accepted path."""
    scores, depths, accepted = [], [], []
    for t, path in zip(trees, paths):
        on_path = set(path)
        for node, score in enumerate(t.lookup_priors() if lookup else t.scores):
            if node and score > 0.0 and not (lookup and t.scores[node] > 0.0):
                scores.append(score)
                depths.append(t.depths[node])
                accepted.append(node in on_path)
    return scores, depths, accepted


def confidence_bins(scores) -> np.ndarray:
    """The bin (of BINS equal ones over [0, 1]) of each draft path probability."""
    return np.minimum((np.asarray(scores, dtype=np.float64) * BINS).astype(np.int64), BINS - 1)


def reject(residual, token: int):
    """The residual after one-hot proposal `token` was rejected: its mass removed (the rest is
    renormalised where it is read)."""
    residual[token] = 0.0
    return residual


class Calibration:
    """P(a node is accepted | its depth and its draft path probability), in bins, learned from
    verified trees (every node of a verified tree is an observation: accepted when it lies on
    the accepted path). An estimate over all depths starts at the draft's own probability; each
    depth's estimate starts at that one and moves with its own observations, so a depth seldom
    verified borrows from the others (a deep node's path probability compounds the draft's
    errors at every level above it, so depths may differ)."""

    def __init__(self):
        centers = (np.arange(BINS) + 0.5) / BINS
        self.accepted = centers * CALIBRATION_PRIOR   # over all depths
        self.offered = np.full(BINS, CALIBRATION_PRIOR)
        self.depth_accepted = np.zeros((DEPTHS, BINS))
        self.depth_offered = np.zeros((DEPTHS, BINS))

    @staticmethod
    def _cells(scores, depths) -> tuple[np.ndarray, np.ndarray]:
        return np.minimum(np.asarray(depths, dtype=np.int64), DEPTHS) - 1, confidence_bins(scores)

    def _estimate(self, rows, bins) -> np.ndarray:
        overall = self.accepted[bins] / self.offered[bins]
        return (self.depth_accepted[rows, bins] + CALIBRATION_PRIOR * overall) / \
            (self.depth_offered[rows, bins] + CALIBRATION_PRIOR)

    def __call__(self, scores, depths) -> np.ndarray:
        return self._estimate(*self._cells(scores, depths))

    def observe(self, scores: list[float], depths: list[int], accepted: list[bool]) -> None:
        rows, bins = self._cells(scores, depths)
        hits = np.asarray(accepted, dtype=np.float64)
        for counts in (self.accepted, self.offered, self.depth_accepted, self.depth_offered):
            counts *= 1 - CALIBRATION_ALPHA
        np.add.at(self.accepted, bins, hits)
        np.add.at(self.offered, bins, 1.0)
        np.add.at(self.depth_accepted, (rows, bins), hits)
        np.add.at(self.depth_offered, (rows, bins), 1.0)

    def as_dict(self) -> dict[str, list]:
        """acceptance[d - 1][i]: the estimate at depth d for scores in bin i."""
        rows, bins = np.meshgrid(np.arange(DEPTHS), np.arange(BINS), indexing="ij")
        return {"bin_upper": list(BIN_UPPERS),
                "acceptance": np.round(self._estimate(rows, bins), 4).tolist()}


def choose_nodes(gains: list[list[float]], step_seconds, sequences: int | None = None
                 ) -> list[int]:
    """Nodes per drafting sequence maximising (n + sum of chosen gains) / step_seconds(rows),
    for a step over n = `sequences` sequences (default len(gains)) verifying n + chosen rows.

    gains[i]: sequence i's candidate nodes' expected acceptance in best-first order (each
    prefix is a tree). Taking the largest gains across the batch, a prefix of every row, is the
    best choice for each total; step_seconds is priced for every total at once."""
    n = len(gains) if sequences is None else sequences
    # a calibrated gain may exceed its parent's: capping by the ones before keeps every choice a
    # prefix of each row, hence a tree
    rows = [np.minimum.accumulate(np.asarray(row, dtype=np.float64)) for row in gains]
    sizes = [len(row) for row in rows]
    if not sum(sizes):
        return [0] * len(gains)
    flat = np.concatenate(rows)
    order = np.argsort(-flat, kind="stable")   # stable: a row's equal gains keep their order
    totals = np.arange(len(flat) + 1)
    rates = (n + np.concatenate([[0.0], np.cumsum(flat[order])])) / \
        np.asarray(step_seconds(n + totals), dtype=np.float64)
    best = int(np.argmax(rates))
    owner = np.repeat(np.arange(len(rows)), sizes)
    return np.bincount(owner[order[:best]], minlength=len(rows)).tolist()
