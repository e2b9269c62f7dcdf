"""What a server one exposes must hold: bounded work before admission, authentication, transport deadlines,
no internals in replies, OpenAI client semantics, and sampling values that never break losslessness.

Real `launch_server` processes (autoregressive, and DFLASH_TFM with the committed bundle) for what depends on
the model; the app with a fake engine in an in-process uvicorn for authentication and internal errors.
"""
from __future__ import annotations

import logging
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
import uvicorn

from dflash_tfm.server.app import create_app
from dflash_tfm.server.args import ServerArgs
from tests.server import SERVED_NAME, ServerProcess, free_port, launch_server_process, scrape, shared_server, wait_idle
from tests.server.test_bad_inputs import MODES, SLOW_HEADERS
from tests.server.test_server_errors import SlowEngine

KEY = "s3cret-key"
ROUTES = [("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("GET", "/v1/models"), ("POST", "/generate"),
          ("GET", "/health_generate"), ("GET", "/flush_cache"), ("POST", "/flush_cache"), ("GET", "/get_model_info"),
          ("GET", "/metrics"), ("GET", "/docs"), ("GET", "/openapi.json")]
BODIES = {"/v1/chat/completions": {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1},
          "/v1/completions": {"prompt": "x", "max_tokens": 1},
          "/generate": {"text": "x", "sampling_params": {"max_new_tokens": 1}}}


@pytest.fixture(scope="module")
def ar_server() -> ServerProcess:
    for flags in MODES.values():
        launch_server_process(*flags)
    return shared_server(*MODES["ar"])


@pytest.fixture(scope="module")
def spec_server(ar_server: ServerProcess) -> ServerProcess:
    return shared_server(*MODES["spec"])


class FailingEngine(SlowEngine):
    """Fails inside tokenization, the way a bug would, with text that must not reach the client."""

    def encode_prompt(self, prompt, chat: bool = False, enable_thinking: bool | None = None) -> list[int]:
        if prompt == "boom":
            raise RuntimeError("secret detail at /home/operator/models")
        return super().encode_prompt(prompt, chat, enable_thinking)


@pytest.fixture()
def keyed_server() -> Iterator[str]:
    """The app with an API key, in-process (auth is decided before any route or engine work)."""
    port = free_port()
    app = create_app(FailingEngine(), ServerArgs(api_key=KEY))  # type: ignore[arg-type]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


# ---- bounded work before admission --------------------------------------------------------------------

HEALTH_POLLER = """
import sys, time, httpx
latencies = []
with httpx.Client(base_url=sys.argv[1], timeout=5.0) as client:
    while time.perf_counter() < float(sys.argv[2]):
        start = time.perf_counter()
        assert client.get("/health").status_code == 200
        latencies.append(time.perf_counter() - start)
        time.sleep(0.01)
print(max(latencies), len(latencies))
"""


@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "chunked"])
def test_50_mib_body_refused_fast_while_health_answers(ar_server: ServerProcess, declared: bool) -> None:
    """/health is polled from another process, so this process's upload does not hold the poller's GIL."""
    body = b'{"prompt": "' + b"a" * (50 << 20) + b'"}'
    poller = subprocess.Popen([sys.executable, "-c", HEALTH_POLLER, ar_server.base_url,
                               str(time.perf_counter() + 2.0)], stdout=subprocess.PIPE, text=True)
    time.sleep(0.3)
    start = time.perf_counter()
    content = body if declared else (body[i : i + (1 << 20)] for i in range(0, len(body), 1 << 20))
    try:
        r = httpx.post(f"{ar_server.base_url}/v1/completions", content=content,
                       headers={"content-type": "application/json"}, timeout=30.0)
        status = r.status_code
    except httpx.TransportError:  # the server may close the connection after its 413 while we still upload
        status = 413
    refused_in = time.perf_counter() - start
    worst, polls = poller.communicate(timeout=30)[0].split()
    assert status == 413 and refused_in < 1.0, (status, refused_in)
    assert float(worst) < 0.1 and int(polls) > 10, (worst, polls)


def test_prompt_longer_than_the_context_is_refused_unread(ar_server: ServerProcess) -> None:
    """7 MiB of text (under the body limit) is refused from its length, without tokenizing 7 MiB."""
    start = time.perf_counter()
    r = httpx.post(f"{ar_server.base_url}/generate", json={"text": "x" * (7 << 20)}, timeout=30.0)
    assert r.status_code == 400 and "characters" in r.json()["error"]["message"]
    assert time.perf_counter() - start < 1.0


# ---- authentication -----------------------------------------------------------------------------------

@pytest.mark.parametrize("method,path", ROUTES, ids=[f"{m} {p}" for m, p in ROUTES])
def test_every_route_but_health_needs_the_key(keyed_server: str, method: str, path: str) -> None:
    body = BODIES.get(path) if method == "POST" else None
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": KEY}, {"authorization": f"Basic {KEY}"}):
        r = httpx.request(method, keyed_server + path, json=body, headers=headers, timeout=10.0)
        assert r.status_code == 401, (headers, r.text)
        assert r.json()["error"]["code"] == "invalid_api_key" and r.headers["www-authenticate"] == "Bearer"
    r = httpx.request(method, keyed_server + path, json=body, headers={"authorization": f"Bearer {KEY}"}, timeout=10.0)
    assert r.status_code == 200, r.text
    assert httpx.get(keyed_server + "/health", timeout=10.0).status_code == 200  # open for load balancers


