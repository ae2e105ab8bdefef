"""The DFlash training objective (issue: draft trainer).

For random anchor positions inside the answer, a block [token at anchor, MASK x (B-1)] at
positions anchor..anchor+B-1 sees the target features of positions < anchor as context and its own
block bidirectionally (no other block); labels are the tokens at anchor+1..anchor+B-1, weighted by
exp(-(k - 1) / gamma) for block position k. Many anchors per sequence share one forward.

The draft layers are the inference layers (`DraftLayer.forward`); only attention differs: plain
PyTorch over in-memory context K/V with a block mask instead of the paged op.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

from ..models import DFlashDraft, TargetModel
from ..models.layers import prefill_metadata, rms_norm, rope


@dataclass
class Batch:
    tokens: list[torch.Tensor]      # per sequence [S] int64 (prompt + answer)
    anchors: list[torch.Tensor]     # per sequence [A] anchor positions (sorted)


def sample_anchors(prompt_len: int, total_len: int, count: int, generator: torch.Generator,
                   end: int | None = None) -> torch.Tensor:
    """Up to `count` distinct anchors in [prompt_len, total_len - 2] (each has >= 1 label) and
    below `end` (see anchor_end)."""
    stop = total_len - 1 if end is None else min(total_len - 1, end)
    candidates = torch.arange(prompt_len, max(prompt_len, stop))
    if len(candidates) > count:
        candidates = candidates[torch.randperm(len(candidates), generator=generator)[:count]]
    return candidates.sort().values


def anchor_end(draft: DFlashDraft) -> int:
    """The first anchor whose block runs past the draft's RoPE table (the length served when the
    answers were generated): the engine drafts no block past max_model_len, so none trains."""
    return draft.cos_sin.shape[0] - draft.cfg.block_size + 1


@torch.no_grad()
def target_features(target: TargetModel, tokens: list[torch.Tensor],
                    layer_ids: tuple[int, ...], kv_block_size: int = 64) -> torch.Tensor:
    """Captured target features of every position of every sequence: [sum S, n_aux * H]."""
    lengths = [len(t) for t in tokens]
    meta = prefill_metadata(lengths, kv_block_size)
    blocks = int(meta.block_table.max()) + 1
    cache = torch.empty(target.kv_cache_shape(blocks, kv_block_size), dtype=target.dtype)
    _, features = target(torch.cat(tokens), meta, cache, layer_ids)
    return features


def position_weights(block_size: int, gamma: float) -> torch.Tensor:
    """Loss weight of block positions 1..B-1: exp(-(k - 1) / gamma)."""
    return torch.exp(-torch.arange(block_size - 1, dtype=torch.float32) / gamma)


def block_logits(draft: DFlashDraft, target: TargetModel, batch: Batch,
                 features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft logits at block positions 1..B-1 of every anchor [sum A, B-1, V'] (float32) over the
    draft vocabulary (V' = V without one), and the labels [sum A, B-1] as full-vocabulary token
    ids (-1 past the end of a sequence)."""
    cfg = draft.cfg
    b, a = cfg.block_size, cfg.attn
    lengths = [len(t) for t in batch.tokens]
    ctx_positions = torch.cat([torch.arange(n) for n in lengths])
    offsets = torch.arange(b)
    block_positions = torch.cat([(anc[:, None] + offsets).flatten() for anc in batch.anchors])
    block_tokens = torch.full_like(block_positions, cfg.mask_token_id)
    block_tokens[::b] = torch.cat([t[anc] for t, anc in zip(batch.tokens, batch.anchors)])
    labels = torch.cat([_labels(t, anc, b) for t, anc in zip(batch.tokens, batch.anchors)])

    c = rms_norm(F.linear(features, draft.fc), draft.hidden_norm, a.rms_norm_eps)
    ctx_cos_sin = draft.cos_sin[ctx_positions]
    masks = [_block_mask(n, anc, b) for n, anc in zip(lengths, batch.anchors)]
    x = target.embed_tokens(block_tokens).float()
    cos_sin = draft.cos_sin[block_positions]
    for i, layer in enumerate(draft.layers):
        kv_w, kv_b = draft.layer_kv(i)
        ctx_k, ctx_v = F.linear(c, kv_w, kv_b).view(-1, 2, a.num_kv_heads, a.head_dim).unbind(1)
        ctx_k = rope(rms_norm(ctx_k, draft.k_norm[i], a.rms_norm_eps), ctx_cos_sin)
        attend = partial(_attend, ctx_k, ctx_v, lengths, batch.anchors, masks, b)
        x = layer(x, cos_sin, kv_w, kv_b, draft.k_norm[i], attend)
    hidden = rms_norm(x, draft.norm, a.rms_norm_eps).view(-1, b, a.hidden_size)[:, 1:]
    head = target.output_embedding if draft.draft_vocab is None else \
        target.output_embedding[draft.draft_vocab]
    return F.linear(hidden.to(head.dtype), head).float(), labels


