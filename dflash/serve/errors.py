"""The server's errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations

import json

from fastapi.responses import Response

from . import protocol

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 405: "invalid_request_error",
               408: "invalid_request_error", 413: "invalid_request_error",
               500: "server_error", 503: "server_busy"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.code, self.headers = code, headers


def error_body(status: int, message: str, param: str | None = None,
               code: str | int | None = None) -> dict:
    return protocol.ErrorResponse(error=protocol.ErrorInfo(
        message=message, type=ERROR_TYPES.get(status, "invalid_request_error"), param=param,
        code=code if code is not None else status)).model_dump()


def error_response(status: int, message: str, param: str | None = None,
                   code: str | int | None = None, headers: dict | None = None) -> Response:
    # ASCII JSON: a message may quote what the client sent, lone surrogates included, which
    # UTF-8 cannot encode
    return Response(json.dumps(error_body(status, message, param, code)), status_code=status,
                    headers=headers, media_type="application/json")
