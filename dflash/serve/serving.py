"""From an OpenAI request to what the engine runs: sampling parameters and prompt token ids.

Everything here is bounded before it costs anything: stop strings by count and length, prompt
text by a length no prompt that fits max_model_len can exceed (checked before it is encoded),
chat templates by refusing ones a request supplies unless the server trusts them. Encoding and
template rendering are synchronous and run in an executor, never on the event loop.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ..sampling import ParamError, SamplingParams
from . import protocol
from .errors import ApiError

MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 1024

# keys of chat_template_kwargs that would change what apply_chat_template returns, or that the
# request sets elsewhere: dropped
RESERVED_TEMPLATE_KWARGS = frozenset({
    "tokenize", "return_dict", "return_tensors", "return_assistant_tokens_mask",
    "tokenizer_kwargs", "padding", "truncation", "max_length", "conversation",
    "add_generation_prompt", "chat_template"})


def _unset(value) -> bool:
    return value is None or value is False or value in ((), [], {})


# Request fields dflash cannot honour, with a test for "not used": any other value is a 400
# naming the field, never silently ignored.
NOT_HONOURED = {
    "n": lambda v: v == 1,
    "best_of": lambda v: v in (None, 1),
    "echo": _unset,
    "suffix": lambda v: not v,
    "logprobs": _unset,
    "top_logprobs": _unset,
    "prompt_logprobs": _unset,
    "presence_penalty": lambda v: v in (None, 0),
    "frequency_penalty": lambda v: v in (None, 0),
    "repetition_penalty": lambda v: v in (None, 1),
    "length_penalty": lambda v: v in (None, 1),
    "min_p": lambda v: v in (None, 0),
    "min_tokens": lambda v: v in (None, 0),
    "logit_bias": _unset,
    "bad_words": _unset,
    "allowed_token_ids": _unset,
    "tools": _unset,
    "tool_choice": lambda v: v in (None, "none"),
    "functions": _unset,
    "function_call": lambda v: v in (None, "none"),
    "response_format": lambda v: v is None or (isinstance(v, dict) and v.get("type") == "text"),
    "guided_json": _unset,
    "guided_regex": _unset,
    "guided_choice": _unset,
    "guided_grammar": _unset,
    "structured_outputs": _unset,
    "use_beam_search": _unset,
    "include_stop_str_in_output": _unset,
    "skip_special_tokens": lambda v: v in (None, True),
    "truncate_prompt_tokens": _unset,
    "audio": _unset,
    "modalities": lambda v: v in (None, ["text"]),
    "prediction": _unset,
}


@dataclass(frozen=True)
class Options:
    """The server's limits and trust settings (`dflash serve --help` documents each)."""

    api_key: str | None = None
    max_queue: int = 256
    max_request_bytes: int = 4 * 2**20
    stream_timeout: float = 30.0
    body_timeout: float = 30.0
    trust_request_chat_template: bool = False
    allowed_hosts: tuple[str, ...] = ()


def check_honoured(req: protocol.SamplingFields) -> None:
    for name, unused in NOT_HONOURED.items():
        value = getattr(req, name, None)
        if not unused(value):
            shown = json.dumps(value, default=str)
            shown = shown if len(shown) <= 60 else shown[:57] + "..."
            raise ApiError(400, f"{name}={shown} is not supported by dflash: leave {name} out",
                           name)


def sampling_params(req: protocol.SamplingFields, max_tokens: int | None,
                    default_max_tokens: int, max_tokens_field: str = "max_tokens"
                    ) -> SamplingParams:
    """The request's SamplingParams; every bad value is a 400 naming its field (max_tokens by
    the field the request gave it in)."""
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > MAX_STOP_STRINGS:
        raise ApiError(400, f"stop: {len(stop)} stop strings, at most {MAX_STOP_STRINGS} are "
                            "allowed", "stop")
    if any(len(s) > MAX_STOP_CHARS for s in stop):
        raise ApiError(400, f"stop: a stop string of {max(map(len, stop))} characters, at most "
                            f"{MAX_STOP_CHARS} are allowed", "stop")
    stop_ids = req.stop_token_ids or ()
    if len(stop_ids) > MAX_STOP_TOKEN_IDS:
        raise ApiError(400, f"stop_token_ids: {len(stop_ids)} ids, at most {MAX_STOP_TOKEN_IDS} "
                            "are allowed", "stop_token_ids")
    top_k = 0 if req.top_k == -1 else req.top_k
    try:
        return SamplingParams(
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p, top_k=top_k or 0,
            max_tokens=default_max_tokens if max_tokens is None else max_tokens,
            seed=req.seed, stop=stop, ignore_eos=req.ignore_eos, stop_token_ids=stop_ids)
    except ParamError as e:
        param, message = e.param, str(e)
        if param == "top_k":
            message = f"top_k must be -1 or 0 (disabled) or a positive integer, got {req.top_k}"
        elif param == "max_tokens":
            param, message = max_tokens_field, message.replace("max_tokens", max_tokens_field, 1)
        raise ApiError(400, message, param) from None


