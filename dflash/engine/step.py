"""The device work of a uniform greedy DFlash decode step, as one pure tensor function.

`decode_step` serves a batch in which every sequence drafts and verifies B - 1 tokens greedily:
  draft forward over each block [pending, MASK * (B-1)] -> B - 1 argmax drafts;
  target forward over [pending, drafts] (its K/V written to the target cache) -> argmax tokens;
  greedy acceptance: the drafts up to the first that differs from the target's token, then that
  token (the bonus token after a full match);
  the draft-context write (`context_kv`) of all B verified rows.
It takes device tensors and returns device tensors. Every shape follows from the batch size, B and
the block-table width, no value goes back to the host and no Python branch depends on one, so
`torch.compile(decode_step, fullgraph=True)` traces it as one graph and calls it again with new
positions, slots and lengths without recompiling: the CPU stand-in for an ACL graph capture.
The host builds the metadata before (`Worker.block_inputs`) and reads the emitted tokens
after, as vLLM and vllm-ascend do around their captured graphs. Not traceable yet: MoE targets
(the experts' token counts go to the host) and bfloat16 CPU weights packed for oneDNN (fake
tensors cannot stand for MKLDNN tensors).

Writing all B rows keeps committed-token semantics exact: row j of sequence b sits at position
n_b + j and only its first a_b + 1 rows are committed, so the next step starts at n_b + a_b + 1.
The rows beyond lie at or past that context length, which no attention reads (`context_lens`
bounds the cached keys), and the next step writes its own rows there before any later step reads
them; committed rows are never written again. The target cache has always worked this way.
"""

from __future__ import annotations

import torch

from .. import sampling
from ..models import AttentionMetadata, DFlashDraft, TargetModel
from ..models.layers import linear


def draft_logits(target: TargetModel, draft: DFlashDraft, draft_head: torch.Tensor | None,
                 tokens: torch.Tensor, meta: AttentionMetadata, draft_cache: torch.Tensor,
                 num_drafts: int) -> torch.Tensor:
    """The draft's logits [Bs, K, V'] for the first K = num_drafts masks of each block.

    tokens: [Bs, b] blocks [pending, MASK * (b-1)] (b <= B, K <= b-1); meta: their positions
    n .. n+b-1. The forward runs over the whole block (its attention is non-causal); only the K
    rows whose drafts can be verified go through the draft's last MLP and the lm_head: the
    target's (V' = V), or `draft_head`, the rows of a draft vocabulary (V' = its size)."""
    bs, b = tokens.shape
    rows = (torch.arange(bs, device=tokens.device)[:, None] * b
            + torch.arange(1, num_drafts + 1, device=tokens.device)).flatten()
    hidden = draft(target.embed_tokens(tokens.flatten()), meta, draft_cache, rows)
    logits = target.logits(hidden) if draft_head is None else linear(hidden, draft_head)
    return logits.view(bs, num_drafts, -1)


def greedy_drafts(logits: torch.Tensor, draft_vocab: torch.Tensor | None) -> torch.Tensor:
    """Argmax drafts [Bs, K] of draft logits [Bs, K, V'], as target token ids."""
    drafts = sampling.first_argmax(logits)
    return drafts if draft_vocab is None else draft_vocab[drafts]


def attention_buffers(target: TargetModel, draft: DFlashDraft, rows: int
                      ) -> dict[tuple[int, int], torch.Tensor]:
    """The attention outputs a step over `rows` block rows writes (`AttentionMetadata.
    attention_out`), allocated once before a graph capture: the step's ops then allocate none."""
    shapes = {(m.num_heads, m.head_dim) for m in (target.layers[0].attn, draft.cfg.attn)}
    return {s: torch.empty(rows, *s, dtype=target.dtype, device=target.norm.device)
            for s in shapes}


def decode_step(target: TargetModel, draft: DFlashDraft, tokens: torch.Tensor,
                meta: AttentionMetadata, target_cache: torch.Tensor, draft_cache: torch.Tensor,
                draft_head: torch.Tensor | None = None, draft_vocab: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One greedy decode step of Bs sequences (module docstring).

    Args:
        tokens: [Bs, B] int64 blocks [pending, MASK * (B-1)].
        meta: positions and slots of the block rows (n_b .. n_b+B-1 for sequence b, n_b its
            cached tokens), shared by the draft and the verify pass.
        target_cache, draft_cache: the paged caches, written in place.
        draft_head, draft_vocab: a draft vocabulary's lm_head rows and token ids, or None.

    Returns:
        output_ids [Bs, B] (the emitted tokens, then -1), num_accepted [Bs] (emitted = a + 1)
        and the drafts [Bs, B-1].
    """
    bs, b = tokens.shape
    drafts = greedy_drafts(draft_logits(target, draft, draft_head, tokens, meta, draft_cache,
                                        b - 1), draft_vocab)
    verify = torch.cat([tokens[:, :1], drafts], dim=1)
    hidden, features = target(verify.flatten(), meta, target_cache, draft.cfg.target_layer_ids)
    target_ids = sampling.first_argmax(target.logits(hidden)).view(bs, b)
    output_ids, num_accepted = sampling.greedy_accept(drafts, target_ids)
    draft.write_context(features, meta.positions, meta.slot_mapping, draft_cache,
                        check=not meta.checked)
    return output_ids, num_accepted, drafts
