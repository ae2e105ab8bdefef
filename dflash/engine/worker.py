"""The model worker: one batched call per stage for all running sequences (docs/design.md 4.2).

A decode step for a batch of sequences, each with `n` cached tokens, a pending last token and a
verify length k (0..B-1, chosen by the scheduler):
  block_inputs  block [pending, MASK * max(k)] at positions n .. n+max(k) for every sequence
                        with k > 0 (a lone such sequence: the whole block)
  draft_forward      one non-causal draft forward -> max(k) draft tokens per such sequence
  verify          one causal target forward over [pending, first k drafts] of every
                        sequence (a ragged batch) + rejection sampling
  write_draft_context      the committed rows' target features -> the draft's context cache (held
                        back for sequences that verified no drafts until they draft again)

When every sequence verifies all B - 1 drafts greedily (and the draft model proposes them), the
step is uniform: its device work, the same four stages over B rows per sequence, is one pure
tensor function, `step.decode_step`, that a graph capture can take whole (`run_uniform_step`).

Without a draft the same path runs with B = 1: the block is just the pending token and rejection
sampling emits the one bonus token, i.e. plain autoregressive decoding (the speedup baseline).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from itertools import accumulate

import torch

from .. import ops, sampling
from ..models import AttentionMetadata, DFlashDraft, TargetModel
from ..models.layers import PANEL_MAX_ROWS, build_metadata, inference_weight
from ..sampling import noise
from . import lookup
from .cost_model import fastest_each
from .request import Request
from .step import decode_step, draft_logits, greedy_drafts
from .tree import MAX_NODES, Tree, accept_greedy, best_first, graft, reject, walk_sampled


@dataclass
class StepInputs:
    requests: list[Request]
    tokens: torch.Tensor          # [Bs * rows] block tokens (pending token, then masks)
    meta: AttentionMetadata       # positions / slots / tables shared by draft and target
    block_size: int               # rows of each sequence's block: K + 1, or B for one
    num_drafts: int               # K, the most drafts any of these sequences verifies (<= B-1)


@dataclass
class Verified:
    """What a verification pass produced: per request the emitted tokens and accepted count, and
    the target features and metadata of its k + 1 verified rows (requests one after another)."""
    emitted: list[list[int]]
    accepted: list[int]
    num_drafts: list[int]
    features: torch.Tensor        # [sum(k + 1), n_aux * H]
    meta: AttentionMetadata


# the draft-context features a sequence that stopped drafting may hold back: 1213 rows of the
# bundled pair in bf16, 102 of a Qwen3-8B target's 5 captured layers
BACKLOG_BYTES = 4 << 20
TREE_TOP_K = 8        # candidate tokens per block position a tree may branch into


class Worker:
    defer_context = True   # hold back the draft context of non-drafting sequences (see below)
    uniform_steps = True   # run uniform greedy steps as one decode_step (run_uniform_step)

    def __init__(self, target: TargetModel, draft: DFlashDraft | None, num_kv_blocks: int,
                 kv_block_size: int, block_size: int, draft_sampling: str = "greedy"):
        if draft_sampling not in ("greedy", "sample"):
            raise ValueError(f"draft_sampling must be 'greedy' or 'sample', got {draft_sampling!r}")
        self.target, self.draft = target, draft
        target.pack_weights()
        if draft is not None:
            draft.pack_weights()
        self.kv_block_size, self.block_size = kv_block_size, block_size
        self.num_kv_blocks = num_kv_blocks
        self.draft_sampling = draft_sampling
        dtype, self.device = target.dtype, target.norm.device
        self.target_cache = torch.zeros(target.kv_cache_shape(num_kv_blocks, kv_block_size),
                                        dtype=dtype, device=self.device)
        self.draft_cache = None if draft is None else torch.zeros(
            draft.kv_cache_shape(num_kv_blocks, kv_block_size), dtype=dtype, device=self.device)
        self.capture = () if draft is None else draft.cfg.target_layer_ids
        vocab = None if draft is None else draft.draft_vocab
        # the rows of the lm_head the draft may propose (None: all of them, via target.logits)
        self.draft_head = None if vocab is None else inference_weight(
            target.output_rows(vocab) if draft.lm_head is None else draft.lm_head,
            draft.quantization)
        self.draft_vocab = vocab
        self.mask_token_id = None if draft is None else draft.cfg.mask_token_id
        self.backlog_rows = 0 if draft is None else \
            BACKLOG_BYTES // (draft.fc.shape[1] * dtype.itemsize)
        # the device work of a uniform step; a graph-capturing caller puts its compiled form here
        self.decode_step = decode_step
        # what proposes the drafts: None for the draft model (draft_forward), or any
        # callable inputs -> (draft ids [n, k], probs [n, k, V] or None), e.g. a scripted one
        self.proposer = None
        self.prefill_seconds = 0.0   # time spent in prefill (benchmarks report it separately)

    # ------------------------------------------------------------------------------ prefill
    @torch.inference_mode()
    def prefill(self, requests: list[Request], ends: list[int] | None = None
                ) -> list[int | None]:
        """Run the prompts from each request's `num_cached` to its end in `ends` (default: the
        prompt's end), fill the draft context, and return each request's first token (None for
        a request whose prompt goes on: a long prompt prefills in chunks, docs/design.md 4.3).
        Prompts go in passes of at most PANEL_MAX_ROWS rows, a longer one alone: past that a
        linear takes another GEMM, which sums in another order, so a pass of several prompts
        would prefill each differently from itself alone."""
        start = time.perf_counter()
        ends = [len(r.prompt_ids) for r in requests] if ends is None else ends
        first = []
        for batch in prefill_passes([e - r.num_cached for r, e in zip(requests, ends)],
                                    PANEL_MAX_ROWS):
            first += self._prefill([requests[i] for i in batch], [ends[i] for i in batch])
        self.prefill_seconds += time.perf_counter() - start
        return first

    def _prefill(self, requests: list[Request], ends: list[int]) -> list[int | None]:
        starts = [r.num_cached for r in requests]
        meta = build_metadata([r.block_table for r in requests], starts,
                              [e - s for s, e in zip(starts, ends)],
                              self.kv_block_size, self.device, self.num_kv_blocks)
        tokens = torch.tensor([t for r, s, e in zip(requests, starts, ends)
                               for t in r.prompt_ids[s:e]], device=self.device)
        hidden, features = self.target(tokens, meta, self.target_cache, self.capture)
        if self.draft is not None:
            self.draft.write_context(features, meta.positions, meta.slot_mapping,
                                     self.draft_cache, check=not meta.checked)
        first = [None] * len(requests)   # a chunk: the prompt goes on (one request a call)
        if all(e == len(r.prompt_ids) for r, e in zip(requests, ends)):
            logits = self.target.logits(hidden[meta.cu_query_lens[1:].long() - 1])
            params = [r.params for r in requests]
            probs = sampling.target_probs(logits[:, None], params)[:, 0]
            first = sampling.sample(probs, self._is_greedy(requests), self._seeds(requests),
                                    ends).tolist()
        for r, e in zip(requests, ends):   # last: a call that raised can run again
            r.num_cached = e
        return first

    # --------------------------------------------------------------------------- the step
    def block_inputs(self, requests: list[Request], num_drafts: int | None = None
                             ) -> StepInputs:
        """The draft's block for each request: [pending, MASK * K] at its next positions, one
        draft per mask (K = num_drafts, default B-1).

        When several sequences draft and can verify K < B-1 drafts, their blocks are cut to
        those K masks: the masks after them only feed the draft's non-causal attention (a mask
        token carries its position and nothing else), and the draft forward's rows, its cost at
        larger batches, shrink with K. The drafts at depth are accepted less often without them
        (design.md 7), so a lone sequence, whose draft pass costs little more whole, keeps its
        whole block."""
        k = self.block_size - 1 if num_drafts is None else num_drafts
        rows = k + 1 if len(requests) > 1 else self.block_size
        tokens = torch.full((len(requests), rows), -1 if self.mask_token_id is None
                            else self.mask_token_id, device=self.device)
        tokens[:, 0] = self._pending(requests)
        meta = build_metadata([r.block_table for r in requests], [r.num_cached for r in requests],
                              [rows] * len(requests), self.kv_block_size, self.device,
                              self.num_kv_blocks)
        return StepInputs(requests, tokens.flatten(), meta, rows, k)

    @torch.inference_mode()
    def draft_forward(self, inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft tokens [Bs, K] for K = inputs.num_drafts (argmax, or sampled with dense
        probabilities [Bs, K, V]), from one draft forward over the blocks (`block_inputs`; its
        attention is non-causal), their first K mask rows through the lm_head."""
        bs, k = len(inputs.requests), inputs.num_drafts
        logits = draft_logits(self.target, self.draft, self.draft_head,
                              inputs.tokens.view(bs, inputs.block_size), inputs.meta,
                              self.draft_cache, k)
        if self.draft_sampling == "greedy":
            return greedy_drafts(logits, self.draft_vocab), None
        probs = sampling.target_probs(logits, [r.params for r in inputs.requests])
        drafts = sampling.sample(probs, self._is_greedy(inputs.requests),
                                 self._seeds(inputs.requests), self._offsets(inputs.requests),
                                 noise.DRAFT_RACE)
        if self.draft_vocab is not None:   # q is zero outside the draft vocabulary
            full = probs.new_zeros(bs, k, self.target.cfg.vocab_size)
            probs = full.index_copy_(2, self.draft_vocab, probs)
            drafts = self.draft_vocab[drafts]
        return drafts, probs

    @torch.inference_mode()
    def verify(self, requests: list[Request], num_drafts: list[int],
                     draft_ids: torch.Tensor, draft_probs: torch.Tensor | None) -> Verified:
        """Verify each request's [pending, first k drafts] causally (k = num_drafts[i]; a ragged
        batch of sum(k + 1) rows) and run rejection sampling on each.

        draft_ids [Bs, B-1] (rows of requests with k = 0 are ignored), draft_probs [Bs, B-1, V]
        or None (one-hot proposals)."""
        b = self.block_size
        rows = [i * b + j for i, k in enumerate(num_drafts) for j in range(k + 1)]
        rows_t = torch.tensor(rows, device=self.device)
        table = torch.empty(len(requests), b, dtype=torch.int64, device=self.device)
        table[:, 0] = self._pending(requests)
        table[:, 1:] = draft_ids
        meta = build_metadata([r.block_table for r in requests], [r.num_cached for r in requests],
                              [k + 1 for k in num_drafts], self.kv_block_size, self.device,
                              self.num_kv_blocks)
        hidden, features = self.target(table.flatten()[rows_t], meta, self.target_cache,
                                       self.capture)
        emitted, accepted = sampling.verify(
            draft_ids, draft_probs, self.target.logits(hidden), num_drafts,
            [r.params for r in requests], self._seeds(requests), self._offsets(requests))
        return Verified(emitted, accepted, num_drafts, features, meta)

    @torch.inference_mode()
    def write_draft_context(self, verified: Verified, requests: list[Request]) -> None:
        """Append the features of each sequence's committed rows (its first a + 1 verified rows)
        to the draft's context cache.

        The row of a sequence that verified no drafts waits on its request instead (up to
        `backlog_rows` of them: BACKLOG_BYTES of features) and is written, with the others held
        back, when the sequence drafts again (`_flush_context`), or never if it finishes first:
        at large batches speculation often stays off, and then every write would be pure cost.
        Each row's K/V depend on that row alone, so a late write stores what an immediate one
        would have."""
        keep, held, waiting, start = [], [], [], 0
        for r, a, k in zip(requests, verified.accepted, verified.num_drafts):
            if k == 0 and self.defer_context and len(r.context_backlog) < self.backlog_rows:
                held.append(start)
                waiting.append(r)
            else:
                keep += range(start, start + a + 1)
            start += k + 1
        meta = verified.meta
        if held:
            rows = torch.tensor(held, device=self.device)
            features, positions, slots = (verified.features[rows], meta.positions[rows],
                                          meta.slot_mapping[rows])
            for j, r in enumerate(waiting):
                r.context_backlog.append((features[j], positions[j], slots[j]))
        if keep:
            rows = torch.tensor(keep, device=self.device)
            self.draft.write_context(verified.features[rows], meta.positions[rows],
                                     meta.slot_mapping[rows], self.draft_cache,
                                     check=not meta.checked)

    @torch.inference_mode()
    def _flush_context(self, requests: list[Request]) -> None:
        """Write the draft context the requests held back (before they draft)."""
        rows = [row for r in requests for row in r.context_backlog]
        if not rows:
            return
        features, positions, slots = (torch.stack(column) for column in zip(*rows))
        # rows of checked step plans (write_draft_context kept them)
        self.draft.write_context(features, positions, slots, self.draft_cache, check=False)
        for r in requests:
            r.context_backlog.clear()

    def step(self, requests: list[Request], num_drafts: list[int] | None = None
             ) -> tuple[list[list[int]], list[int]]:
        """One decode step for `requests`; returns the tokens each emitted and its accepted count.

        num_drafts[i] (0..B-1, default B-1) is how many of request i's drafts are verified; the
        draft forward runs only for the requests with k > 0 (not at all when every k is 0), and
        the draft context is written for all of them (see write_draft_context for when). A step in
        which every k is B-1, every request greedy and the draft model the proposer runs as one
        decode_step (run_uniform_step).
        """
        b = self.block_size
        num_drafts = [b - 1] * len(requests) if num_drafts is None else list(num_drafts)
        if len(num_drafts) != len(requests) or not all(0 <= k < b for k in num_drafts):
            raise ValueError(f"num_drafts must hold one count in [0, {b - 1}] per request, got "
                             f"{num_drafts} for {len(requests)} requests")
        if self._is_uniform(requests, num_drafts):
            emitted, accepted = self.run_uniform_step(requests)
        else:
            emitted, accepted = self._ragged_step(requests, num_drafts)
        for r, a in zip(requests, accepted):
            r.num_cached += a + 1
        return emitted, accepted

    def _is_uniform(self, requests: list[Request], num_drafts: list[int]) -> bool:
        """Whether every request drafts and verifies B - 1 tokens with the draft model, greedily."""
        b = self.block_size
        return self.uniform_steps and self.draft is not None and self.proposer is None and b > 1 \
            and self.draft_sampling == "greedy" and all(k == b - 1 for k in num_drafts) \
            and all(r.params.is_greedy for r in requests)

    @torch.inference_mode()
    def run_uniform_step(self, requests: list[Request]) -> tuple[list[list[int]], list[int]]:
        """A step in which every request drafts and verifies B - 1 tokens greedily: its device
        work is one `self.decode_step` call (shapes fixed by the batch, no host decision inside;
        see dflash/engine/step.py), after which the host reads the emitted tokens back once. It
        writes the draft context of all B verified rows, which keeps committed-token semantics
        exact (step.py says why)."""
        self._flush_context(requests)
        inputs = self.block_inputs(requests)
        out, accepted, _ = self.decode_step(
            self.target, self.draft, inputs.tokens.view(len(requests), self.block_size),
            inputs.meta, self.target_cache, self.draft_cache, self.draft_head, self.draft_vocab)
        out, accepted = out.tolist(), accepted.tolist()   # the step's one host sync
        return [row[:a + 1] for row, a in zip(out, accepted)], accepted

    def _ragged_step(self, requests: list[Request], num_drafts: list[int]
                     ) -> tuple[list[list[int]], list[int]]:
        """Any other step: the four stages of the module docstring, each over its own rows."""
        b = self.block_size
        draft_ids = torch.zeros(len(requests), b - 1, dtype=torch.int64, device=self.device)
        draft_probs = None
        drafting = [i for i, k in enumerate(num_drafts) if k > 0]
        if drafting:
            self._flush_context([requests[i] for i in drafting])
            ids, probs = (self.proposer or self.draft_forward)(
                self.block_inputs([requests[i] for i in drafting], max(num_drafts)))
            idx = torch.tensor(drafting, device=self.device)
            draft_ids[idx, :ids.shape[1]] = ids
            if probs is not None:
                draft_probs = probs.new_zeros(len(requests), *probs.shape[1:])
                draft_probs[idx] = probs
        verified = self.verify(requests, num_drafts, draft_ids, draft_probs)
        if self.draft is not None:
            self.write_draft_context(verified, requests)
        return verified.emitted, verified.accepted

    # ------------------------------------------------------------------------------- trees
    def can_tree(self, requests: list[Request]) -> bool:
        """Whether a tree step can serve these requests: the draft model proposes, and its
        candidates are one-hot proposals (draft_sampling "greedy"; sampled drafts verify
        chains)."""
        return self.draft is not None and self.proposer is None and \
            self.block_size > 1 and self.draft_sampling == "greedy"

    @torch.inference_mode()
    def tree_step(self, requests: list[Request], depths: list[int], reach: list[int], size: int,
                  choose) -> tuple[list[list[int]], list[Tree], list[list[int]]]:
        """One decode step verifying a tree of drafts per sequence (docs/design.md 4.6).

        Requests of depth > 0 get trees of at most `size` nodes that reach at most that deep,
        and no node of request i lies deeper than reach[i] (`grow_trees`); one target
        pass over every tree (rows: root, then nodes; a node attends to its context, its
        ancestors and itself) gives the target's logits at every node; each request accepts a
        path (`accept_trees`) and commits it and the token after it. Returns the emitted tokens,
        the verified trees and their accepted paths (node indices)."""
        trees = self.grow_trees(requests, depths, reach, size, choose)
        meta = build_metadata([r.block_table for r in requests], [r.num_cached for r in requests],
                              [len(t) for t in trees], self.kv_block_size, self.device,
                              self.num_kv_blocks,
                              parents=None if all(len(t) == 1 for t in trees) else
                              [t.parents for t in trees])
        tokens = torch.tensor([tok for t in trees for tok in t.tokens], device=self.device)
        hidden, features = self.target(tokens, meta, self.target_cache, self.capture)
        emitted, paths = self.accept_trees(requests, trees, self.target.logits(hidden))
        rows, start = [], 0
        for t, path in zip(trees, paths):
            rows.append([start + n for n in path])
            start += len(t)
        # the verify row whose slot the path's node at depth d belongs in: its root's row + d
        targets = [[row[0] + d for d in range(len(row))] for row in rows]
        self._commit_paths(rows, targets, meta)
        path_rows = torch.tensor([r for row in rows for r in row], device=self.device)
        at_depth = torch.tensor([r for row in targets for r in row], device=self.device)
        verified = Verified(emitted, [len(p) - 1 for p in paths], [len(p) - 1 for p in paths],
                            features[path_rows],
                            replace(meta, positions=meta.positions[path_rows],
                                    slot_mapping=meta.slot_mapping[at_depth], tree_mask=None))
        self.write_draft_context(verified, requests)
        for r, path in zip(requests, paths):
            r.num_cached += len(path)
        return emitted, trees, paths

    @torch.inference_mode()
    def grow_trees(self, requests: list[Request], depths: list[int], reach: list[int],
                   size: int, choose) -> list[Tree]:
        """Each request's tree, as `choose(candidates, requests)` keeps it of its candidates:
        the root (its pending token), for a request of depth > 0 under the best-first tree of
        `size` nodes over one draft pass's top candidates at its first `depth` block positions,
        and for every request with the prompt lookup's branch grafted on, up to `reach` deep
        (at most the block's positions). The draft's block reaches at least as deep as the
        deepest tree may (`block_inputs`), and only those positions go through the draft's
        lm_head and top-k."""
        # a tree's rows take the slots after the sequence's cached tokens: as many as its
        # reservation has left (at least a block's, section 4.6)
        room = [len(r.block_table) * self.kv_block_size - r.num_cached - 1 for r in requests]
        trees = [Tree([r.output_ids[-1]], [-1], [0], [1.0]) for r in requests]
        chosen = [i for i, d in enumerate(depths) if d > 0]
        if chosen:
            reqs = [requests[i] for i in chosen]
            self._flush_context(reqs)
            inputs = self.block_inputs(reqs, max(depths[i] for i in chosen))
            logits = draft_logits(self.target, self.draft, self.draft_head,
                                  inputs.tokens.view(len(reqs), inputs.block_size), inputs.meta,
                                  self.draft_cache, inputs.num_drafts)
            probs, ids = ops.top_k(logits, min(TREE_TOP_K, logits.shape[-1]), probs=True)
            # a draft only proposes: a NaN probability (a draft whose weights hold an Inf or
            # NaN) is no confidence, so tree scores and their calibration stay numbers
            probs = probs.nan_to_num(0.0)
            if self.draft_vocab is not None:
                ids = self.draft_vocab[ids]
            probs, ids = probs.tolist(), ids.tolist()   # one host sync: the trees are host lists
            for j, i in enumerate(chosen):
                trees[i] = best_first(trees[i].tokens[0], ids[j][:depths[i]],
                                      probs[j][:depths[i]], min(size, room[i]))
        candidates = [graft(t, *lookup.propose(r.tokens, reach[i]), min(room[i], MAX_NODES))
                      for i, (t, r) in enumerate(zip(trees, requests))]
        if all(len(t) == 1 for t in candidates):
            return candidates
        return choose(candidates, requests)

    def accept_trees(self, requests: list[Request], trees: list[Tree], logits: torch.Tensor
                     ) -> tuple[list[list[int]], list[list[int]]]:
        """Per request, the tokens it emits and its accepted path (node indices from the root),
        from the target's logits at every node (rows of the trees one after another): greedy
        along the argmax, sampled by `_accept_sampled`, all sampled requests at once."""
        starts = list(accumulate((len(t) for t in trees), initial=0))
        # the sync; sampled requests read their logits only through target_probs
        target_ids = sampling.first_argmax(logits).tolist() \
            if any(r.params.is_greedy for r in requests) else []
        sampled = [i for i, r in enumerate(requests) if not r.params.is_greedy]
        walks = dict(zip(sampled, self._accept_sampled(
            [requests[i] for i in sampled], [trees[i] for i in sampled],
            logits, [starts[i] for i in sampled])))
        emitted, paths = [], []
        for i, (r, t) in enumerate(zip(requests, trees)):
            if r.params.is_greedy:
                path = accept_greedy(t, target_ids[starts[i]:starts[i + 1]])
                bonus = target_ids[starts[i] + path[-1]]
            else:
                path, bonus = walks[i]
            emitted.append([t.tokens[n] for n in path[1:]] + [bonus])
            paths.append(path)
        return emitted, paths

    def _accept_sampled(self, requests: list[Request], trees: list[Tree], logits: torch.Tensor,
                        starts: list[int]) -> list[tuple[list[int], int]]:
        """Each sampled request's accepted path through its tree (whose nodes are the logits'
        rows from its start) and the token after it, keeping the target distribution (design.md
        4.6): the path by `walk_sampled`, the token after it drawn from the last residual. Coins
        are keyed by (seed, position, the child's rank); the race by (seed, position), so a
        seeded request reproduces itself. The walks read values computed once for all the
        requests, and their last residuals and races are one batched computation."""
        if not requests:
            return []
        first = list(accumulate((len(t) for t in trees), initial=0))
        nodes = [s + n for s, t in zip(starts, trees) for n in range(len(t))]
        if nodes != list(range(len(logits))):   # greedy requests' rows among them
            logits = logits[torch.tensor(nodes, device=logits.device)]
        probs = sampling.target_probs(
            logits[:, None], [r.params for r, t in zip(requests, trees) for _ in t.tokens])[:, 0]
        totals = probs.sum(-1).tolist()
        # each child's mass in its parent's distribution (int64 given: the lists are empty when
        # every tree is its root alone)
        parents = torch.tensor([f + p for f, t in zip(first, trees) for p in t.parents[1:]],
                               dtype=torch.int64, device=logits.device)
        tokens = torch.tensor([x for t in trees for x in t.tokens[1:]], dtype=torch.int64,
                              device=logits.device)
        masses = probs[parents, tokens].tolist()
        offsets = self._offsets(requests)
        deepest = [max(t.depths) for t in trees]
        coins = noise.uniform([r.seed for r, d in zip(requests, deepest) for _ in range(d + 1)],
                              [o + d for o, top in zip(offsets, deepest) for d in range(top + 1)],
                              noise.TREE_COINS, 1, TREE_TOP_K + 1,   # + the lookup's child
                              logits.device)[:, 0].tolist()
        walks, coin = [], 0
        for j, t in enumerate(trees):
            walks.append(walk_sampled(t, totals[first[j]:first[j + 1]],
                                      masses[first[j] - j:first[j + 1] - j - 1],
                                      coins[coin:coin + deepest[j] + 1]))
            coin += deepest[j] + 1
        last = probs[torch.tensor([f + path[-1] for f, (path, _) in zip(first, walks)],
                                  device=logits.device)]
        residuals = []
        for row, (_, refused) in zip(last, walks):
            for x in refused:
                row = reject(row, x)
            residuals.append(row)
        race = noise.exponential([r.seed for r in requests],
                                 [o + t.depths[path[-1]] for o, t, (path, _) in
                                  zip(offsets, trees, walks)],
                                 noise.TARGET_RACE, 1, probs.shape[-1], logits.device)[:, 0]
        bonus = torch.stack(residuals).div_(race).argmax(-1).tolist()
        return [(path, b) for (path, _), b in zip(walks, bonus)]

    def _commit_paths(self, rows: list[list[int]], targets: list[list[int]],
                      meta: AttentionMetadata) -> None:
        """Move the target K/V of each accepted node (a verify row) to the slot of its depth:
        nodes sit in the slots of their index, a path's node at depth d belongs in slot
        start + d. One gather and one scatter over every layer, on the device."""
        moves = [(s, d) for src, dst in zip(rows, targets) for s, d in zip(src, dst) if s != d]
        if not moves:
            return
        src = meta.slot_mapping[torch.tensor([s for s, _ in moves], device=self.device)]
        dst = meta.slot_mapping[torch.tensor([d for _, d in moves], device=self.device)]
        cache = self.target_cache.view(*self.target_cache.shape[:2], -1,
                                       *self.target_cache.shape[4:])
        cache[:, :, dst] = cache[:, :, src]

    # -------------------------------------------------------------------------- calibration
    @torch.inference_mode()
    def measure_costs(self, tables: list[list[int]], context: int, rows_grid: list[int],
                      seqs_grid: list[int], repeats: int) -> tuple[dict, dict, dict, dict]:
        """Seconds (the fastest of `repeats` runs, all points timed in turn: `fastest_each`) of
        one verify pass (target forward, lm_head, greedy acceptance and the context write) for
        each total row count in `rows_grid`, packed B rows to a sequence, with `context` cached
        tokens each; and for each sequence count in `seqs_grid`, of one draft step making B-1
        drafts a sequence, of one pass with one row per sequence (only with B > 1: for B = 1
        that is the first measurement) and of one draft step making one draft a sequence (only
        with B > 2). `tables`: free block tables, each holding context + B tokens, at least
        max(rows_grid) / B (rounded up) and max(seqs_grid) of them. Caches are written only
        inside those blocks."""
        b = self.block_size
        requests = []
        for table in tables:
            r = Request(-1, [0] * context, sampling.SamplingParams(), 0, frozenset())
            r.block_table, r.num_cached, r.output_ids = table, context, [1]
            requests.append(r)
        g = torch.Generator().manual_seed(0)
        draft_ids = torch.randint(0, self.target.cfg.vocab_size, (len(requests), b - 1),
                                  generator=g).to(self.device)

        def verify(ks: list[int]) -> None:
            verified = self.verify(requests[:len(ks)], ks, draft_ids[:len(ks)], None)
            if self.draft is not None:
                self.write_draft_context(verified, requests[:len(ks)])

        def packed(rows: int) -> list[int]:
            n = -(-rows // b)
            return [b - 1] * (n - 1) + [rows - (n - 1) * b - 1]

        def draft(n: int, num_drafts: int | None = None) -> None:
            self.draft_forward(self.block_inputs(requests[:n], num_drafts))

        jobs = {("target", rows): lambda r=rows: verify(packed(r)) for rows in rows_grid}
        for n in seqs_grid:
            if self.draft is not None:
                jobs["draft", n] = lambda n=n: draft(n)
            if b > 1:
                jobs["decode", n] = lambda n=n: verify([0] * n)
            if self.draft is not None and b > 2:
                jobs["draft_one", n] = lambda n=n: draft(n, 1)
        seconds = fastest_each(jobs, repeats)
        if ("decode", 1) in seconds and ("target", 1) in seconds:   # the same pass: one row
            seconds["decode", 1] = seconds["target", 1] = min(seconds["decode", 1],
                                                              seconds["target", 1])
        return tuple({x: t for (name, x), t in seconds.items() if name == series}
                     for series in ("target", "draft", "decode", "draft_one"))

    # ----------------------------------------------------------------------------- helpers
    def _pending(self, requests):
        return torch.tensor([r.output_ids[-1] for r in requests], device=self.device)

    def _is_greedy(self, requests):
        return torch.tensor([r.params.is_greedy for r in requests], device=self.device)

    @staticmethod
    def _seeds(requests):
        return [r.seed for r in requests]

    @staticmethod
    def _offsets(requests):
        """The noise offset of a decode step: the position of the first token it decides (the
        one after the pending token), so a request's steps never share noise."""
        return [r.num_cached + 1 for r in requests]


def prefill_passes(lengths: list[int], limit: int) -> list[list[int]]:
    """The prompts (indices into `lengths`, in order) of each prefill pass: as many as fit in
    `limit` rows together; a longer prompt alone."""
    passes: list[list[int]] = []
    rows = limit
    for i, n in enumerate(lengths):
        if rows + n > limit:
            passes.append([])
            rows = 0
        passes[-1].append(i)
        rows += n
    return passes
