"""A completion request's life on the server: a slot, its prompt encoded off the event loop, the
engine thread, then the JSON response or the server-sent event stream (docs/design.md 4.5)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..engine import LLMEngine
from ..sampling import SamplingParams
from . import protocol
from .errors import ApiError, error_body, error_response
from .metrics import ServerMetrics
from .runner import EngineThread, Handle, ShuttingDown
from .serving import Options

logger = logging.getLogger("dflash.serve")


@dataclass
class ServerState:
    llm: LLMEngine   # read-only here: only the engine thread calls into it
    model_name: str
    options: Options = field(default_factory=Options)
    root: str = ""
    engine: EngineThread | None = None
    metrics: ServerMetrics | None = None
    in_flight: int = 0     # requests holding a slot: admitted, until the engine is done with them
    handles: set[Handle] = field(default_factory=set)   # requests whose responses are not over
    draining: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    # encoding and template rendering, off the event loop
    executor: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(
        2, thread_name_prefix="dflash-encode"))

    def reserve(self) -> None:
        """Take a request slot, or raise 503 (before any work is spent on the request)."""
        if self.draining or not self.engine.alive():
            raise ApiError(503, "the server is shutting down" if self.draining else
                           "the engine thread is not running", headers={"Retry-After": "1"})
        limit = self.llm.max_num_seqs + self.options.max_queue
        if self.in_flight >= limit:
            raise ApiError(503, f"the server is busy: {self.in_flight} requests in flight "
                                f"(max_num_seqs {self.llm.max_num_seqs} + max_queue "
                                f"{self.options.max_queue}); retry later",
                           headers={"Retry-After": "1"})
        self.in_flight += 1

    def release(self) -> None:
        self.in_flight -= 1

    def end_all(self) -> None:
        """End every request the server still holds with a 503 (the shutdown's grace period
        is over): their handlers answer at once, whatever step the engine thread is in."""
        for handle in list(self.handles):
            handle.deliver(ShuttingDown())
            self.engine.abort(handle)


def _spec_info(metrics) -> protocol.SpeculativeInfo:
    return protocol.SpeculativeInfo(
        num_drafts=metrics.num_drafts,
        num_draft_tokens=metrics.num_draft_tokens,
        num_accepted_tokens=metrics.num_accepted_tokens,
        accepted_per_position=list(metrics.accepted_per_position),
        mean_acceptance_length=metrics.mean_acceptance_length)


def _usage(output) -> protocol.UsageInfo:
    p, c = len(output.prompt_token_ids), len(output.token_ids)
    return protocol.UsageInfo(prompt_tokens=p, completion_tokens=c, total_tokens=p + c)


async def generate(state: ServerState, raw: Request, req, params: SamplingParams, chat: bool,
                   encode, fill_max_tokens: bool = False):
    """Run one completion request: a slot, encoding off the event loop, the engine thread, then
    the JSON response or the event stream. `encode()` gives the prompt ids (in the executor)."""
    llm = state.llm
    loop = asyncio.get_running_loop()
    state.reserve()
    try:
        ids = await loop.run_in_executor(state.executor, encode)
        if fill_max_tokens:
            params = replace(params, max_tokens=max(llm.max_model_len - len(ids), 1))
        try:
            llm.processor.admit(ids, params)
        except ValueError as e:
            raise ApiError(400, str(e), "max_tokens") from None
    except BaseException:
        state.release()
        raise
    handle = Handle(loop, ids, params, on_release=state.release)
    state.handles.add(handle)
    state.engine.submit(handle)
    request_id = protocol.random_id("chatcmpl" if chat else "cmpl")
    try:
        first = await _race(raw, _next_event(handle))
        if first is None:   # the client went away
            return Response(status_code=499)
        if isinstance(first, Exception) or first.finish_reason == "error":
            return failure(first)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            response = _Stream(
                _stream(state, handle, first, request_id, chat, include_usage),
                on_close=lambda: _close(state, handle), send_timeout=state.options.stream_timeout,
                media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
            handle.streaming = True   # from here the stream closes the handle
            return response
        last = first if first.finished else await _race(raw, _last_event(handle))
        if last is None:
            return Response(status_code=499)
        if isinstance(last, Exception) or last.finish_reason == "error":
            return failure(last)
        return _response(state, last.output, request_id, chat)
    finally:
        if not handle.streaming:
            _close(state, handle)

def _close(state: ServerState, handle: Handle) -> None:
    if handle.closed:
        return
    handle.closed = True
    state.handles.discard(handle)
    handle.release()
    if not handle.finished:
        state.engine.abort(handle)

def failure(event) -> Response:
    if isinstance(event, ValueError):
        return error_response(400, str(event))
    if isinstance(event, ShuttingDown):
        return error_response(503, str(event))
    message = str(event) if isinstance(event, Exception) else event.output.error
    return error_response(500, f"the engine failed on this request: {message}")

def _response(state: ServerState, output, request_id: str, chat: bool):
    spec = _spec_info(output.metrics) if state.llm.draft is not None else None
    if chat:
        choice = protocol.ChatChoice(
            message=protocol.ChatMessageOut(content=output.text or ""),
            finish_reason=output.finish_reason, stop_reason=output.stop_reason)
        body = protocol.ChatCompletionResponse(
            id=request_id, model=state.model_name, choices=[choice], usage=_usage(output),
            speculative_decoding=spec)
    else:
        choice = protocol.CompletionChoice(
            text=output.text or "", finish_reason=output.finish_reason,
            stop_reason=output.stop_reason)
        body = protocol.CompletionResponse(
            id=request_id, model=state.model_name, choices=[choice], usage=_usage(output),
            speculative_decoding=spec)
    return JSONResponse(body.model_dump())

async def _stream(state: ServerState, handle: Handle, event, request_id: str, chat: bool,
                  include_usage: bool):
    created = int(time.time())
    usage_null = {"usage": None} if include_usage else {}

    def chunk(text: str | None, finish=None, stop_reason=None, role=False) -> str:
        if chat:
            delta = protocol.DeltaMessage(role="assistant" if role else None, content=text)
            body = protocol.ChatCompletionChunk(
                id=request_id, created=created, model=state.model_name,
                choices=[protocol.ChatChunkChoice(delta=delta, finish_reason=finish,
                                                  stop_reason=stop_reason)])
            data = body.model_dump(exclude_none=True)
            data["choices"][0].setdefault("finish_reason", None)
        else:
            body = protocol.CompletionChunk(
                id=request_id, created=created, model=state.model_name,
                choices=[protocol.CompletionChoice(text=text or "", finish_reason=finish,
                                                   stop_reason=stop_reason)])
            data = body.model_dump(exclude_none=True)
            data["choices"][0].setdefault("finish_reason", None)
            data["choices"][0].setdefault("logprobs", None)
        data.update(usage_null)
        return f"data: {json.dumps(data)}\n\n"

    try:
        if chat:
            yield chunk("", role=True)
        while True:
            if isinstance(event, Exception) or event.finish_reason == "error":
                message = str(event) if isinstance(event, Exception) else event.output.error
                status = 503 if isinstance(event, ShuttingDown) else 500
                yield f"data: {json.dumps(error_body(status, message))}\n\n"
                break
            if event.text:
                yield chunk(event.text)
            if event.finished:
                output = event.output
                if chat:
                    yield chunk(None, output.finish_reason, output.stop_reason)
                else:
                    yield chunk("", output.finish_reason, output.stop_reason)
                if include_usage:
                    spec = _spec_info(output.metrics) if state.llm.draft is not None else None
                    usage = protocol.CompletionChunk(
                        id=request_id, created=created, model=state.model_name, choices=[],
                        usage=_usage(output), speculative_decoding=spec)
                    data = usage.model_dump(exclude_none=True)
                    if chat:
                        data["object"] = "chat.completion.chunk"
                    yield f"data: {json.dumps(data)}\n\n"
                break
            event = await _next_event(handle)
        yield "data: [DONE]\n\n"
    finally:
        _close(state, handle)


class _Stalled(Exception):
    """The client did not take a chunk within the send timeout."""


class _Stream(StreamingResponse):
    """A server-sent event stream that releases its request however the response ends (even
    when the client leaves before the body starts), and ends it when the client stops reading:
    a send that waits longer than `send_timeout` (the socket's buffers are full) closes it."""

    def __init__(self, content, on_close, send_timeout: float, **kw):
        super().__init__(content, **kw)
        self._on_close, self._send_timeout = on_close, send_timeout

    async def __call__(self, scope, receive, send):
        async def send_or_give_up(message):
            try:
                await asyncio.wait_for(send(message), self._send_timeout)
            except asyncio.TimeoutError:
                raise _Stalled from None

        try:
            await super().__call__(scope, receive, send_or_give_up)
        except _Stalled:
            logger.warning("a streaming client read nothing for %.1f s: its request is aborted "
                           "and the connection closed", self._send_timeout)
        finally:
            self._on_close()


async def _next_event(handle: Handle):
    event = await handle.events.get()
    if isinstance(event, Exception) or event.finished:
        handle.finished = True
    return event


async def _last_event(handle: Handle):
    while True:
        event = await _next_event(handle)
        if handle.finished:
            return event


async def _race(raw: Request, coroutine):
    """The coroutine's result, or None if the client disconnects first."""
    task = asyncio.ensure_future(coroutine)
    gone = asyncio.ensure_future(_disconnected(raw))
    try:
        done, _ = await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, gone):
            if not t.done():
                t.cancel()
    return task.result() if task in done else None


async def _disconnected(raw: Request) -> None:
    while True:
        message = await raw.receive()
        if message["type"] == "http.disconnect":
            return