def max_prompt_chars(llm) -> int:
    """A text longer than this cannot encode into max_model_len tokens: no token of the
    vocabulary spells more than its longest entry's characters."""
    vocab = getattr(llm.tokenizer, "get_vocab", None)
    longest = max((len(t) for t in vocab()), default=1) if vocab is not None else 1
    return llm.max_model_len * max(longest, 1)


def _check_text_length(text_length: int, limit: int, param: str, max_model_len: int) -> None:
    if text_length > limit:
        raise ApiError(400, f"the {param} has {text_length} characters, more than any text of "
                            f"max_model_len ({max_model_len}) tokens can have ({limit}); it was "
                            "not encoded", param, "context_length_exceeded")


def check_text(text: str, param: str, where: str | None = None) -> None:
    """A 400 for a string that is not Unicode text: JSON's escapes can spell a lone UTF-16
    surrogate (\\ud800), which no tokenizer encodes. `where`: the place shown (default param)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        code = ord(text[e.start])
        raise ApiError(400, f"{where or param}: a lone UTF-16 surrogate (U+{code:04X}) at "
                            f"character {e.start}; the text must be valid Unicode",
                       param) from None


def check_length(llm, ids: list[int], param: str) -> None:
    if not ids:
        raise ApiError(400, f"{param} must not be empty", param)
    if len(ids) >= llm.max_model_len:
        what = "prompt" if param == "prompt" else "prompt built from the messages"
        raise ApiError(400, f"the {what} has {len(ids)} tokens; it leaves no room for an output "
                            f"token within this model's max_model_len ({llm.max_model_len} "
                            "tokens)", param, "context_length_exceeded")


def completion_prompt(req: protocol.CompletionRequest) -> str | list[int]:
    """The one prompt of a completion request (text or token ids), checked for shape only."""
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise ApiError(400, f"one prompt per request is supported, got {len(prompt)}",
                           "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        check_text(prompt, "prompt")
    return prompt


def encode_completion(llm, prompt: str | list[int], max_chars: int) -> list[int]:
    """Token ids of a completion prompt (in an executor: encoding takes time)."""
    if isinstance(prompt, str):
        if llm.tokenizer is None:
            raise ApiError(400, "this server has no tokenizer: send prompts as token ids",
                           "prompt")
        _check_text_length(len(prompt), max_chars, "prompt", llm.max_model_len)
        ids = llm.tokenizer.encode(prompt, add_special_tokens=False) if prompt else []
    else:
        check_length(llm, prompt, "prompt")   # before the ids are read
        try:
            ids = llm.processor.encode(prompt)
        except ValueError as e:
            raise ApiError(400, str(e), "prompt") from None
    check_length(llm, ids, "prompt")
    return ids


def chat_messages(req: protocol.ChatCompletionRequest, options: Options) -> list[dict]:
    """The messages as the chat template takes them; a template the request supplies is refused
    unless the server trusts them."""
    supplied = req.chat_template is not None or "chat_template" in (req.chat_template_kwargs or {})
    if supplied and not options.trust_request_chat_template:
        raise ApiError(400, "chat_template: this server renders only the model's own chat "
                            "template; a request may supply one only when the server is started "
                            "with --trust-request-chat-template", "chat_template")
    if not req.messages:
        raise ApiError(400, "messages must not be empty", "messages")
    messages = []
    for i, m in enumerate(req.messages):
        content = m.content
        if isinstance(content, list):
            if any(part.type != "text" for part in content):
                raise ApiError(400, f"messages[{i}]: only text content parts are supported",
                               "messages")
            content = "".join(part.text or "" for part in content)
        check_text(m.role, "messages", f"messages[{i}].role")
        check_text(content or "", "messages", f"messages[{i}].content")
        messages.append({"role": m.role, "content": content or ""})
    return messages


def encode_chat(llm, req: protocol.ChatCompletionRequest, messages: list[dict],
                max_chars: int) -> list[int]:
    """Token ids of the rendered chat (in an executor: rendering and encoding take time)."""
    tokenizer = llm.tokenizer
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ApiError(400, "the model's tokenizer has no chat template: use /v1/completions",
                       "messages")
    _check_text_length(sum(len(m["content"]) + len(m["role"]) for m in messages), max_chars,
                       "messages", llm.max_model_len)
    kwargs = {k: v for k, v in (req.chat_template_kwargs or {}).items()
              if k not in RESERVED_TEMPLATE_KWARGS}
    template = req.chat_template or (req.chat_template_kwargs or {}).get("chat_template")
    if template is not None:   # only reached when the server trusts request templates
        kwargs["chat_template"] = template
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=req.add_generation_prompt,
                                             **kwargs)
    except Exception as e:
        param = "chat_template_kwargs" if kwargs else "messages"
        raise ApiError(400, f"the chat template failed on these messages"
                            f"{' and chat_template_kwargs' if kwargs else ''}: {e}",
                       param) from None
    if not isinstance(text, str):
        raise ApiError(400, "the chat template did not render text", "chat_template_kwargs")
    # the messages are valid text (chat_messages): anything else came from the kwargs
    check_text(text, "chat_template_kwargs", "the chat rendered with chat_template_kwargs")
    _check_text_length(len(text), max_chars, "messages", llm.max_model_len)
    ids = tokenizer.encode(text, add_special_tokens=False) if text else []
    check_length(llm, ids, "messages")
    return ids