def predictions(draft: DFlashDraft, logits: torch.Tensor) -> torch.Tensor:
    """Greedy draft tokens (full-vocabulary ids) from `block_logits` logits."""
    best = logits.argmax(-1)
    return best if draft.draft_vocab is None else draft.draft_vocab[best]


def _vocab_labels(draft: DFlashDraft, labels: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Labels as indices into the draft vocabulary; -1 where outside it (or past the end)."""
    if draft.draft_vocab is None:
        return labels
    index = torch.full((vocab_size,), -1, dtype=torch.long)
    index[draft.draft_vocab] = torch.arange(len(draft.draft_vocab))
    return torch.where(labels >= 0, index[labels.clamp(min=0)], -1)


def draft_loss(draft: DFlashDraft, target: TargetModel, batch: Batch, features: torch.Tensor,
               gamma: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weighted loss, correct predictions per block position [B-1], labels per position [B-1])."""
    logits, labels = block_logits(draft, target, batch, features)
    targets = _vocab_labels(draft, labels, target.cfg.vocab_size)
    learnable = targets >= 0   # tokens outside the draft vocabulary cannot be proposed
    ce = F.cross_entropy(logits.flatten(0, 1), targets.clamp(min=0).flatten(),
                         reduction="none").view(labels.shape)
    weights = position_weights(draft.cfg.block_size, gamma)[None] * learnable
    loss = (ce * weights).sum() / weights.sum().clamp(min=1e-6)
    valid = labels >= 0
    correct = (predictions(draft, logits) == labels) & valid
    return loss, correct.sum(0), valid.sum(0)


def _labels(tokens: torch.Tensor, anchors: torch.Tensor, b: int) -> torch.Tensor:
    """[A, B-1] tokens at anchor+1..anchor+B-1, -1 past the end of the sequence."""
    idx = anchors[:, None] + torch.arange(1, b)
    return torch.where(idx < len(tokens), tokens[idx.clamp(max=len(tokens) - 1)], -1)


def _block_mask(length: int, anchors: torch.Tensor, b: int) -> torch.Tensor:
    """[A*B, S + A*B] bool: a block row sees context positions < its anchor and its own block."""
    rows = anchors.repeat_interleave(b)
    ctx = torch.arange(length)[None] < rows[:, None]
    block_id = torch.arange(len(anchors)).repeat_interleave(b)
    own = block_id[:, None] == block_id[None]
    return torch.cat([ctx, own], dim=1)


def _attend(ctx_k, ctx_v, lengths, anchors, masks, b, q, k, v):
    """Attention of every sequence's block rows over its context K/V and its own blocks."""
    group = q.shape[1] // k.shape[1]
    out, row, ctx = [], 0, 0
    for n, anc, mask in zip(lengths, anchors, masks):
        rows = len(anc) * b
        keys = torch.cat([ctx_k[ctx:ctx + n], k[row:row + rows]]).to(q.dtype)
        values = torch.cat([ctx_v[ctx:ctx + n], v[row:row + rows]]).to(q.dtype)
        o = F.scaled_dot_product_attention(
            q[row:row + rows].transpose(0, 1)[None],
            keys.repeat_interleave(group, 1).transpose(0, 1)[None],
            values.repeat_interleave(group, 1).transpose(0, 1)[None], attn_mask=mask)
        out.append(o[0].transpose(0, 1))
        row, ctx = row + rows, ctx + n
    return torch.cat(out)
