"""Sampling parameters, logits processing and the noise-drawing wrappers around the ops.

(Interim version; the full sampling layer lands with the rejection-sampling kernel.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import ops


@dataclass
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    max_tokens: int = 256
    stop_token_ids: tuple[int, ...] | list[int] = ()
    ignore_eos: bool = False
    seed: int | None = None

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


def make_generator(params: SamplingParams) -> torch.Generator:
    g = torch.Generator()
    if params.seed is None:
        g.seed()
    else:
        g.manual_seed(params.seed)
    return g


def target_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    out = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    for b, p in enumerate(params):
        if p.is_greedy:
            out[b] = torch.nn.functional.one_hot(logits[b].argmax(-1), logits.shape[-1]).float()
        else:
            out[b] = torch.softmax(logits[b].float() / p.temperature, -1)
    return out


def sample(probs, is_greedy, generators):
    out = []
    for b in range(probs.shape[0]):
        if bool(is_greedy[b]):
            out.append(int(probs[b].argmax()))
        else:
            e = torch.empty(probs.shape[-1]).exponential_(generator=generators[b])
            out.append(int((probs[b] / e).argmax()))
    return torch.tensor(out)


def rejection_sample(draft_token_ids, draft_probs, target_probs, is_greedy, generators):
    bs, k = draft_token_ids.shape
    v = target_probs.shape[-1]
    uniform = torch.zeros(bs, k)
    exponential = torch.ones(bs, v)
    for b in range(bs):
        if not bool(is_greedy[b]):
            uniform[b] = torch.rand(k, generator=generators[b])
            exponential[b] = torch.empty(v).exponential_(generator=generators[b])
    return ops.rejection_sample(draft_token_ids, draft_probs, target_probs, is_greedy, uniform,
                                exponential)
