"""`dflash serve`: an OpenAI-compatible HTTP server over the online engine (docs/design.md 4.5).

FastAPI routes on uvicorn's event loop; the engine steps in one background thread
(`runner.EngineThread`). Endpoints: POST /v1/completions, POST /v1/chat/completions (both with
`stream`), GET /v1/models, /health, /version, /metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import __version__
from ..engine import LLMEngine
from ..sampling import SamplingParams
from . import protocol, serving
from .errors import ApiError, error_body, error_response
from .metrics import CONTENT_TYPE, ServerMetrics
from .runner import EngineThread, Handle
from .security import ApiKeyMiddleware, BodyLimitMiddleware, HostMiddleware
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


def _check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model != state.model_name:
        raise ApiError(404, f"the model '{model}' does not exist: this server serves "
                            f"'{state.model_name}'", "model", "model_not_found")


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


# -------------------------------------------------------------------------------- the app

def build_app(state: ServerState) -> FastAPI:
    llm, options = state.llm, state.options
    if state.metrics is None:
        state.metrics = ServerMetrics(state.model_name, max(llm.block_size - 1, 0),
                                      llm.allocator.num_blocks)
    if state.engine is None:
        state.engine = EngineThread(llm, state.metrics)
    max_chars = serving.max_prompt_chars(llm)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if not state.engine.started():
            state.engine.start()
        yield
        state.draining = True
        await asyncio.get_running_loop().run_in_executor(None, state.engine.stop)
        state.executor.shutdown(wait=False, cancel_futures=True)

    # no /docs, /redoc or /openapi.json: they would be open to anyone who can connect
    app = FastAPI(title="dflash", version=__version__, lifespan=lifespan, docs_url=None,
                  redoc_url=None, openapi_url=None)
    # outermost last: the key or the Host header is checked before the body is read
    app.add_middleware(BodyLimitMiddleware, limit=options.max_request_bytes)
    if options.api_key:
        app.add_middleware(ApiKeyMiddleware, key=options.api_key)
    else:
        app.add_middleware(HostMiddleware, allowed=frozenset(options.allowed_hosts))

    @app.exception_handler(ApiError)
    async def _api_error(request, e: ApiError):
        return error_response(e.status, e.message, e.param, e.code, e.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, e: RequestValidationError):
        errors = e.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":
            detail = first.get("ctx", {}).get("error", first.get("msg", ""))
            return error_response(400, f"the request body is not valid JSON: {detail}")
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        if not loc:
            return error_response(400, f"the request body must be a JSON object: "
                                       f"{first.get('msg', 'invalid')}")
        # a union type reports its alternatives in the location; the field is the first part
        param = loc[0]
        if first.get("type") == "missing":
            return error_response(400, f"{param}: this field is required", param)
        return error_response(400, f"{param}: {first.get('msg')} (got "
                                   f"{json.dumps(first.get('input'), default=str)[:80]})", param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, e: StarletteHTTPException):
        return error_response(e.status_code, f"{request.method} {request.url.path}: {e.detail}")

    @app.exception_handler(Exception)
    async def _internal_error(request, e: Exception):
        return error_response(500, f"internal server error: {type(e).__name__}: {e}")

    # ------------------------------------------------------------------ plain endpoints
    @app.get("/health")
    async def health():
        if state.draining or not state.engine.alive():
            return error_response(503, "the server is shutting down" if state.draining
                                  else "the engine thread is not running")
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models():
        card = protocol.ModelCard(id=state.model_name, created=state.created, root=state.root,
                           max_model_len=llm.max_model_len)
        return protocol.ModelList(data=[card]).model_dump()

    # ---------------------------------------------------------------- generation
    @app.post("/v1/completions")
    async def completions(req: protocol.CompletionRequest, raw: Request):
        _check_model(state, req.model)
        serving.check_honoured(req)
        params = serving.sampling_params(req, req.max_tokens, 16)
        prompt = serving.completion_prompt(req)
        return await _generate(raw, req, params, chat=False,
                               encode=lambda: serving.encode_completion(llm, prompt, max_chars))

    @app.post("/v1/chat/completions")
    async def chat_completions(req: protocol.ChatCompletionRequest, raw: Request):
        _check_model(state, req.model)
        serving.check_honoured(req)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None \
            else req.max_tokens
        # without max_tokens: the rest of max_model_len, once the prompt's length is known
        params = serving.sampling_params(req, max_tokens, llm.max_model_len)
        messages = serving.chat_messages(req, options)
        return await _generate(raw, req, params, chat=True,
                               encode=lambda: serving.encode_chat(llm, req, messages, max_chars),
                               fill_max_tokens=max_tokens is None)

    async def _generate(raw: Request, req, params: SamplingParams, chat: bool, encode,
                        fill_max_tokens: bool = False):
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
        state.engine.submit(handle)
        request_id = protocol.random_id("chatcmpl" if chat else "cmpl")
        try:
            first = await _race(raw, _next_event(handle))
            if first is None:   # the client went away
                return Response(status_code=499)
            if isinstance(first, Exception) or first.finish_reason == "error":
                return _failure(first)
            if req.stream:
                include_usage = bool(req.stream_options and req.stream_options.include_usage)
                response = _Stream(
                    _stream(handle, first, request_id, chat, include_usage),
                    on_close=lambda: _close(handle), send_timeout=options.stream_timeout,
                    media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
                handle.streaming = True   # from here the stream closes the handle
                return response
            last = first if first.finished else await _race(raw, _last_event(handle))
            if last is None:
                return Response(status_code=499)
            if isinstance(last, Exception) or last.finish_reason == "error":
                return _failure(last)
            return _response(last.output, request_id, chat)
        finally:
            if not handle.streaming:
                _close(handle)

    def _close(handle: Handle) -> None:
        if handle.closed:
            return
        handle.closed = True
        handle.release()
        if not handle.finished:
            state.engine.abort(handle)

    def _failure(event) -> JSONResponse:
        if isinstance(event, ValueError):
            return error_response(400, str(event))
        message = str(event) if isinstance(event, Exception) else event.output.error
        status = 503 if "shutting down" in message else 500
        return error_response(status, f"the engine failed on this request: {message}"
                              if status == 500 else message)

    def _response(output, request_id: str, chat: bool):
        spec = _spec_info(output.metrics) if llm.draft is not None else None
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

    async def _stream(handle: Handle, event, request_id: str, chat: bool, include_usage: bool):
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
                    yield f"data: {json.dumps(error_body(500, message))}\n\n"
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
                        spec = _spec_info(output.metrics) if llm.draft is not None else None
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
            _close(handle)

    return app


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


# ----------------------------------------------------------------------------- running it

class _Uvicorn(uvicorn.Server):
    """uvicorn with a graceful stop on SIGTERM / SIGINT that exits 0 (uvicorn re-raises the
    signal after its shutdown by default, which would end the process with 128 + signal)."""

    def __init__(self, config, on_exit):
        super().__init__(config)
        self._on_exit = on_exit

    def handle_exit(self, sig, frame):
        self._on_exit()
        super().handle_exit(sig, frame)
        self._captured_signals.clear()


class Server:
    """The app, its engine thread and uvicorn, on a socket bound at construction (port 0 picks
    a free one: see `port`)."""

    def __init__(self, llm: LLMEngine, model_name: str, host: str = "127.0.0.1",
                 port: int = 8000, grace_period: float = 10.0, root: str = "",
                 log_level: str = "warning", **options):
        """`llm`: an engine built with isolate_errors=True (one failing request must not end
        the others). `options`: the fields of `serving.Options` (api_key, max_queue, ...)."""
        if not llm.isolate_errors:
            raise ValueError("Server needs an LLMEngine built with isolate_errors=True")
        self.state = ServerState(llm, model_name, Options(**options), root=root)
        # a dead engine thread ends the process (non-zero) so that a supervisor restarts it
        self.state.engine = EngineThread(llm, ServerMetrics(
            model_name, max(llm.block_size - 1, 0), llm.allocator.num_blocks),
            on_failure=self._engine_failed)
        self.state.metrics = self.state.engine.metrics
        self.app = build_app(self.state)
        self.socket = socket.create_server((host, port))
        self.host, self.port = host, self.socket.getsockname()[1]
        config = uvicorn.Config(self.app, log_level=log_level,
                                timeout_graceful_shutdown=grace_period, lifespan="on")
        self.uvicorn = _Uvicorn(config, self._draining)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _draining(self) -> None:
        self.state.draining = True

    def _engine_failed(self) -> None:
        self.uvicorn.should_exit = True

    @property
    def failed(self) -> bool:
        """True when the engine thread died (the server then stops)."""
        return self.state.engine.error is not None

    def run(self) -> int:
        """Serve until SIGTERM / SIGINT (from the main thread) or until the engine thread dies;
        returns the process's exit status (1 in the second case)."""
        print(f"dflash serve: {self.state.model_name} on {self.url} (OpenAI API at "
              f"{self.url}/v1)", file=sys.stderr, flush=True)
        self.uvicorn.run(sockets=[self.socket])
        if self.failed:
            print(f"dflash serve: the engine thread failed ({self.state.engine.error!r}); "
                  "exiting with status 1", file=sys.stderr, flush=True)
            return 1
        return 0

    # tests: the server in a background thread of this process
    def start(self, timeout: float = 30.0) -> Server:
        self._thread = threading.Thread(target=lambda: asyncio.run(
            self.uvicorn.serve(sockets=[self.socket])), name="dflash-uvicorn", daemon=True)
        self._thread.start()
        deadline = time.time() + timeout
        while not self.uvicorn.started:
            if time.time() > deadline or not self._thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self._draining()
        self.uvicorn.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
        self.socket.close()

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
