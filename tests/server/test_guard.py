"""RequestGuard on its own (ASGI calls, no server): WebSocket refused, body deadlines, key with whitespace."""
from __future__ import annotations

import asyncio
import json

from dflash_tfm.server.guard import BODY_DEADLINE_FACTOR, GuardSettings, RequestGuard, host_name


async def never_called(scope, receive, send) -> None:
    raise AssertionError("the guard let the request through")


def http_scope(headers: dict[str, str]) -> dict:
    return {"type": "http", "method": "POST", "path": "/generate",
            "headers": [(k.encode(), v.encode()) for k, v in headers.items()]}


def call(guard: RequestGuard, scope: dict, receive) -> list[dict]:
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    asyncio.run(guard(scope, receive, send))
    return sent


HEADERS = {"host": "127.0.0.1:30000", "content-type": "application/json"}


def test_websocket_is_refused() -> None:
    async def receive() -> dict:
        return {"type": "websocket.connect"}

    sent = call(RequestGuard(never_called, GuardSettings()), {"type": "websocket", "path": "/x", "headers": []}, receive)
    assert sent == [{"type": "websocket.close", "code": 1008}]


def test_a_silent_client_gets_408() -> None:
    async def receive() -> dict:
        await asyncio.sleep(10)
        return {"type": "http.request", "body": b"", "more_body": False}

    guard = RequestGuard(never_called, GuardSettings(read_timeout=0.05, json_routes=frozenset({"/generate"})))
    sent = call(guard, http_scope(HEADERS), receive)
    assert sent[0]["status"] == 408 and "in time" in json.loads(sent[1]["body"])["error"]["message"]


def test_a_trickling_body_hits_the_whole_body_deadline() -> None:
    timeout = 0.05

    async def receive() -> dict:  # a byte just inside every chunk deadline, for ever
        await asyncio.sleep(timeout / 2)
        return {"type": "http.request", "body": b"{", "more_body": True}

    loop_time = []
    guard = RequestGuard(never_called, GuardSettings(read_timeout=timeout, json_routes=frozenset({"/generate"})))

    async def run() -> list[dict]:
        sent: list[dict] = []

        async def send(message: dict) -> None:
            sent.append(message)

        start = asyncio.get_running_loop().time()
        await guard(http_scope(HEADERS), receive, send)
        loop_time.append(asyncio.get_running_loop().time() - start)
        return sent

    sent = asyncio.run(run())
    assert sent[0]["status"] == 408
    assert BODY_DEADLINE_FACTOR * timeout <= loop_time[0] < BODY_DEADLINE_FACTOR * timeout + 0.5


def test_key_whitespace_and_host_names() -> None:
    guard = RequestGuard(never_called, GuardSettings(api_key=" k \n"))
    scope = {**http_scope({**HEADERS, "authorization": "Bearer k"}), "method": "GET", "path": "/metrics"}
    assert guard.refusal(scope) is None  # the configured key's stray whitespace is not part of it
    assert host_name("Example.com:8080") == "example.com" and host_name("[::1]:8000") == "::1"
    assert host_name("::1") == "::1"
