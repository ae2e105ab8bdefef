"""What reaches the app: the API key, the Host header and the request body's size, checked as
ASGI middleware before FastAPI parses anything (docs/design.md 4.5).

- With an API key, /v1/* needs `Authorization: Bearer KEY` (compared in constant time); /health,
  /version and /metrics stay open, as in vLLM.
- Without one, only requests whose Host header names this machine by an IP address, `localhost`
  or an allowed name are served: a web page that rebinds its own domain to 127.0.0.1 sends its
  domain in Host, so a browser cannot reach a keyless server on the loopback.
- A body over the limit is refused with 413 before it is read whole: as declared by
  Content-Length, or as counted while a chunked body arrives; one still arriving after the
  body timeout gets 408.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress

from fastapi.responses import Response

from .errors import error_response


def _header(scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return value
    return None


class ApiKeyMiddleware:
    def __init__(self, app, key: str):
        self.app = app
        self.expected = f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith("/v1") or \
                scope["method"] == "OPTIONS":
            return await self.app(scope, receive, send)
        given = _header(scope, b"authorization") or b""
        if not hmac.compare_digest(given, self.expected):
            return await error_response(
                401, "invalid API key: send 'Authorization: Bearer <key>' with the key the "
                     "server was started with", code="invalid_api_key")(scope, receive, send)
        return await self.app(scope, receive, send)


def host_allowed(host_header: str, allowed: frozenset[str]) -> bool:
    """True for an IP address (any port), `localhost` or a name in `allowed` ('*': any)."""
    if "*" in allowed:
        return True
    host = host_header.strip().lower()
    if host.startswith("["):            # [v6]:port
        host = host[1:host.find("]")] if "]" in host else host[1:]
    elif host.count(":") == 1:
        host = host.split(":")[0]
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return host == "localhost" or host in allowed


class HostMiddleware:
    """Refuses a Host header that is not an IP address, localhost or an allowed name (used when
    the server has no API key)."""

    def __init__(self, app, allowed: frozenset[str]):
        self.app, self.allowed = app, frozenset(h.lower() for h in allowed)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        host = (_header(scope, b"host") or b"").decode("latin-1")
        if not host_allowed(host, self.allowed):
            return await error_response(
                403, f"the Host header {host[:100]!r} is not allowed: this server has no API key, "
                     "so it answers only requests addressed to an IP address, localhost or a name "
                     "given with --allowed-hosts (or start it with an API key)",
                code="host_not_allowed")(scope, receive, send)
        return await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """Reads a request body of at most `limit` bytes within `timeout` seconds, then hands it to
    the app in one message; a larger body gets 413 naming the limit, and one still arriving
    after the timeout 408 (a client that sends part of a body and stalls would otherwise hold
    its connection for good)."""

    def __init__(self, app, limit: int, timeout: float):
        self.app, self.limit, self.timeout = app, limit, timeout

    def _too_large(self, size: str) -> Response:
        return error_response(413, f"the request body is {size}, over this server's limit of "
                                   f"{self.limit} bytes (--max-request-bytes)",
                              code="request_too_large")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await self._too_large(f"{int(declared)} bytes")(scope, receive, send)
        chunks, size = [], 0
        deadline = asyncio.get_running_loop().time() + self.timeout
        while True:
            try:
                message = await asyncio.wait_for(
                    receive(), max(deadline - asyncio.get_running_loop().time(), 0.0))
            except asyncio.TimeoutError:
                return await error_response(
                    408, f"the request body did not arrive within {self.timeout:g} s "
                         "(--body-timeout)", code="request_timeout",
                    headers={"Connection": "close"})(scope, receive, send)
            if message["type"] != "http.request":   # the client left
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                return await self._too_large("larger")(scope, receive, send)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:   # later reads (disconnect detection) go to the client
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        return await self.app(scope, replay, send)
