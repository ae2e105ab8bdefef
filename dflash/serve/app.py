"""`dflash serve`: an OpenAI-compatible HTTP server over the online engine (docs/design.md 4.5).

FastAPI routes on uvicorn's event loop; the engine steps in one background thread
(`runner.EngineThread`). Endpoints: POST /v1/completions, POST /v1/chat/completions (both with
`stream`), GET /v1/models, /health, /version, /metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import sys
import threading
import time
from dataclasses import dataclass, field

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import __version__
from ..sampling import SamplingParams
from . import protocol as P
from .metrics import CONTENT_TYPE, ServerMetrics
from .runner import EngineThread, Handle

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               404: "not_found_error", 405: "invalid_request_error", 500: "server_error",
               503: "server_busy"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.code, self.headers = code, headers


def error_body(status: int, message: str, param: str | None = None,
               code: str | int | None = None) -> dict:
    return P.ErrorResponse(error=P.ErrorInfo(
        message=message, type=ERROR_TYPES.get(status, "invalid_request_error"), param=param,
        code=code if code is not None else status)).model_dump()


def error_response(status: int, message: str, param: str | None = None,
                   code: str | int | None = None, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status,
                        headers=headers)


@dataclass
class ServerState:
    llm: object
    model_name: str
    api_key: str | None = None
    max_queue: int = 256
    root: str = ""
    engine: EngineThread | None = None
    metrics: ServerMetrics | None = None
    in_flight: int = 0
    draining: bool = False
    created: int = field(default_factory=lambda: int(time.time()))


class ApiKeyMiddleware:
    """`Authorization: Bearer KEY` on /v1/* when the server has an API key (as vLLM: /health,
    /version and /metrics stay open)."""

    def __init__(self, app, key: str):
        self.app, self.key = app, key

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith("/v1") or \
                scope["method"] == "OPTIONS":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        given = headers.get(b"authorization", b"").decode("latin-1")
        if given != f"Bearer {self.key}":
            response = error_response(401, "invalid API key: send 'Authorization: Bearer <key>' "
                                           "with the key the server was started with",
                                      code="invalid_api_key")
            return await response(scope, receive, send)
        return await self.app(scope, receive, send)


# ---------------------------------------------------------------------- request -> engine

def _params(req: P._SamplingFields, max_tokens: int | None, default_max_tokens: int
            ) -> SamplingParams:
    if req.n != 1:
        raise ApiError(400, f"n={req.n} is not supported: dflash returns one choice per request "
                            "(use n=1)", "n")
    if req.best_of not in (None, 1):
        raise ApiError(400, "best_of is not supported (use best_of=1)", "best_of")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name) not in (None, 0):
            raise ApiError(400, f"{name} is not supported (only 0)", name)
    if req.repetition_penalty not in (None, 1):
        raise ApiError(400, "repetition_penalty is not supported (only 1)", "repetition_penalty")
    if max_tokens is not None and max_tokens < 1:
        raise ApiError(400, f"max_tokens must be at least 1, got {max_tokens}", "max_tokens")
    temperature = 1.0 if req.temperature is None else req.temperature
    if temperature < 0:
        raise ApiError(400, f"temperature must be >= 0 (0 = greedy), got {temperature}",
                       "temperature")
    top_p = 1.0 if req.top_p is None else req.top_p
    if not 0 < top_p <= 1:
        raise ApiError(400, f"top_p must be in (0, 1], got {top_p}", "top_p")
    top_k = 0 if req.top_k in (None, -1) else req.top_k
    if top_k < 0:
        raise ApiError(400, f"top_k must be -1 or 0 (disabled) or a positive integer, got "
                            f"{req.top_k}", "top_k")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if any(s == "" for s in stop):
        raise ApiError(400, "stop strings must not be empty", "stop")
    try:
        return SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k,
                              max_tokens=default_max_tokens if max_tokens is None else max_tokens,
                              seed=req.seed, stop=stop, ignore_eos=req.ignore_eos,
                              stop_token_ids=req.stop_token_ids or ())
    except ValueError as e:
        raise ApiError(400, str(e), str(e).split()[0]) from None


def _check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model != state.model_name:
        raise ApiError(404, f"the model '{model}' does not exist: this server serves "
                            f"'{state.model_name}'", "model", "model_not_found")


def _check_length(state: ServerState, ids: list[int], param: str) -> None:
    llm = state.llm
    if not ids:
        raise ApiError(400, f"{param} must not be empty", param)
    if len(ids) + llm.block_size > llm.max_model_len:
        what = "prompt" if param == "prompt" else "prompt built from the messages"
        raise ApiError(400, f"the {what} has {len(ids)} tokens; with one block of "
                            f"{llm.block_size} it exceeds this model's max_model_len "
                            f"({llm.max_model_len} tokens)", param, "context_length_exceeded")


def _completion_prompt(state: ServerState, req: P.CompletionRequest) -> list[int]:
    if req.echo:
        raise ApiError(400, "echo is not supported", "echo")
    if req.suffix:
        raise ApiError(400, "suffix is not supported", "suffix")
    if req.logprobs is not None:
        raise ApiError(400, "logprobs are not supported", "logprobs")
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise ApiError(400, f"one prompt per request is supported, got {len(prompt)}",
                           "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        if state.llm.tokenizer is None:
            raise ApiError(400, "this server has no tokenizer: send prompts as token ids",
                           "prompt")
        ids = state.llm.tokenizer.encode(prompt, add_special_tokens=False) if prompt else []
    else:
        ids = list(prompt)
        vocab = state.llm.target.cfg.vocab_size
        if not all(0 <= t < vocab for t in ids):
            raise ApiError(400, f"prompt token ids must be in [0, {vocab})", "prompt")
    _check_length(state, ids, "prompt")
    return ids


def _chat_prompt(state: ServerState, req: P.ChatCompletionRequest) -> list[int]:
    if req.logprobs or req.top_logprobs:
        raise ApiError(400, "logprobs are not supported", "logprobs")
    if not req.messages:
        raise ApiError(400, "messages must not be empty", "messages")
    tokenizer = state.llm.tokenizer
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ApiError(400, "the model's tokenizer has no chat template: use /v1/completions",
                       "messages")
    messages = []
    for i, m in enumerate(req.messages):
        content = m.content
        if isinstance(content, list):
            if any(part.type != "text" for part in content):
                raise ApiError(400, f"messages[{i}]: only text content parts are supported",
                               "messages")
            content = "".join(part.text or "" for part in content)
        messages.append({"role": m.role, "content": content or ""})
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=req.add_generation_prompt,
                                             **(req.chat_template_kwargs or {}))
    except Exception as e:
        raise ApiError(400, f"the chat template failed on these messages: {e}",
                       "messages") from None
    ids = tokenizer.encode(text, add_special_tokens=False) if text else []
    _check_length(state, ids, "messages")
    return ids


def _spec_info(metrics) -> P.SpeculativeInfo:
    return P.SpeculativeInfo(num_drafts=metrics.num_drafts,
                             num_draft_tokens=metrics.num_draft_tokens,
                             num_accepted_tokens=metrics.num_accepted_tokens,
                             accepted_per_position=list(metrics.accepted_per_position),
                             mean_acceptance_length=metrics.mean_acceptance_length)


def _usage(output) -> P.UsageInfo:
    p, c = len(output.prompt_token_ids), len(output.token_ids)
    return P.UsageInfo(prompt_tokens=p, completion_tokens=c, total_tokens=p + c)


# -------------------------------------------------------------------------------- the app

def build_app(state: ServerState) -> FastAPI:
    llm = state.llm
    if state.metrics is None:
        state.metrics = ServerMetrics(state.model_name, max(llm.block_size - 1, 0),
                                      llm.allocator.num_blocks)
    if state.engine is None:
        state.engine = EngineThread(llm, state.metrics)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if not state.engine._thread.is_alive():
            state.engine.start()
        yield
        state.draining = True
        await asyncio.get_running_loop().run_in_executor(None, state.engine.stop)

    app = FastAPI(title="dflash", version=__version__, lifespan=lifespan)
    if state.api_key:
        app.add_middleware(ApiKeyMiddleware, key=state.api_key)

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
        state.engine._publish_load()
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models():
        card = P.ModelCard(id=state.model_name, created=state.created, root=state.root,
                           max_model_len=llm.max_model_len)
        return P.ModelList(data=[card]).model_dump()

    # ---------------------------------------------------------------- generation
    @app.post("/v1/completions")
    async def completions(req: P.CompletionRequest, raw: Request):
        _check_model(state, req.model)
        ids = _completion_prompt(state, req)
        params = _params(req, req.max_tokens, 16)
        return await _generate(raw, req, ids, params, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: P.ChatCompletionRequest, raw: Request):
        _check_model(state, req.model)
        ids = _chat_prompt(state, req)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None \
            else req.max_tokens
        params = _params(req, max_tokens, llm.max_model_len - len(ids))
        return await _generate(raw, req, ids, params, chat=True)

    async def _generate(raw: Request, req, ids: list[int], params: SamplingParams, chat: bool):
        try:
            llm.validate(ids, params)
        except ValueError as e:
            raise ApiError(400, str(e), "max_tokens") from None
        if state.draining or not state.engine.alive():
            raise ApiError(503, "the server is shutting down", headers={"Retry-After": "1"})
        if state.in_flight >= llm.max_num_seqs + state.max_queue:
            raise ApiError(503, f"the server is busy: {state.in_flight} requests in flight "
                                f"(max_num_seqs {llm.max_num_seqs} + max_queue "
                                f"{state.max_queue}); retry later",
                           headers={"Retry-After": "1"})
        handle = Handle(asyncio.get_running_loop(), ids, params)
        state.in_flight += 1
        state.engine.submit(handle)
        request_id = P.random_id("chatcmpl" if chat else "cmpl")
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
                    on_close=lambda: _close(handle), media_type="text/event-stream",
                    headers={"Cache-Control": "no-cache"})
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
        state.in_flight -= 1
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
            choice = P.ChatChoice(message=P.ChatMessageOut(content=output.text or ""),
                                  finish_reason=output.finish_reason,
                                  stop_reason=output.stop_reason)
            body = P.ChatCompletionResponse(id=request_id, model=state.model_name,
                                            choices=[choice], usage=_usage(output),
                                            speculative_decoding=spec)
        else:
            choice = P.CompletionChoice(text=output.text or "", finish_reason=output.finish_reason,
                                        stop_reason=output.stop_reason)
            body = P.CompletionResponse(id=request_id, model=state.model_name, choices=[choice],
                                        usage=_usage(output), speculative_decoding=spec)
        return JSONResponse(body.model_dump())

    async def _stream(handle: Handle, event, request_id: str, chat: bool, include_usage: bool):
        created = int(time.time())
        usage_null = {"usage": None} if include_usage else {}

        def chunk(text: str | None, finish=None, stop_reason=None, role=False) -> str:
            if chat:
                delta = P.DeltaMessage(role="assistant" if role else None, content=text)
                body = P.ChatCompletionChunk(id=request_id, created=created,
                                             model=state.model_name, choices=[P.ChatChunkChoice(
                                                 delta=delta, finish_reason=finish,
                                                 stop_reason=stop_reason)])
                data = body.model_dump(exclude_none=True)
                data["choices"][0].setdefault("finish_reason", None)
            else:
                body = P.CompletionChunk(id=request_id, created=created, model=state.model_name,
                                         choices=[P.CompletionChoice(text=text or "",
                                                                     finish_reason=finish,
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
                        usage = P.CompletionChunk(id=request_id, created=created,
                                                  model=state.model_name, choices=[],
                                                  usage=_usage(output),
                                                  speculative_decoding=spec)
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


class _Stream(StreamingResponse):
    """A server-sent event stream that releases its request however the response ends (even
    when the client leaves before the body starts)."""

    def __init__(self, content, on_close, **kw):
        super().__init__(content, **kw)
        self._on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
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

    def __init__(self, llm, model_name: str, host: str = "127.0.0.1", port: int = 8000,
                 api_key: str | None = None, max_queue: int = 256, grace_period: float = 10.0,
                 root: str = "", log_level: str = "warning"):
        self.state = ServerState(llm, model_name, api_key=api_key, max_queue=max_queue,
                                 root=root)
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

    def run(self) -> None:
        """Serve until SIGTERM / SIGINT (from the main thread)."""
        print(f"dflash serve: {self.state.model_name} on {self.url} (OpenAI API at "
              f"{self.url}/v1)", file=sys.stderr, flush=True)
        self.uvicorn.run(sockets=[self.socket])

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
