"""The model worker: one batched call per stage for all running sequences (docs/design.md 4.2).

A decode step for a batch of sequences, each with `n` cached tokens and a pending last token:
  prepare_query_inputs  block [pending, MASK * (B-1)] at positions n .. n+B-1 for every sequence
  run_decode_draft      one non-causal draft forward -> B-1 draft tokens per sequence
  run_validate          one causal target forward over [pending, drafts] + rejection sampling
  write_context_kv      the committed rows' target features -> the draft's context cache

Without a draft the same path runs with B = 1: the block is just the pending token and rejection
sampling emits the one bonus token, i.e. plain autoregressive decoding (the speedup baseline).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .. import sampling
from ..models import AttentionMetadata, DFlashDraft, TargetModel
from ..models.layers import build_metadata, linear, pack_linear_weight
from .request import Request


@dataclass
class StepInputs:
    requests: list[Request]
    tokens: torch.Tensor          # [Bs * B] block tokens (pending token, then masks)
    meta: AttentionMetadata       # positions / slots / tables shared by draft and target
    block_size: int


class Worker:
    def __init__(self, target: TargetModel, draft: DFlashDraft | None, num_kv_blocks: int,
                 kv_block_size: int, block_size: int, draft_sampling: str = "greedy"):
        if draft_sampling not in ("greedy", "sample"):
            raise ValueError(f"draft_sampling must be 'greedy' or 'sample', got {draft_sampling!r}")
        self.target, self.draft = target, draft
        target.pack_weights()
        if draft is not None:
            draft.pack_weights()
        self.kv_block_size, self.block_size = kv_block_size, block_size
        self.draft_sampling = draft_sampling
        dtype, self.device = target.embed.dtype, target.embed.device
        self.target_cache = torch.zeros(target.kv_cache_shape(num_kv_blocks, kv_block_size),
                                        dtype=dtype, device=self.device)
        self.draft_cache = None if draft is None else torch.zeros(
            draft.kv_cache_shape(num_kv_blocks, kv_block_size), dtype=dtype, device=self.device)
        self.capture = () if draft is None else draft.cfg.target_layer_ids
        vocab = None if draft is None else draft.draft_vocab
        # the rows of the lm_head the draft may propose (None: all of them, via target.logits)
        self.draft_head = None if vocab is None else pack_linear_weight(target.output_rows(vocab))
        self.draft_vocab = vocab
        self.mask_token_id = None if draft is None else draft.cfg.mask_token_id
        self.prefill_seconds = 0.0   # time spent in prefill (benchmarks report it separately)

    # ------------------------------------------------------------------------------ prefill
    @torch.inference_mode()
    def prefill(self, requests: list[Request]) -> list[int]:
        """Run the prompts, fill the draft context, and return each request's first token."""
        start = time.perf_counter()
        lengths = [len(r.prompt_ids) for r in requests]
        meta = build_metadata([r.block_table for r in requests], [0] * len(requests), lengths,
                              self.kv_block_size, self.device)
        tokens = torch.tensor([t for r in requests for t in r.prompt_ids], device=self.device)
        hidden, features = self.target(tokens, meta, self.target_cache, self.capture)
        logits = self.target.logits(hidden[meta.cu_query_lens[1:].long() - 1])
        if self.draft is not None:
            self.draft.write_context(features, meta.positions, meta.slot_mapping,
                                     self.draft_cache)
        for r, n in zip(requests, lengths):
            r.num_cached = n
        params = [r.params for r in requests]
        probs = sampling.target_probs(logits[:, None], params)[:, 0]
        first = sampling.sample(probs, self._is_greedy(requests), self._generators(requests))
        first = first.tolist()
        self.prefill_seconds += time.perf_counter() - start
        return first

    # --------------------------------------------------------------------------- the step
    def prepare_query_inputs(self, requests: list[Request]) -> StepInputs:
        b = self.block_size
        tokens = torch.full((len(requests), b), -1 if self.mask_token_id is None
                            else self.mask_token_id, device=self.device)
        tokens[:, 0] = torch.tensor([r.output_ids[-1] for r in requests], device=self.device)
        meta = build_metadata([r.block_table for r in requests], [r.num_cached for r in requests],
                              [b] * len(requests), self.kv_block_size, self.device)
        return StepInputs(requests, tokens.flatten(), meta, b)

    @torch.inference_mode()
    def run_decode_draft(self, inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft tokens [Bs, B-1] (argmax, or sampled with dense probabilities [Bs, B-1, V])."""
        bs, b = len(inputs.requests), inputs.block_size
        hidden = self.draft(self.target.embed_tokens(inputs.tokens),
                            inputs.meta, self.draft_cache)
        # all B rows go through the lm_head: oneDNN's bf16 GEMM is much slower for B-1 rows than
        # for B (and for panel_linear in float32 the extra row costs next to nothing)
        logits = (self.target.logits(hidden) if self.draft_head is None else
                  linear(hidden, self.draft_head)).view(bs, b, -1)[:, 1:]
        if self.draft_sampling == "greedy":
            drafts = sampling.first_argmax(logits)
            return (drafts if self.draft_vocab is None else self.draft_vocab[drafts]), None
        probs = sampling.target_probs(logits, [r.params for r in inputs.requests])
        generators = [g for g in self._generators(inputs.requests) for _ in range(b - 1)]
        greedy = self._is_greedy(inputs.requests).repeat_interleave(b - 1)
        drafts = sampling.sample(probs.flatten(0, 1), greedy, generators).view(bs, b - 1)
        if self.draft_vocab is not None:   # q is zero outside the draft vocabulary
            full = probs.new_zeros(bs, b - 1, self.target.cfg.vocab_size)
            probs = full.index_copy_(2, self.draft_vocab, probs)
            drafts = self.draft_vocab[drafts]
        return drafts, probs

    @torch.inference_mode()
    def run_validate(self, inputs: StepInputs, draft_ids: torch.Tensor,
                     draft_probs: torch.Tensor | None):
        """Verify [pending, drafts] causally; returns (emitted, accepted counts, features)."""
        bs, b = len(inputs.requests), inputs.block_size
        tokens = inputs.tokens.view(bs, b).clone()
        tokens[:, 1:] = draft_ids
        hidden, features = self.target(tokens.flatten(), inputs.meta, self.target_cache,
                                       self.capture)
        logits = self.target.logits(hidden).view(bs, b, -1)
        out, accepted = sampling.verify(draft_ids, draft_probs, logits,
                                        [r.params for r in inputs.requests],
                                        self._generators(inputs.requests))
        accepted = accepted.tolist()   # the step's one host sync
        emitted = [row[: a + 1] for row, a in zip(out.tolist(), accepted)]
        return emitted, accepted, features

    @torch.inference_mode()
    def write_context_kv(self, inputs: StepInputs, features: torch.Tensor,
                         accepted: list[int]) -> None:
        """Append the features of each sequence's committed block rows (0..a) to the draft cache."""
        b = inputs.block_size
        keep = torch.arange(b, device=self.device)[None] <= \
            torch.tensor(accepted, device=self.device)[:, None]
        keep = keep.flatten()
        self.draft.write_context(features[keep], inputs.meta.positions[keep],
                                 inputs.meta.slot_mapping[keep], self.draft_cache)

    def step(self, requests: list[Request], proposer=None) -> tuple[list[list[int]], list[int]]:
        """One decode step for `requests`; returns the tokens each emitted and its accepted count.

        `proposer(inputs)` replaces the draft model (tests script acceptance with it).
        """
        inputs = self.prepare_query_inputs(requests)
        if self.block_size == 1:
            drafts, draft_probs = torch.empty(len(requests), 0, dtype=torch.int64), None
        else:
            drafts, draft_probs = (proposer or self.run_decode_draft)(inputs)
        emitted, accepted, features = self.run_validate(inputs, drafts, draft_probs)
        if self.draft is not None:
            self.write_context_kv(inputs, features, accepted)
        for r, a in zip(requests, accepted):
            r.num_cached += a + 1
        return emitted, accepted

    # ----------------------------------------------------------------------------- helpers
    def _is_greedy(self, requests):
        return torch.tensor([r.params.is_greedy for r in requests], device=self.device)

    @staticmethod
    def _generators(requests):
        return [r.generator for r in requests]
