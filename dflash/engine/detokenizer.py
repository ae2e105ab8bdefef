"""Incremental detokenization and stop strings (docs/design.md 4.5).

A request's text is `decode(tokenizer, output ids)`: the tokenizer's decode without special
tokens and without Hugging Face's `clean_up_tokenization_spaces`, i.e. the text the model
produced. dflash never applies that cleanup heuristic, whatever the tokenizer's config says
(Llama-3's ship with it on): it rewrites the model's output (" '" -> "'", " ," -> ",",
" n't" -> "n't"), and applied to a window of tokens it does not even agree with itself from one
window to the next, so a stream of `x = 'string'` came out as `x = 'tring'` (vLLM decodes without
it too). What the tokenizer's own decoder does (a WordPiece decoder's per-token cleanup, a
Metaspace decoder's leading-space strip) is part of its decode and is kept. Tokenizers whose
`decode` takes no `clean_up_tokenization_spaces` (a bare `tokenizers.Tokenizer`) have no such
step and are called without it (looked up once per tokenizer class).

Text is produced token by token, as streaming needs it, and is what decoding the whole output
at once gives (one corner below):

- Each new token is decoded together with the few tokens before it (`decode(ids[prefix:])` minus
  `decode(ids[prefix:read])`), so tokenizers that treat a leading space or a merge differently at
  the start of a slice still produce the right characters.
- While the decoded tail ends in U+FFFD (a multi-byte UTF-8 character or a byte-fallback sequence
  cut in the middle), nothing is emitted; the characters appear once the bytes that complete them
  arrive. `finish()` flushes what is left (a sequence that stays invalid decodes to U+FFFD, as it
  does in the full decode). A run that completes no character for PENDING tokens (stray bytes,
  skipped special tokens) has its text emitted up to a few tokens back, where it can no longer
  change, so the decoded windows, and the cost of a token, stay bounded.
- Stop strings are searched in the text after every token, so one that spans token boundaries,
  or completes in the middle of an accepted block, is found at the token that completes it. The
  text is cut before the match (vLLM's behaviour without `include_stop_str_in_output`). One
  regular expression of all of them scans only the tail where a new match can start, so the
  cost per token does not grow with the number of stop strings; the earliest match wins (on a
  tie, the string first in sorted order).
- Streamed deltas hold back the last `len(longest stop string) - 1` characters until the request
  finishes, since they may be the start of a match: the concatenated deltas equal the final text.

One corner where the streamed text can differ from the full decode: a SentencePiece byte-fallback
decoder (Llama-2, Mistral) turns a whole run of <0xNN> tokens into U+FFFD when the run is not
valid UTF-8, so a valid character spelled in byte tokens that the model follows with stray bytes
(never valid UTF-8) has already been streamed as that character. Text that is valid UTF-8, and
every byte-level BPE (GPT-2, Llama-3, Qwen) output, valid or not, streams exactly.
"""

from __future__ import annotations

import re

REPLACEMENT = "\ufffd"
PENDING = 8    # tokens without a complete character before the settled text is emitted
SETTLED = 4    # tokens kept back when it is: a character's bytes span at most 4


def decode(tokenizer, ids: list[int], skip_special_tokens: bool = True) -> str:
    """The text of `ids` as dflash reports it: `tokenizer.decode` without special tokens (by
    default) and without `clean_up_tokenization_spaces` (see the module docstring)."""
    return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens,
                            clean_up_tokenization_spaces=False)


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop: tuple[str, ...] = (), skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.text = ""                 # decoded so far (cut before a stop string once matched)
        self.stop_reason: str | None = None
        self.finished = False
        self._prefix = 0               # ids[_prefix:_read] were decoded last time, for context
        self._read = 0
        self._sent = 0                 # characters of `text` handed out by take_delta()
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self._pattern = re.compile("|".join(map(re.escape, sorted(set(self.stop))))) \
            if self.stop else None

    def _decode(self, ids: list[int]) -> str:
        return decode(self.tokenizer, ids, self.skip_special_tokens)

    def add(self, token: int) -> bool:
        """Append one token; True when it completes a stop string (the text is then cut)."""
        if self.finished:
            raise RuntimeError("the detokenizer has finished")
        self.ids.append(token)
        before = self._decode(self.ids[self._prefix:self._read])
        after = self._decode(self.ids[self._prefix:])
        if len(after) > len(before) and not after.endswith(REPLACEMENT):
            self._prefix, self._read = self._read, len(self.ids)
            return self._append(after[len(before):])
        if (len(self.ids) - self._read) % PENDING == 0:
            return self._settle(before, after)
        return False   # no complete character yet

    def _settle(self, before: str, after: str) -> bool:
        """Emit the text of all but the last SETTLED tokens once it can no longer change, so a
        long run that completes no character (stray bytes, skipped special tokens) is decoded
        in windows of bounded length, not from its start at every token. Only the last
        character, when it is a U+FFFD, may still become another one (its bytes may still
        arrive; it spans at most 3 tokens that hold a byte), and a text that already reads
        the same with SETTLED more tokens does not depend on them. Of SETTLED cuts in a row one
        falls between characters; where none is found (a byte-fallback run that a stray byte
        turned invalid, see above), the next try is PENDING tokens later."""
        stable = after[:-1] if after.endswith(REPLACEMENT) else after
        last = len(self.ids) - SETTLED
        for end in range(last, max(self._read, last - SETTLED), -1):
            text = self._decode(self.ids[self._prefix:end])
            if text.startswith(before) and stable.startswith(text):
                self._prefix, self._read = self._read, end
                return self._append(text[len(before):])
        return False

    def _append(self, new: str) -> bool:
        start = max(0, len(self.text) - self._hold)
        self.text += new
        match = None if self._pattern is None else self._pattern.search(self.text, start)
        if match is None:
            return False
        self.stop_reason = match.group()
        self.text = self.text[:match.start()]
        self.finished = True
        return True

    def finish(self) -> None:
        """No more tokens: flush the characters still waiting for bytes (once)."""
        if self.finished:
            return
        rest = self._decode(self.ids[self._prefix:])[len(self._decode(
            self.ids[self._prefix:self._read])):] if self._read < len(self.ids) else ""
        if rest:
            self._append(rest)
        self.finished = True

    def take_delta(self) -> str:
        """The text not handed out yet; before the end, minus the characters a stop string
        might still claim."""
        end = len(self.text) if self.finished else max(self._sent, len(self.text) - self._hold)
        delta = self.text[self._sent:end]
        self._sent = end
        return delta
