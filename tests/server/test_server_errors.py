"""Abandoned requests free their slot at once and stop decoding; admission beyond the limit is a 503; the
server keeps serving after refusals (the bad-input suite itself is in test_bad_inputs.py).

The first part drives the real server process; the admission/queue tests use a fake slow engine behind the
real app in an in-process uvicorn, so queue states are reached deterministically without model time.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace

import httpx
import openai
import pytest

from dflash_tfm.engine.engine import StreamDelta
from dflash_tfm.engine.result import GenerationStats
from dflash_tfm.sampling_params import SamplingParams
from dflash_tfm.speculative_config import SpeculativeConfig
from tests.server import SERVED_NAME, ServerProcess, in_flight, in_thread_server, shared_server, wait_counts, wait_idle

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
GENERATE = "/generate"
MSGS = [{"role": "user", "content": "hi"}]
LONG = 400  # max_tokens of requests the tests abandon: far more than they may decode before being stopped


@pytest.fixture(scope="module")
def server() -> ServerProcess:
    return shared_server()


def test_server_keeps_serving_after_bad_requests(server: ServerProcess) -> None:
    metrics = wait_idle(server.base_url)
    assert in_flight(metrics) == 0  # refused requests hold no slot
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    body = {"prompt": "Hello", "max_tokens": 3, "temperature": 0}
    assert httpx.post(f"{server.base_url}{COMPLETIONS}", json=body, timeout=60.0).json()["usage"]["completion_tokens"] > 0


def test_openai_client_sees_bad_request_error(server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=SERVED_NAME, messages=MSGS, n=2)
    assert e.value.status_code == 400 and "n must be 1" in str(e.value)


def _assert_slot_freed_and_decoding_stopped(server: ServerProcess, before: dict) -> None:
    """After a client walked away from a LONG request: nothing in flight, few tokens decoded, next one fast."""
    after = wait_idle(server.base_url, timeout=15.0)
    assert in_flight(after) == 0
    decoded = after[("dflash_tfm_generation_tokens_total", ())] - before[("dflash_tfm_generation_tokens_total", ())]
    assert decoded < LONG // 4, decoded
    assert after[("dflash_tfm_aborted_requests_total", ())] == before[("dflash_tfm_aborted_requests_total", ())] + 1
    start = time.monotonic()
    body = {"prompt": "Hi", "max_tokens": 2, "temperature": 0}
    assert httpx.post(f"{server.base_url}{COMPLETIONS}", json=body, timeout=60.0).status_code == 200
    assert time.monotonic() - start < 10.0


def test_stream_disconnect_frees_slot_and_stops_decoding(server: ServerProcess) -> None:
    before = wait_idle(server.base_url)
    body = {"prompt": "Once upon a time", "max_tokens": LONG, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.base_url}{COMPLETIONS}", json=body, timeout=60.0) as r:
        assert r.status_code == 200
        next(line for line in r.iter_lines() if line.startswith("data: "))
    _assert_slot_freed_and_decoding_stopped(server, before)


def test_non_stream_disconnect_cancels_job(server: ServerProcess) -> None:
    before = wait_idle(server.base_url)
    body = {"text": "Once upon a time", "sampling_params": {"max_new_tokens": LONG, "ignore_eos": True}}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.base_url}{GENERATE}", json=body, timeout=httpx.Timeout(10.0, read=1.5))
    _assert_slot_freed_and_decoding_stopped(server, before)


# ---- admission and queue states with a fake engine ------------------------------------------------------

class SlowEngine:
    """Just enough of Engine for the app: every request yields up to max_new_tokens tokens, 20 ms apart."""

    model_path = "fake-model"
    max_model_len = 1024
    max_chars_per_token = 1
    config = SimpleNamespace(vocab_size=100)
    eos_token_ids = {0}
    speculative = SpeculativeConfig()
    max_running_requests = 1  # one request at a time: the worker runs `stream`

    def __init__(self) -> None:
        self.tokens = 0
        self.prompts: list[list[int]] = []

    def encode_prompt(self, prompt: str | list[int], chat: bool = False, enable_thinking: bool | None = None) -> list[int]:
        return [1 + ord(c) % 99 for c in prompt] if isinstance(prompt, str) else list(prompt)

    def apply_chat_template(self, messages: list[dict], enable_thinking: bool | None = None) -> list[int]:
        return self.encode_prompt("".join(m["content"] for m in messages))

    def stream(self, prompt: list[int], params: SamplingParams) -> Iterator[StreamDelta]:
        self.prompts.append(prompt)
        stats = GenerationStats(prompt_tokens=len(prompt))
        for i in range(params.max_new_tokens):
            time.sleep(0.02)
            self.tokens += 1
            stats.completion_tokens = stats.verify_steps = i + 1
            yield StreamDelta([5], "x", "length" if i + 1 == params.max_new_tokens else None, stats)


@pytest.fixture()
def fake_server() -> Iterator[tuple[str, SlowEngine]]:
    engine = SlowEngine()
    with in_thread_server(engine, max_admitted_requests=2) as url:
        yield url, engine


def test_admission_limit_503_and_queued_client_leaving_frees_its_slot(fake_server: tuple[str, SlowEngine]) -> None:
    url, engine = fake_server
    gave_up: list[bool] = []

    def impatient() -> None:
        try:
            httpx.post(f"{url}{COMPLETIONS}", json={"prompt": "?", "max_tokens": 5}, timeout=httpx.Timeout(5.0, read=2.0))
        except httpx.ReadTimeout:
            gave_up.append(True)

    with httpx.stream("POST", f"{url}{COMPLETIONS}", json={"prompt": "ab", "max_tokens": 1000, "stream": True},
                      timeout=30.0) as running:
        lines = running.iter_lines()  # keep a reference: a collected iterator closes the response
        assert running.status_code == 200 and next(lines).startswith("data: ")
        wait_counts(url, 1, 0)
        leaver = threading.Thread(target=impatient)
        leaver.start()
        wait_counts(url, 1, 1)  # queued behind the running stream...
        leaver.join()
        assert gave_up
        wait_counts(url, 1, 0)  # ...and gone from the queue as soon as its client left, while the stream still runs
        waiting = threading.Thread(target=httpx.post, args=(f"{url}{COMPLETIONS}",),
                                   kwargs={"json": {"prompt": "w", "max_tokens": 2}, "timeout": 30.0})
        waiting.start()
        wait_counts(url, 1, 1)
        r = httpx.post(f"{url}{COMPLETIONS}", json={"prompt": "z", "max_tokens": 2}, timeout=30.0)
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == 503 and "limit 2" in r.json()["error"]["message"]
    waiting.join(30)
    wait_counts(url, 0, 0)
    assert engine.encode_prompt("?") not in engine.prompts  # the abandoned queued job never ran
    assert engine.tokens < 500  # the abandoned stream stopped long before its 1000 tokens
    assert httpx.post(f"{url}{COMPLETIONS}", json={"prompt": "ok", "max_tokens": 2}, timeout=30.0).status_code == 200
