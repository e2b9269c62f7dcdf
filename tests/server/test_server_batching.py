"""Continuous batching behind the real server: concurrent clients get their solo outputs while sharing engine
steps, and a client that leaves mid-stream frees its slot while the others keep decoding.

The default server (`--max-running-requests` 8, autoregressive) is the shared one of the other server tests. The
worker's batched path (slots, queue, 503, a failing step) is driven deterministically through a fake batching
engine behind the real app in an in-process uvicorn.
"""
from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from dflash_tfm import SamplingParams
from dflash_tfm.engine.result import GenerationStats
from dflash_tfm.engine.sequence import Sequence, StreamDelta
from tests.server import (ServerProcess, in_thread_server, reference_engine,  # noqa: F401 (fixtures below)
                          reference_server_fixture, scrape, shared_server, single_thread_fixture, wait_counts,
                          wait_idle)
from tests.server.test_server_errors import SlowEngine

COMPLETIONS = "/v1/completions"


def test_concurrent_clients_share_steps_and_get_their_solo_outputs(server: ServerProcess) -> None:
    engine = reference_engine()
    requests = [(f"Question {i}: name {i + 2} fruits.", n, stop)
                for i, (n, stop) in enumerate([(4, None), (16, None), (9, None), (1, None), (24, ["\n"]),
                                               (12, None), (20, [","]), (7, None)])]
    before = wait_idle(server.base_url)

    def ask(request: tuple[str, int, list[str] | None]) -> tuple[str, str]:
        prompt, n, stop = request
        body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "stop": stop}
        choice = httpx.post(f"{server.base_url}{COMPLETIONS}", json=body, timeout=120.0).json()["choices"][0]
        return choice["text"], choice["finish_reason"]

    with ThreadPoolExecutor(len(requests)) as pool:
        answers = list(pool.map(ask, requests))
    expected = []
    for prompt, n, stop in requests:
        result = engine.generate(prompt, SamplingParams(temperature=0.0, max_new_tokens=n, stop=stop or []))
        expected.append((result.text, result.finish_reason))
    assert answers == expected
    after = scrape(server.base_url)
    assert after[("dflash_tfm_max_running_requests", ())] == 8
    steps = after[("dflash_tfm_batch_size_count", ())] - before[("dflash_tfm_batch_size_count", ())]
    rows = after[("dflash_tfm_batch_size_sum", ())] - before[("dflash_tfm_batch_size_sum", ())]
    assert rows / steps > 2, (rows, steps)  # requests really decoded together


def _running(base_url: str) -> float:
    return scrape(base_url)[("dflash_tfm_num_running_requests", ())]


