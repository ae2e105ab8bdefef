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

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import __version__
from ..engine import LLMEngine
from . import protocol, serving
from .errors import ApiError, error_response
from .generation import ServerState, generate
from .metrics import CONTENT_TYPE, ServerMetrics
from .runner import EngineThread
from .security import ApiKeyMiddleware, BodyLimitMiddleware, HostMiddleware
from .serving import Options

# seconds after the grace period for the answers to the requests still held to be sent (then
# uvicorn cancels what is left), and for the engine thread's running step to end
FLUSH = 2.0


def _check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model != state.model_name:
        raise ApiError(404, f"the model '{model}' does not exist: this server serves "
                            f"'{state.model_name}'", "model", "model_not_found")


# a union type's alternatives, as pydantic names them in an error's location
_UNION_TAGS = frozenset({"str", "int", "float", "bool"})


def _place(loc: list) -> str:
    """An error's location as a client reads it (messages[0].role), up to a union type's
    alternatives (pydantic reports each one's error, e.g. at content.str and content.list[...])."""
    place = str(loc[0])
    for x in loc[1:]:
        if isinstance(x, int):
            place += f"[{x}]"
        elif x.isidentifier() and x not in _UNION_TAGS:
            place += f".{x}"
        else:
            break
    return place


def _shown(value) -> str:
    """A short rendering of an offending value (a long list or object by its size: rendering
    it whole would take time on the event loop)."""
    if isinstance(value, (list, dict)) and len(value) > 8:
        return f"{'a list' if isinstance(value, list) else 'an object'} of {len(value)} items"
    return json.dumps(value, default=str)[:80]


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
        # a step that runs on past this (a long prefill) is not waited for: the thread is a
        # daemon, and every request has had its answer
        await asyncio.get_running_loop().run_in_executor(None, state.engine.stop, FLUSH)
        state.executor.shutdown(wait=False, cancel_futures=True)

    # no /docs, /redoc or /openapi.json: they would be open to anyone who can connect
    app = FastAPI(title="dflash", version=__version__, lifespan=lifespan, docs_url=None,
                  redoc_url=None, openapi_url=None)
    # outermost last: the key or the Host header is checked before the body is read
    app.add_middleware(BodyLimitMiddleware, limit=options.max_request_bytes,
                       timeout=options.body_timeout)
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
        loc = [x for x in first.get("loc", ()) if x != "body"]
        if not loc:
            return error_response(400, f"the request body must be a JSON object: "
                                       f"{first.get('msg', 'invalid')}")
        # the top-level field is the param; the message names the place inside it
        param, where = str(loc[0]), _place(loc)
        if first.get("type") == "missing":
            return error_response(400, f"{where}: this field is required", param)
        message = str(first["ctx"]["error"]) if first.get("type") == "value_error" \
            else first.get("msg")
        return error_response(400, f"{where}: {message} (got {_shown(first.get('input'))})",
                              param)

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
        return await generate(state, raw, req, params, chat=False,
                               encode=lambda: serving.encode_completion(llm, prompt, max_chars))

    @app.post("/v1/chat/completions")
    async def chat_completions(req: protocol.ChatCompletionRequest, raw: Request):
        _check_model(state, req.model)
        serving.check_honoured(req)
        field = "max_tokens" if req.max_completion_tokens is None else "max_completion_tokens"
        max_tokens = getattr(req, field)
        # without max_tokens: the rest of max_model_len, once the prompt's length is known
        params = serving.sampling_params(req, max_tokens, llm.max_model_len, field)
        messages = serving.chat_messages(req, options)
        return await generate(state, raw, req, params, chat=True,
                               encode=lambda: serving.encode_chat(llm, req, messages, max_chars),
                               fill_max_tokens=max_tokens is None)

    return app


# ----------------------------------------------------------------------------- running it

class _Uvicorn(uvicorn.Server):
    """uvicorn with a graceful stop on SIGTERM / SIGINT that exits 0 (uvicorn re-raises the
    signal after its shutdown by default, which would end the process with 128 + signal).
    When the grace period ends, `on_deadline()` answers the requests still held; uvicorn's own
    deadline (its config's, FLUSH seconds later) would cancel their handlers mid-response."""

    def __init__(self, config, grace_period: float, on_exit, on_deadline):
        super().__init__(config)
        self._grace_period = grace_period
        self._on_exit, self._on_deadline = on_exit, on_deadline

    def handle_exit(self, sig, frame):
        self._on_exit()
        super().handle_exit(sig, frame)
        self._captured_signals.clear()

    async def shutdown(self, sockets=None):
        timer = asyncio.get_running_loop().call_later(self._grace_period, self._on_deadline)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()


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
                                timeout_graceful_shutdown=grace_period + FLUSH, lifespan="on")
        self.uvicorn = _Uvicorn(config, grace_period, self._draining, self.state.end_all)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _draining(self) -> None:
        self.state.draining = True

    def _engine_failed(self) -> None:
        self.uvicorn.should_exit = True

    @property
    def stepping(self) -> bool:
        """True while the engine thread is still in a step (a long prefill) after the server
        stopped; every request has had its answer by then."""
        return self.state.engine.running()

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