def test_openai_client_authentication_error(keyed_server: str) -> None:
    client = openai.OpenAI(base_url=f"{keyed_server}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.completions.create(model="fake-model", prompt="x", max_tokens=1)
    client = openai.OpenAI(base_url=f"{keyed_server}/v1", api_key=KEY, max_retries=0)
    assert client.completions.create(model="fake-model", prompt="x", max_tokens=1).choices[0].text == "x"


def test_internal_error_names_a_request_id_not_the_exception(keyed_server: str, caplog) -> None:
    with caplog.at_level(logging.ERROR, logger="dflash_tfm.server"):
        r = httpx.post(keyed_server + "/v1/completions", json={"prompt": "boom"},
                       headers={"authorization": f"Bearer {KEY}"}, timeout=10.0)
    assert r.status_code == 500
    message = r.json()["error"]["message"]
    assert "secret" not in r.text and "/home" not in r.text
    assert r.headers["x-request-id"] in message
    assert "secret detail" in caplog.text and r.headers["x-request-id"] in caplog.text  # the operator sees it


# ---- OpenAI client semantics --------------------------------------------------------------------------

def test_openai_client_not_found_for_unknown_model(ar_server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=f"{ar_server.base_url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    assert e.value.code == "model_not_found"
    for name in (SERVED_NAME, "SmolLM2-135M-Instruct.Q4_1.gguf"):  # the served name and the path's last component
        assert client.completions.create(model=name, prompt="Hi", max_tokens=1, temperature=0).choices


# ---- transport deadlines and disconnects --------------------------------------------------------------

def test_half_sent_request_headers_are_cut_off(spec_server: ServerProcess) -> None:
    host, port = spec_server.base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=SLOW_HEADERS * 4) as sock:
        sock.sendall(b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        start = time.monotonic()
        for _ in range(int(SLOW_HEADERS * 3)):  # a header byte a second would keep it open without a deadline
            try:
                sock.sendall(b"X")
            except OSError:
                break
            if sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b"":
                break
            time.sleep(1.0)
        assert sock.recv(1) == b""  # closed by the server
        assert time.monotonic() - start < SLOW_HEADERS + 2.0


def test_upload_cut_short_is_a_499_logged_once(spec_server: ServerProcess) -> None:
    before = scrape(spec_server.base_url)
    host, port = spec_server.base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"text\": \"abc")
        time.sleep(0.2)
    key = ("dflash_tfm_http_requests_total", (("endpoint", "/generate"), ("status", "499")))
    deadline = time.monotonic() + 5.0
    while scrape(spec_server.base_url).get(key, 0.0) != before.get(key, 0.0) + 1:
        assert time.monotonic() < deadline, "the cut-short upload was not counted as a 499"
        time.sleep(0.1)
    assert "Traceback" not in spec_server.log_tail(20000)


# ---- speculation: losslessness at extreme values, model info, metrics ---------------------------------

@pytest.mark.parametrize("sampling", [{"temperature": 1e-37}, {"temperature": 1e-40}, {"temperature": 1.0, "top_p": 1e-46}],
                         ids=["t1e-37", "t1e-40", "top_p1e-46"])
def test_extreme_sampling_values_return_the_greedy_tokens(spec_server: ServerProcess, sampling: dict) -> None:
    prompt = "Question: Tom has 3 boxes of 12 apples and gives away 10. How many are left? Answer step by step."

    def output(params: dict) -> list[int]:
        body = {"text": prompt, "sampling_params": {"max_new_tokens": 24, "ignore_eos": True, **params}}
        r = httpx.post(f"{spec_server.base_url}/generate", json=body, timeout=120.0)
        assert r.status_code == 200, r.text
        return r.json()["output_ids"]

    assert output(sampling) == output({"temperature": 0.0})


def test_model_info_reports_the_speculation_as_run(spec_server: ServerProcess) -> None:
    info = httpx.get(f"{spec_server.base_url}/get_model_info", timeout=10.0).json()
    assert info["speculative_algorithm"] == "DFLASH_TFM"
    assert info["speculative_dflash_block_size"] == 16 and info["speculative_tree_budget"] == "auto"
    step_ms = {int(size): ms for size, ms in info["speculative_step_ms_by_size"].items()}
    assert set(step_ms) == {0, 8, 16, 32, 64} and all(ms > 0 for ms in step_ms.values())  # measured at start
    assert info["speculative_draft_model"] == "dflash" and info["speculative_dflash_tfm_model"] == "weaver.pth"
    assert not any(isinstance(v, str) and "/" in v for v in info.values()), info  # no paths leave the server


def test_metrics_count_speculation_by_algorithm(spec_server: ServerProcess) -> None:
    before = wait_idle(spec_server.base_url)
    body = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 32, "ignore_eos": True,
                                                                    "temperature": 0}}
    out = httpx.post(f"{spec_server.base_url}/generate", json=body, timeout=120.0).json()
    r = httpx.get(f"{spec_server.base_url}/metrics", timeout=10.0)
    assert r.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"  # what Prometheus 2.x accepts
    after = scrape(spec_server.base_url)

    def delta(name: str) -> float:
        key = (name, (("algorithm", "DFLASH_TFM"),))
        return after[key] - before.get(key, 0.0)

    steps = out["meta_info"]["spec_verify_ct"]
    assert delta("dflash_tfm_spec_verify_steps_total") == steps
    by_size = {int(dict(labels)["size"]): value - before.get((name, labels), 0.0)
               for (name, labels), value in after.items() if name == "dflash_tfm_spec_steps_total"}
    assert sum(by_size.values()) == steps - 1  # every decode step, at the size the budget chose
    assert delta("dflash_tfm_spec_draft_tokens_total") == sum(size * n for size, n in by_size.items())
    # each step after the prefill yields its accepted drafts plus one token of the target's own
    assert delta("dflash_tfm_spec_accepted_tokens_total") == len(out["output_ids"]) - 1 - (steps - 1)
