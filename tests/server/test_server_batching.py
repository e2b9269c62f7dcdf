"""Continuous batching behind the real server: concurrent clients get their solo outputs while sharing engine
steps, and a client that leaves mid-stream frees its slot while the others keep decoding.

The default server (`--max-running-requests` 8, autoregressive) is the shared one of the other server tests.
"""
from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from dflash_tfm import SamplingParams
from tests.server import ServerProcess, launch_server_process, one_torch_thread, reference_engine, scrape, \
    shared_server, wait_idle

COMPLETIONS = "/v1/completions"


@pytest.fixture(autouse=True)
def _single_thread() -> Iterator[None]:
    with one_torch_thread():
        yield


@pytest.fixture(scope="module")
def server() -> ServerProcess:
    launch_server_process()
    reference_engine()  # loads here while the server process loads its own copy
    return shared_server()


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
