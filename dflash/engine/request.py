"""Per-request state and the outputs handed back to users."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..sampling import SamplingParams


@dataclass
class RequestMetrics:
    """Speculative-decoding figures for one request (names as in vLLM's spec-decode metrics)."""

    num_drafts: int = 0                    # verification steps that carried a draft
    num_draft_tokens: int = 0              # drafted tokens proposed
    num_accepted_tokens: int = 0           # drafted tokens accepted
    accepted_per_position: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    generated_tokens: int = 0
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None

    @property
    def mean_acceptance_length(self) -> float:
        """tau: tokens committed per verification step (accepted drafts + 1)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def time_per_output_token(self) -> float | None:
        if self.finish_time is None or self.first_token_time is None or \
                self.generated_tokens < 2:
            return None
        return (self.finish_time - self.first_token_time) / (self.generated_tokens - 1)

    def record_step(self, proposed: int, accepted: int, positions: int | None = None) -> None:
        """A verification step of `proposed` drafts (a chain, or a tree's nodes) over
        `positions` block positions (default: proposed, a chain's) that accepted `accepted`."""
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        positions = proposed if positions is None else positions
        if len(self.accepted_per_position) < positions:
            self.accepted_per_position += [0] * (positions - len(self.accepted_per_position))
        for i in range(accepted):
            self.accepted_per_position[i] += 1


@dataclass
class RequestOutput:
    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str           # "stop" (a stop token or string), "length" (max_tokens or
    #                              max_model_len), "abort" (LLMEngine.abort) or "error"
    metrics: RequestMetrics
    stop_reason: int | str | None = None   # the stop token id or stop string that ended it
    error: str | None = None               # finish_reason "error": what went wrong


class Request:
    """A prompt being decoded. `tokens` holds prompt + output; the last output token is the one
    the next step feeds to the target (its K/V are not cached yet). `seed` keys its sampling
    noise (dflash/noise.py)."""

    def __init__(self, request_id: int, prompt_ids: list[int], params: SamplingParams,
                 seed: int, stop_ids: frozenset[int], detok=None):
        self.request_id = request_id
        self.prompt_ids = list(prompt_ids)
        self.output_ids: list[int] = []
        self.params = params
        self.seed = seed
        self.stop_ids = stop_ids
        self.block_table: list[int] = []
        self.num_cached = 0   # tokens with cached target K/V and draft context, except:
        # draft-context rows held back (features, position, slot): Worker.write_draft_context
        self.context_backlog: list = []
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.error: str | None = None
        self.detok = detok      # an IncrementalDetokenizer, or None (no text, no stop strings)
        self.metrics = RequestMetrics(prompt_tokens=len(prompt_ids),
                                      arrival_time=time.perf_counter())

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def append(self, new_tokens: list[int]) -> None:
        """Commit emitted tokens, honouring stop tokens, stop strings and max_tokens exactly."""
        if self.metrics.first_token_time is None and new_tokens:
            self.metrics.first_token_time = time.perf_counter()
        for token in new_tokens:
            self.output_ids.append(token)
            # a stop token ends the ids but not the text, as in vLLM (whose default,
            # include_stop_str_in_output=False, is the server's only choice)
            if token in self.stop_ids:
                self.finish_reason, self.stop_reason = "stop", token
            elif self.detok is not None and self.detok.add(token):
                self.finish_reason, self.stop_reason = "stop", self.detok.stop_reason
            elif len(self.output_ids) >= self.params.max_tokens:
                self.finish_reason = "length"
            if self.finished:
                self.finish(self.finish_reason)
                break
        self.metrics.generated_tokens = len(self.output_ids)

    def finish(self, reason: str, flush: bool = True) -> None:
        """End the request (the detokenizer flushes unless told not to; the finish time is
        recorded)."""
        self.finish_reason = reason
        if self.detok is not None and flush:
            self.detok.finish()
            # the flushed characters completed a stop string: the text ends there
            if self.detok.stop_reason is not None and reason in ("stop", "length"):
                self.finish_reason, self.stop_reason = "stop", self.detok.stop_reason
        self.metrics.finish_time = time.perf_counter()
