"""Prompt lookup: a branch of the draft tree copied from the sequence's own context (design.md
4.6).

Generated text often repeats its context: the numbers and names of a question, a phrase written
a few lines before. After the context's last n tokens, the lookup proposes the tokens that
followed their latest earlier occurrence, for the longest such n up to MAX_MATCH. A proposal
costs no model pass, only the verify rows the planner chooses to spend on it: its nodes are
scored by a prior acceptance that grows with the match length and shrinks with depth, which the
planner calibrates online against the accepted paths as it does the draft's path probabilities.
The proposal depends on committed tokens only, so verification stays exact.
"""

from __future__ import annotations

import numpy as np

MAX_MATCH = 6   # the longest context suffix matched
# prior acceptance of a proposal's first token by match length 1..MAX_MATCH; its token at depth d
# starts at this to the power d (about what the bundled pair's held-out GSM8K answers show)
FIRST_TOKEN_PRIOR = (0.35, 0.6, 0.7, 0.7, 0.75, 0.87)


def propose(tokens, length: int) -> tuple[list[int], list[float]]:
    """The proposal after `tokens` (prompt and output so far, the pending token last): up to
    `length` tokens, and each one's prior acceptance; empty without a match."""
    ctx = np.asarray(tokens, dtype=np.int64)
    end = len(ctx)
    if end < 2 or length <= 0:
        return [], []
    # follows[j - 1]: the token at j follows a copy of the context's last n tokens, n = runs
    # of matches counted back from j - 1 and from end - 1 (j < end: the proposal starts with a
    # token that exists)
    starts = np.arange(1, end)
    matched = np.zeros(end - 1, dtype=np.int64)
    running = np.ones(end - 1, dtype=bool)
    for n in range(1, min(MAX_MATCH, end - 1) + 1):
        running &= (starts >= n) & (ctx[np.maximum(starts - n, 0)] == ctx[end - n])
        if not running.any():
            break
        matched += running
    best = int(matched.max())
    if best == 0:
        return [], []
    at = int(starts[np.flatnonzero(matched == best)[-1]])   # the latest of the longest
    proposal = ctx[at:at + length].tolist()
    first = FIRST_TOKEN_PRIOR[best - 1]
    return proposal, [first ** (d + 1) for d in range(len(proposal))]
