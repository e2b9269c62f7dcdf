"""What every HTTP request passes before any route runs: Host allow-list, API key, JSON content type,
body size and read deadline. Each refusal is cheap (no parsing, no tokenising), so a flood of bad or huge
requests cannot hold the event loop, and `/health` keeps answering.

A pure ASGI middleware (not Starlette's BaseHTTPMiddleware) so the routes still receive the client's
disconnect on `receive` and cancel abandoned jobs. It reads the bodies of the JSON routes itself, bounded by
`max_request_bytes` and a per-chunk deadline, and replays them to the route, which then parses from memory.
An exception that escapes a route is logged here under the request's id, and the client's 500 names that id
(`x-request-id` is on every response).

Why each check:
- Host allow-list: a server on loopback is reachable from any web page the operator opens; a page on
  another site (or a DNS-rebound name) sends its own Host header, which is refused.
- JSON content type: browsers send `text/plain` and form bodies cross-site without a CORS preflight;
  requiring `application/json` forces the preflight, which this server never grants.
- API key: compared through SHA-256 digests with `hmac.compare_digest`, so the time taken says nothing
  about the key; `/health` stays open for load balancers.
"""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import uuid
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from dflash_tfm.server.errors import CLIENT_CLOSED, error_response, internal_error_message

logger = logging.getLogger("dflash_tfm.server")

Message = dict[str, Any]
ASGIApp = Callable[[dict, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]], Awaitable[None]]
LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})
OPEN_PATHS = frozenset({"/health"})  # answered without the API key
BODY_DEADLINE_FACTOR = 10  # a body trickling in a byte per chunk deadline still ends


@dataclass(frozen=True)
class GuardSettings:
    """api_key None: no authentication. allowed_hosts None: any Host header. json_routes: paths whose POST
    body must be JSON of at most max_request_bytes, each chunk arriving within read_timeout seconds and the
    whole body within BODY_DEADLINE_FACTOR times that."""

    api_key: str | None = None
    allowed_hosts: frozenset[str] | None = LOOPBACK_HOSTS
    max_request_bytes: int = 8 << 20
    read_timeout: float = 30.0
    json_routes: frozenset[str] = frozenset()


def host_name(host_header: str) -> str:
    """'localhost:30000' -> 'localhost', '[::1]:8000' -> '::1' (lower case)."""
    host = host_header.strip().lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def _digest(text: str) -> bytes:
    return hashlib.sha256(text.encode("utf-8", "surrogateescape")).digest()


class RequestGuard:
    def __init__(self, app: ASGIApp, settings: GuardSettings) -> None:
        self.app, self.settings = app, settings
        self._key_digest = None if settings.api_key is None else _digest(settings.api_key.strip())

    async def __call__(self, scope: dict, receive: Callable[[], Awaitable[Message]],
                       send: Callable[[Message], Awaitable[None]]) -> None:
        if scope["type"] == "websocket":  # no route speaks WebSocket: refuse before anything reads the request
            await receive()
            await send({"type": "websocket.close", "code": 1008})
            return
        if scope["type"] != "http":  # lifespan
            await self.app(scope, receive, send)
            return
        request_id = uuid.uuid4().hex[:16]
        scope.setdefault("state", {})["request_id"] = request_id
        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", request_id.encode())]}
            await send(message)

        refusal = self.refusal(scope)
        if refusal is not None:
            await refusal(scope, receive, send_with_id)
            return
        if scope["method"] == "POST" and scope["path"] in self.settings.json_routes:
            body = await self.read_body(scope, receive, send_with_id, request_id)
            if body is None:
                return
            receive = _replaying(body, receive)
        try:
            await self.app(scope, receive, send_with_id)
        except Exception:  # a bug: logged once with its id; the client gets the id, never the exception text
            logger.exception("request %s failed", request_id)
            if not started:
                await error_response(500, internal_error_message(request_id))(scope, receive, send_with_id)

    def refusal(self, scope: dict):
        """The error response for a request refused on its headers alone, or None."""
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        s = self.settings
        if s.allowed_hosts is not None and host_name(headers.get("host", "")) not in s.allowed_hosts:
            return error_response(400, f"Host header {headers.get('host', '')!r} is not allowed; start the server with "
                                       "--allowed-hosts to accept it", "host")
        if self._key_digest is not None and scope["path"] not in OPEN_PATHS:
            scheme, _, token = headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(_digest(token.strip()), self._key_digest):
                return error_response(401, "missing or wrong API key: send 'Authorization: Bearer <key>'", None,
                                      "invalid_api_key", {"WWW-Authenticate": "Bearer"})
        if scope["method"] == "POST" and scope["path"] in s.json_routes:
            media_type = headers.get("content-type", "").split(";", 1)[0].strip().lower()
            if media_type != "application/json":
                return error_response(415, f"Content-Type must be application/json, got {media_type or 'none'!r}",
                                      "content-type")
            length = headers.get("content-length", "")
            if length.isdigit() and int(length) > s.max_request_bytes:
                return self.too_large(int(length))
        return None

    def too_large(self, size: int):
        return error_response(413, f"request body of {size} bytes is over the limit of "
                                   f"{self.settings.max_request_bytes} bytes (--max-request-bytes)")

    async def read_body(self, scope: dict, receive: Callable[[], Awaitable[Message]],
                        send: Callable[[Message], Awaitable[None]], request_id: str) -> bytes | None:
        """The whole body, or None after answering 413 (too large), 408 (a chunk late) or 499 (client gone)."""
        chunks, size = [], 0
        loop = asyncio.get_running_loop()
        deadline = loop.time() + BODY_DEADLINE_FACTOR * self.settings.read_timeout
        while True:
            wait = min(self.settings.read_timeout, deadline - loop.time())
            try:
                message = await asyncio.wait_for(receive(), max(wait, 0.0))
            except (TimeoutError, asyncio.TimeoutError):  # distinct classes before Python 3.11
                await error_response(408, "request body not received in time (--timeout-read: "
                                          f"{self.settings.read_timeout:g} s per chunk, {BODY_DEADLINE_FACTOR} times "
                                          "that in all)")(scope, receive, send)
                return None
            if message["type"] == "http.disconnect":
                logger.info("request %s: client disconnected while sending its body (%d bytes received)",
                            request_id, size)
                await send({"type": "http.response.start", "status": CLIENT_CLOSED, "headers": []})
                await send({"type": "http.response.body", "body": b""})
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.settings.max_request_bytes:
                await self.too_large(size)(scope, receive, send)
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def _replaying(body: bytes, receive: Callable[[], Awaitable[Message]]) -> Callable[[], Awaitable[Message]]:
    """A receive that yields the buffered body once, then the client's own messages (its disconnect)."""
    delivered = False

    async def replay() -> Message:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