def _wait_running(base_url: str, n: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while _running(base_url) != n:
        assert time.monotonic() < deadline, f"running = {_running(base_url)}, expected {n}"
        time.sleep(0.05)


def test_a_client_leaving_mid_stream_frees_its_slot_while_the_other_decodes(server: ServerProcess) -> None:
    before = wait_idle(server.base_url)
    body = {"prompt": "Once upon a time", "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.base_url}{COMPLETIONS}", json=body, timeout=60.0) as staying:
        stay_lines = staying.iter_lines()  # kept, as leave_lines below
        next(line for line in stay_lines if line.startswith("data: "))
        with httpx.stream("POST", f"{server.base_url}{COMPLETIONS}", json=body, timeout=60.0) as leaving:
            leave_lines = leaving.iter_lines()  # keep a reference: a collected iterator closes the response
            next(line for line in leave_lines if line.startswith("data: "))
            _wait_running(server.base_url, 2)
        _wait_running(server.base_url, 1)  # the leaver's slot is free, the stayer still decodes
        events = [json.loads(line[6:]) for line, _ in zip((ln for ln in stay_lines if ln.startswith("data: {")),
                                                          range(5))]
        assert len(events) == 5 and all(e["choices"][0]["finish_reason"] is None for e in events)
    after = wait_idle(server.base_url, timeout=15.0)
    assert after[("dflash_tfm_aborted_requests_total", ())] == before[("dflash_tfm_aborted_requests_total", ())] + 2


def test_speculative_clients_share_steps_and_get_their_solo_outputs() -> None:
    """DDTREE at a fixed budget with --max-running-requests 4: concurrent clients decode in shared steps (one
    verify over all their trees) and each gets plain greedy decoding's text."""
    server = shared_server("--speculative-algorithm", "DDTREE", "--speculative-tree-budget", "16",
                           "--max-running-requests", "4")
    engine = reference_engine()
    requests = [(f"Question {i}: name {i + 2} animals.", n) for i, n in enumerate([12, 5, 20, 9])]
    before = wait_idle(server.base_url)

    def ask(request: tuple[str, int]) -> str:
        body = {"prompt": request[0], "max_tokens": request[1], "temperature": 0}
        return httpx.post(f"{server.base_url}{COMPLETIONS}", json=body, timeout=120.0).json()["choices"][0]["text"]

    with ThreadPoolExecutor(len(requests)) as pool:
        answers = list(pool.map(ask, requests))
    assert answers == [engine.generate(p, SamplingParams(temperature=0.0, max_new_tokens=n)).text for p, n in requests]
    after = scrape(server.base_url)
    assert after[("dflash_tfm_max_running_requests", ())] == 4
    steps = after[("dflash_tfm_batch_size_count", ())] - before[("dflash_tfm_batch_size_count", ())]
    rows = after[("dflash_tfm_batch_size_sum", ())] - before[("dflash_tfm_batch_size_sum", ())]
    assert rows / steps > 1.5, (rows, steps)


# ---- the worker's batched path with a fake engine ---------------------------------------------------------

class SlowBatchEngine(SlowEngine):
    """Just enough of a batching Engine for the worker: 2 slots, one token per running request per 20 ms
    step; a step with a request whose prompt is "boom" raises, the way a bug would."""

    max_running_requests = 2

    def __init__(self) -> None:
        super().__init__()
        self.running: list[Sequence] = []

    @property
    def free_slots(self) -> int:
        return self.max_running_requests - len(self.running)

    def add_request(self, prompt: list[int], params: SamplingParams) -> Sequence:
        assert self.free_slots > 0
        self.prompts.append(prompt)
        seq = Sequence(list(prompt), params, set(), params.max_new_tokens, None, None,  # type: ignore[arg-type]
                       GenerationStats(prompt_tokens=len(prompt)))
        self.running.append(seq)
        return seq

    def abort_request(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)

    def step(self) -> list[tuple[Sequence, StreamDelta]]:
        time.sleep(0.02)
        if any(seq.prompt_ids == self.encode_prompt("boom") for seq in self.running):
            raise RuntimeError("a bug in the batch step")
        out = []
        for seq in list(self.running):
            self.tokens += 1
            seq.stats.completion_tokens = seq.stats.verify_steps = seq.stats.completion_tokens + 1
            done = seq.stats.completion_tokens == seq.budget
            out.append((seq, StreamDelta([5], "x", "length" if done else None, seq.stats)))
            if done:
                self.running.remove(seq)
        return out


@pytest.fixture()
def batch_server() -> Iterator[tuple[str, SlowBatchEngine]]:
    engine = SlowBatchEngine()
    with in_thread_server(engine, max_admitted_requests=3) as url:
        yield url, engine


def test_slots_fill_then_the_queue_then_503_and_a_leaving_client_lets_the_next_in(batch_server) -> None:
    url, engine = batch_server
    body = {"prompt": "ab", "max_tokens": 1000, "stream": True}
    with httpx.stream("POST", f"{url}{COMPLETIONS}", json=body, timeout=30.0) as first, \
            httpx.stream("POST", f"{url}{COMPLETIONS}", json=body, timeout=30.0) as second:
        lines = first.iter_lines(), second.iter_lines()  # keep references: a collected iterator closes the response
        assert all(next(it).startswith("data: ") for it in lines)
        wait_counts(url, 2, 0)  # both decode together
        waiting = threading.Thread(target=httpx.post, args=(f"{url}{COMPLETIONS}",),
                                   kwargs={"json": {"prompt": "w", "max_tokens": 2}, "timeout": 30.0})
        waiting.start()
        wait_counts(url, 2, 1)  # no free slot: it waits
        r = httpx.post(f"{url}{COMPLETIONS}", json={"prompt": "z", "max_tokens": 2}, timeout=30.0)
        assert r.status_code == 503 and "2 decoding" in r.json()["error"]["message"]
        second.close()  # its client leaves: the waiting request takes the slot and finishes
        waiting.join(10)
        assert not waiting.is_alive() and engine.encode_prompt("w") in engine.prompts
        wait_counts(url, 1, 0)
    wait_counts(url, 0, 0)
    assert engine.tokens < 500 and engine.running == []
    assert scrape(url)[("dflash_tfm_max_running_requests", ())] == 2


def test_a_failing_step_fails_its_requests_and_the_worker_serves_on(batch_server) -> None:
    url, engine = batch_server
    with ThreadPoolExecutor(2) as pool:
        ok, boom = (pool.submit(httpx.post, f"{url}{COMPLETIONS}", json={"prompt": p, "max_tokens": 50},
                                timeout=30.0) for p in ("fine", "boom"))
        assert boom.result().status_code == 500
        assert ok.result().status_code in (200, 500)  # it finished before "boom" joined, or failed with it
    r = httpx.post(f"{url}{COMPLETIONS}", json={"prompt": "next", "max_tokens": 3}, timeout=30.0)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "xxx"
    wait_counts(url, 0, 0)
