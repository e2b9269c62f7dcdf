"""Refusals as OpenAI-style JSON errors: `{"error": {"message", "type", "code", "param"}}`.

`code` is the HTTP status, except where OpenAI's clients look for a named code (`invalid_api_key`,
`model_not_found`). A 500 never carries exception text (it may hold paths or internals): it names the
request id under which the server logged the traceback.
"""
from __future__ import annotations

from fastapi.responses import JSONResponse

from dflash_tfm.server import protocol as P

CLIENT_CLOSED = 499  # nginx's "client closed request": logged and counted, never seen by the (gone) client
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error", 408: "timeout_error", 413: "request_too_large",
               415: "invalid_request_error", 500: "internal_server_error", 503: "server_overloaded"}


class APIError(Exception):
    """A request the server refuses, turned into an OpenAI-style JSON error response."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.param, self.code)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> P.ErrorResponse:
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "internal_server_error")
    return P.ErrorResponse(error=P.ErrorBody(message=message, type=kind, code=code or status, param=param))


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    headers = {**({"Retry-After": "1"} if status == 503 else {}), **(headers or {})}
    return JSONResponse(error_body(status, message, param, code).model_dump(), status_code=status,
                        headers=headers or None)


def internal_error_message(request_id: str) -> str:
    return f"internal server error (request id {request_id}); the server log has the details"
