"""OpenAI's request and response schemas, as far as `dflash serve` implements them.

Unknown request fields are accepted and ignored (clients and benchmark tools send extras); known
fields of the wrong type are a 400 naming the field. Fields dflash cannot honour (logprobs, echo,
penalties, n > 1, tools, response_format, ...: `serving.NOT_HONOURED`) are a 400 naming the
field, never silently ignored, whether declared here or not.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

# messages in one chat request, and content parts in all of them together
MAX_MESSAGES = 4096


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


# ------------------------------------------------------------------------------ requests

class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


class SamplingFields(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None           # vLLM's extension; -1 or 0 disable it
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int = 1
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    best_of: int | None = None
    user: str | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    suffix: str | None = None
    logprobs: int | None = None


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[ContentPart] | None = None


def _counted(messages):
    """The messages' counts, checked before any of them is validated: validation runs on the
    event loop, and a body of a few MB can hold hundreds of thousands of items."""
    if isinstance(messages, list):
        parts = sum(len(m["content"]) for m in messages
                    if isinstance(m, dict) and isinstance(m.get("content"), list))
        if len(messages) > MAX_MESSAGES or parts > MAX_MESSAGES:
            raise ValueError(f"{len(messages)} messages with {parts} content parts; at most "
                             f"{MAX_MESSAGES} messages and {MAX_MESSAGES} content parts in all "
                             "are allowed")
    return messages


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], BeforeValidator(_counted)]
    max_completion_tokens: int | None = None
    chat_template: str | None = None   # refused unless --trust-request-chat-template
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    logprobs: bool = False
    top_logprobs: int | None = None


# ----------------------------------------------------------------------------- responses

class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class SpeculativeInfo(BaseModel):
    """The request's DFlash figures (names as in vLLM's spec-decode metrics)."""
    num_drafts: int               # verification steps that carried drafts
    num_draft_tokens: int         # drafted tokens verified
    num_accepted_tokens: int      # drafted tokens accepted
    accepted_per_position: list[int]
    mean_acceptance_length: float  # tau: tokens committed per verification step


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    speculative_decoding: SpeculativeInfo | None = None


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    logprobs: None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    speculative_decoding: SpeculativeInfo | None = None


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None
    speculative_decoding: SpeculativeInfo | None = None


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    speculative_decoding: SpeculativeInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "dflash"
    root: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
