"""Per-request sampling: parameters, logits processing into target probabilities, and the noise
around `dflash.ops.rejection_sample`.

The noise is counter-based (Philox4x32-10): every value is a pure function of the request's seed,
the position of the first token the call decides (its offset, which grows with every decoded
token), a stream id, a row and the element index. It is computed with tensor ops on the device of
the probabilities, so no `[Bs, V]` tensor is drawn on the host, and a seeded request gets the same
noise whatever else is batched with it. Each draw has its own stream: the acceptance coins
(uniform [0, 1)), the target's exponential race (argmax p / E, E ~ Exp(1), is a draw from
p / sum(p)) and the draft's race, so no value serves twice.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from .. import ops
from . import noise

GREEDY_TEMPERATURE = 1e-5


class ParamError(ValueError):
    """A sampling parameter that cannot be honoured; `param` names it (the server's 400 reports
    it as the error's `param`)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass
class SamplingParams:
    """How one request picks tokens.

    temperature: below GREEDY_TEMPERATURE (including 0) means greedy (argmax): dividing float32
    logits by a smaller one overflows or underflows, and the softmax is one-hot anyway.
    Otherwise logits are divided by it before softmax.
    top_k: keep the k most likely tokens (ties at the k-th logit are all kept); 0 disables, and
    a k beyond the vocabulary keeps every token.
    top_p: keep the smallest most-likely set whose probability reaches top_p; 1 disables.
    max_tokens: generation budget (new tokens). stop_token_ids: extra tokens that end the request
    (a stop token is the request's last id; its text is not output, as in vLLM).
    stop: strings that end the request when they appear in the output text (found across token
    boundaries and inside an accepted block; the text ends before the match, and the tokens after
    the one that completed it are dropped). Needs a tokenizer.
    ignore_eos: keep generating past EOS. seed: per-request seed; None draws a fresh random seed.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    max_tokens: int = 256
    stop_token_ids: tuple[int, ...] | list[int] = ()
    ignore_eos: bool = False
    seed: int | None = None
    stop: tuple[str, ...] | list[str] | str = ()

    def __post_init__(self) -> None:
        if not (_is_number(self.temperature) and math.isfinite(self.temperature)
                and self.temperature >= 0):
            raise ParamError("temperature", f"temperature must be a finite number >= 0 "
                             f"(0 = greedy), got {self.temperature!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ParamError("top_k", f"top_k must be an integer >= 0 (0 = disabled), "
                             f"got {self.top_k!r}")
        if not (_is_number(self.top_p) and 0 < self.top_p <= 1):
            raise ParamError("top_p", f"top_p must be in (0, 1] (1 = disabled), "
                             f"got {self.top_p!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ParamError("max_tokens", f"max_tokens must be an integer >= 1, "
                             f"got {self.max_tokens!r}")
        if isinstance(self.stop_token_ids, (str, bytes)) or \
                not isinstance(self.stop_token_ids, Iterable):
            raise ParamError("stop_token_ids", f"stop_token_ids must be a list of token ids, "
                             f"got {self.stop_token_ids!r:.80}")
        self.stop_token_ids = tuple(self.stop_token_ids)   # once: it may be an iterator
        bad = [t for t in self.stop_token_ids if not _is_int(t) or t < 0]
        if bad:
            raise ParamError("stop_token_ids", f"stop_token_ids must be non-negative integers, "
                             f"got {bad[0]!r}")
        if not isinstance(self.stop, (str, list, tuple)):
            raise ParamError("stop", f"stop must be a string or a list of non-empty strings, "
                             f"got {self.stop!r:.80}")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if not all(isinstance(s, str) and s for s in stop):
            raise ParamError("stop", f"stop must be a string or a list of non-empty strings, "
                             f"got {self.stop!r:.80}")
        self.stop = stop
        if not isinstance(self.ignore_eos, bool):
            raise ParamError("ignore_eos", f"ignore_eos must be True or False, "
                             f"got {self.ignore_eos!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**64):
            raise ParamError("seed", f"seed must be None or an integer in [0, 2**64), "
                             f"got {self.seed!r}")
        # numpy scalars pass the checks; the engine keeps Python numbers
        self.temperature, self.top_p = float(self.temperature), float(self.top_p)
        self.top_k, self.max_tokens = int(self.top_k), int(self.max_tokens)
        self.stop_token_ids = tuple(int(t) for t in self.stop_token_ids)
        self.seed = None if self.seed is None else int(self.seed)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def request_seed(params: SamplingParams) -> int:
    """The seed a request's noise is keyed by: `params.seed`, or a fresh random one when None."""
    return noise.fresh_seed() if params.seed is None else params.seed


def target_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Turn target logits [Bs, R, V] into the probabilities `rejection_sample` consumes.

    Sampling rows: softmax of the temperature-scaled logits after top-k then top-p filtering, in
    float32. Greedy rows: one-hot at argmax(logits) (first index on ties), so the op's argmax is
    the logits' argmax exactly (a softmax could round near-ties into exact ties).
    """
    if logits.dim() != 3 or logits.shape[0] != len(params):
        raise ValueError(f"logits must be [Bs, R, V] with Bs = {len(params)} (one row of "
                         f"params per sequence), got shape {list(logits.shape)}")
    is_greedy = [p.is_greedy for p in params]
    if all(is_greedy):
        return one_hot_argmax(logits)
    if not any(is_greedy):   # no rows to pick apart: [Bs, R, V] buffers cost their page faults
        return _sampling_probs(logits, params)
    greedy = torch.tensor(is_greedy, device=logits.device)
    out = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    out[greedy] = one_hot_argmax(logits[greedy])
    out[~greedy] = _sampling_probs(logits[~greedy], [p for p in params if not p.is_greedy])
    return out


def _sampling_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """target_probs of sampling rows only."""
    col = lambda xs: torch.tensor(xs, device=logits.device)[:, None, None]  # noqa: E731
    x = logits.float() / col([p.temperature for p in params]).float()
    # a k past the vocabulary keeps every token (and would overflow an int64 tensor)
    top_k = col([min(p.top_k, logits.shape[-1]) for p in params])
    x = _top_k_top_p(x, top_k, col([p.top_p for p in params]))
    return torch.softmax(x, dim=-1)


def one_hot_argmax(logits: torch.Tensor) -> torch.Tensor:
    """float32 one-hot at argmax(logits) over the last dim (first index on ties)."""
    top = first_argmax(logits)[..., None]
    out = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
    return out.scatter_(-1, top, 1.0)


def first_argmax(x: torch.Tensor) -> torch.Tensor:
    """argmax over the last dim, first index on ties (`ops.top_k` with k = 1)."""
    return ops.top_k(x, 1)[1][..., 0]


def _top_k_top_p(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask with -inf the logits x [n, R, V] outside each row's top-k, then outside its top-p.

    top_k / top_p are [n, 1, 1] per-row settings (0 / 1 disable), so mixed rows run in one pass.
    """
    use_k, use_p = bool((top_k > 0).any()), bool((top_p < 1).any())
    if not (use_k or use_p):
        return x
    if not use_p:  # top-k alone only needs the k largest values of each row
        largest = x.topk(int(top_k.clamp(max=x.shape[-1]).max()), dim=-1).values
        return x.masked_fill(x < _kth_largest(largest, top_k), float("-inf"))
    sorted_x, order = x.sort(dim=-1, descending=True, stable=True)
    if use_k:
        sorted_x = sorted_x.masked_fill(sorted_x < _kth_largest(sorted_x, top_k), float("-inf"))
    probs = torch.softmax(sorted_x, dim=-1)
    mass_before = probs.cumsum(-1) - probs
    # keep a token while the more likely ones hold less than top_p; the first always stays
    drop = (mass_before >= top_p) & (top_p < 1)
    drop[..., 0] = False
    sorted_x = sorted_x.masked_fill(drop, float("-inf"))
    return torch.empty_like(x).scatter_(-1, order, sorted_x)


def _kth_largest(largest: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """[n, R, 1] k-th value of each row of `largest` (sorted descending), -inf where k = 0."""
    idx = (top_k.clamp(1, largest.shape[-1]) - 1).expand(*largest.shape[:2], 1)
    return torch.where(top_k > 0, largest.gather(-1, idx), float("-inf"))


def _sampling_rows(is_greedy: torch.Tensor, seeds: Sequence[int], offsets: Sequence[int]):
    """(row indices on the device, their seeds, their offsets) of the sampling rows."""
    if not len(seeds) == len(offsets) == len(is_greedy):
        raise ValueError(f"expected one seed and one offset per row: {len(is_greedy)} rows, got "
                         f"{len(seeds)} seeds and {len(offsets)} offsets")
    rows = [i for i, greedy in enumerate(is_greedy.tolist()) if not greedy]
    return (torch.tensor(rows, dtype=torch.int64, device=is_greedy.device),
            [seeds[i] for i in rows], [offsets[i] for i in rows])


def sample(probs: torch.Tensor, is_greedy: torch.Tensor, seeds: Sequence[int],
           offsets: Sequence[int], stream: int = noise.TARGET_RACE) -> torch.Tensor:
    """One token per row of probs [Bs, V] (or [Bs, R, V]: R tokens per sequence, row j of noise
    row j): argmax for greedy rows (first index on ties), an exponential race argmax(p / E) for
    the others, E ~ Exp(1) keyed by the row's seed and offset in `stream`."""
    tokens = probs.argmax(-1)
    rows, seeds, offsets = _sampling_rows(is_greedy, seeds, offsets)
    if len(rows):
        p = probs[rows].float()
        e = noise.exponential(seeds, offsets, stream, 1 if p.dim() == 2 else p.shape[1],
                              p.shape[-1], p.device)
        tokens[rows] = (p / e.view(p.shape)).argmax(-1)
    return tokens


def verify(draft_token_ids: torch.Tensor, draft_probs: torch.Tensor | None, logits: torch.Tensor,
           num_drafts: Sequence[int], params: Sequence[SamplingParams], seeds: Sequence[int],
           offsets: Sequence[int]) -> tuple[list[list[int]], list[int]]:
    """Verify a ragged batch: row i checks its first k = num_drafts[i] drafts of
    draft_token_ids [Bs, K] (draft_probs [Bs, K, V] or None for one-hot proposals) against its
    k + 1 rows of the target's logits [sum(k + 1), V] (row i's after row i - 1's). Returns each
    row's emitted tokens (accepted drafts, then the correction or bonus token) and its accepted
    count; reading them back is one host sync.

    An all-greedy batch skips the probabilities: with one-hot targets `rejection_sample` accepts
    while the draft equals the argmax, which `greedy_accept` computes for every row at once
    without writing sum(k + 1) * V floats. Otherwise `rejection_sample` runs once per distinct
    k (each row's bonus token must come from its own row k)."""
    bs, width = draft_token_ids.shape
    device = logits.device
    starts = [0]
    for k in num_drafts:
        starts.append(starts[-1] + k + 1)
    if all(p.is_greedy for p in params):
        if not any(num_drafts):   # plain decoding: each row's token is its argmax
            return [[t] for t in first_argmax(logits).tolist()], [0] * bs
        # padded to [Bs, K + 1]: drafts past k never match (-1), so acceptance stops at k
        rows = torch.tensor([i * (width + 1) + j for i, k in enumerate(num_drafts)
                             for j in range(k + 1)], device=device)
        target_ids = torch.full((bs * (width + 1),), -1, device=device)
        target_ids[rows] = first_argmax(logits)
        limit = torch.tensor(list(num_drafts), device=device)[:, None]
        drafts = torch.where(torch.arange(1, width + 1, device=device)[None] <= limit,
                             draft_token_ids, -1)
        out, accepted = greedy_accept(drafts, target_ids.view(bs, width + 1))
        out, accepted = out.tolist(), accepted.tolist()
        return [row[:a + 1] for row, a in zip(out, accepted)], accepted
    emitted: list[list[int]] = [[] for _ in range(bs)]
    accepted = [0] * bs
    for k in sorted(set(num_drafts)):
        group = [i for i, n in enumerate(num_drafts) if n == k]
        idx = torch.tensor(group, device=device)
        rows = torch.tensor([starts[i] + j for i in group for j in range(k + 1)], device=device)
        group_params = [params[i] for i in group]
        is_greedy = torch.tensor([p.is_greedy for p in group_params], device=device)
        tokens, counts = rejection_sample(
            draft_token_ids[idx, :k], None if draft_probs is None else draft_probs[idx, :k],
            target_probs(logits[rows].view(len(group), k + 1, -1), group_params), is_greedy,
            [seeds[i] for i in group], [offsets[i] for i in group])
        for i, row, a in zip(group, tokens.tolist(), counts.tolist()):
            emitted[i], accepted[i] = row[:a + 1], a
    return emitted, accepted


def greedy_accept(draft_token_ids: torch.Tensor, target_ids: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification: each row keeps its drafts [Bs, K] up to the first that differs from
    the target's choice target_ids [Bs, K + 1], then the target's token there (the bonus token
    after a full match). Returns (output_token_ids [Bs, K + 1] padded with -1, num_accepted)."""
    k = draft_token_ids.shape[1]
    if target_ids.shape != (draft_token_ids.shape[0], k + 1):
        raise ValueError(f"target_ids must be [Bs, K + 1] = {[draft_token_ids.shape[0], k + 1]}, "
                         f"got {list(target_ids.shape)}")
    accepted = (draft_token_ids == target_ids[:, :k]).cumprod(1).sum(1)
    beyond = torch.arange(k + 1, device=target_ids.device)[None] > accepted[:, None]
    return target_ids.masked_fill(beyond, -1), accepted


def rejection_sample(draft_token_ids: torch.Tensor, draft_probs: torch.Tensor | None,
                     target_probs: torch.Tensor, is_greedy: torch.Tensor, seeds: Sequence[int],
                     offsets: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Compute each sampling row's noise from its seed and offset (the position of the first
    token the row decides), then run `dflash.ops.rejection_sample`.

    Per sampling row: K coins (stream COINS) and V Exp(1) values (stream TARGET_RACE); greedy
    rows get inert noise (they use none). Returns (output_token_ids [Bs, K + 1] padded with -1,
    num_accepted [Bs]).
    """
    bs, k = draft_token_ids.shape
    v, device = target_probs.shape[-1], target_probs.device
    uniform = torch.zeros(bs, k, device=device)
    exponential = torch.ones(bs, v, device=device)
    rows, seeds, offsets = _sampling_rows(is_greedy, seeds, offsets)
    if len(rows):
        uniform[rows] = noise.uniform(seeds, offsets, noise.COINS, 1, k, device)[:, 0]
        exponential[rows] = noise.exponential(seeds, offsets, noise.TARGET_RACE, 1, v, device)[:, 0]
    # The probabilities come from target_probs / the draft and the noise from here: the kernel
    # checks only the values it reads.
    return ops.rejection_sample(draft_token_ids, draft_probs, target_probs, is_greedy,
                                uniform, exponential, check=False)
