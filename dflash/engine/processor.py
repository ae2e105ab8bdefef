"""Requests in and outputs out: prompts to checked token ids, sampling params to a `Request`,
a finished `Request` to its `RequestOutput`."""

from __future__ import annotations

import dataclasses
import numbers

from .. import sampling
from ..sampling import SamplingParams
from .cache import BlockAllocator
from .detokenizer import IncrementalDetokenizer, decode
from .request import Request, RequestOutput


class Processor:
    """Builds the engine's requests against its limits.

    Args:
        tokenizer: the target's tokenizer, or None (prompts must then be token ids).
        vocab_size: the target's vocabulary size (prompt ids must be below it).
        stop_ids: the token ids that end a request unless it sets ignore_eos.
        block_size: DFlash block size B (every request needs room for one verify block).
        max_model_len: longest sequence served.
        allocator: the paged cache a request's whole reservation must fit in.
    """

    def __init__(self, tokenizer, vocab_size: int, stop_ids: set[int], block_size: int,
                 max_model_len: int, allocator: BlockAllocator):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_ids = frozenset(stop_ids)
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.allocator = allocator
        self._next_id = 0

    def chat_prompt(self, message: str) -> str:
        """`message` as a single-turn chat with the generation prompt, via the tokenizer's
        chat template."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("the target has no tokenizer chat template")
        if not isinstance(message, str):
            raise TypeError(f"a chat message must be a string, got {type(message).__name__}")
        return self.tokenizer.apply_chat_template([{"role": "user", "content": message}],
                                                  tokenize=False, add_generation_prompt=True)

    def encode(self, prompt) -> list[int]:
        """The token ids a request runs for `prompt` (a string, or a list or tuple of token
        ids); raises ValueError for an empty prompt or an id outside the vocabulary, TypeError
        for anything else."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this target has no tokenizer: pass prompts as token id lists")
            ids = self.tokenizer.encode(prompt, add_special_tokens=False)
            if not ids:
                raise ValueError("empty prompt: the text encodes to no tokens")
        elif isinstance(prompt, (list, tuple)):
            bad = [t for t in prompt if not isinstance(t, numbers.Integral)
                   or isinstance(t, bool)]
            if bad:
                raise TypeError(f"prompt token ids must be integers, got "
                                f"{type(bad[0]).__name__} {bad[0]!r:.40}")
            ids = [int(t) for t in prompt]
            if not ids:
                raise ValueError("empty prompt")
        else:
            raise TypeError(f"a prompt must be a string or a list of token ids, got "
                            f"{type(prompt).__name__}")
        if not all(0 <= t < self.vocab_size for t in ids):
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_size})")
        return ids

    def admit(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError, naming the sizes, if a request of these prompt tokens and params
        can never run here (too long for max_model_len or for the whole cache)."""
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens does not fit: it leaves no "
                             f"room for an output token within max_model_len "
                             f"{self.max_model_len}")
        blocks = self.allocator.blocks_for(self.reservation(len(prompt_ids), params))
        if blocks > self.allocator.num_blocks:
            raise ValueError(f"request of {len(prompt_ids)} prompt tokens + max_tokens "
                             f"{params.max_tokens} does not fit in the {self.allocator.num_blocks}"
                             f" cache blocks of {self.allocator.block_size} tokens: raise "
                             "num_kv_blocks or lower max_tokens")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer (this target has none)")

    def reservation(self, prompt_len: int, params: SamplingParams) -> int:
        """Cache tokens a request may ever need: its longest length plus one verify block."""
        return min(prompt_len + params.max_tokens, self.max_model_len) + self.block_size

    def request(self, prompt, params: SamplingParams, detokenize: bool = False) -> Request:
        """A new request for `prompt`, admitted (see `admit`); `detokenize` keeps its text
        incrementally (stop strings imply it)."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be SamplingParams, got "
                            f"{type(params).__name__}")
        # a copy, checked again: fields set since construction, and later changes the caller
        # makes to its object, would otherwise reach the request unchecked
        params = dataclasses.replace(params)
        ids = self.encode(prompt)
        self.admit(ids, params)
        stop = set(params.stop_token_ids) | (set() if params.ignore_eos else self.stop_ids)
        detok = IncrementalDetokenizer(self.tokenizer, params.stop) if self.tokenizer is not None \
            and (detokenize or params.stop) else None
        request = Request(self._next_id, ids, params, sampling.request_seed(params),
                          frozenset(stop), detok)
        self._next_id += 1
        return request

    def output(self, r: Request) -> RequestOutput:
        # the text ends before a stop token (Request.append)
        ids = r.output_ids[:-1] if r.stop_reason in r.stop_ids else r.output_ids
        text = r.detok.text if r.detok is not None else None if self.tokenizer is None else \
            decode(self.tokenizer, ids)
        return RequestOutput(r.request_id, r.prompt_ids, r.output_ids, text, r.finish_reason,
                             r.metrics, r.stop_reason, r.error)
