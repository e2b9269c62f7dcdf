"""Shared helpers of the server tests: one real server process and one reference engine per test session.

Both are process-wide singletons (not pytest fixtures defined here) so that the API and error modules share a
single ~15 s model load each; the server is terminated when the test process exits.
"""
from __future__ import annotations

import atexit
import contextlib
import functools
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

MAX_MODEL_LEN = 1024
STARTUP_TIMEOUT_S = 240.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    base_url: str
    log_path: str

    def log_tail(self, chars: int = 4000) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()[-chars:]

    def stop(self) -> None:
        """Terminate the server and remove its log (startup failures already quoted it in their error)."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.log_path)


SERVED_NAME = "smollm2"  # --served-model-name of the test servers: what requests' "model" field says
SPECULATIVE = ("--speculative-algorithm", "DFLASH_TFM")  # with the embedded target: the committed bundle


@functools.cache
def launch_server_process(*extra: str) -> ServerProcess:
    """Start `python -m dflash_tfm.launch_server` on the embedded model (plus `extra` flags); returns at once
    (see shared_server). One process per distinct flag set, shared by every test module."""
    port = free_port()
    log = tempfile.NamedTemporaryFile("w", prefix="dflash_tfm_server_", suffix=".log", delete=False)
    cmd = [sys.executable, "-m", "dflash_tfm.launch_server", "--host", "127.0.0.1", "--port", str(port),
           "--device", "cpu", "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--log-level", "warning",
           "--served-model-name", SERVED_NAME,
           "--page-size", "1", "--disable-radix-cache", *extra]  # not-applicable flags must not stop the server
    # one intra-op thread: the server and this process's reference engine share the CPU without oversubscribing
    env = {**os.environ, "TQDM_DISABLE": "1", "OMP_NUM_THREADS": "1"}
    env.pop("DFLASH_TFM_API_KEY", None)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    server = ServerProcess(proc, f"http://127.0.0.1:{port}", log.name)
    atexit.register(server.stop)
    return server


@functools.cache
def shared_server(*extra: str) -> ServerProcess:
    """The launched server (with `extra` flags) once /health answers (it loads the model first)."""
    server = launch_server_process(*extra)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"server exited with {server.proc.returncode}:\n{server.log_tail()}")
        try:
            if httpx.get(f"{server.base_url}/health", timeout=2.0).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    tail = server.log_tail()
    server.stop()
    raise RuntimeError(f"server not healthy after {STARTUP_TIMEOUT_S:.0f}s:\n{tail}")


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    """Run this process's torch on one intra-op thread (restored after): next to the server process on a
    small shared CPU, OpenMP spin-waiting otherwise slows both several-fold."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@functools.cache
def reference_engine():
    """The same model in this process: the server's outputs at temperature 0 must equal its own."""
    from dflash_tfm import Engine

    return Engine(device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN, progress=False)


@pytest.fixture(autouse=True, name="_single_thread")
def single_thread_fixture() -> Iterator[None]:
    """Imported by a test module that talks to a server process: its tests run this process's torch on one
    thread (`one_torch_thread`)."""
    with one_torch_thread():
        yield


@pytest.fixture(scope="module", name="server")
def reference_server_fixture() -> ServerProcess:
    """Imported by a test module as its `server`: the default shared server once healthy, with this process's
    reference engine loaded while the server process loads its own copy."""
    launch_server_process()
    reference_engine()
    return shared_server()


def scrape(base_url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """/metrics parsed with prometheus_client's parser: {(sample name, sorted labels): value}."""
    text = httpx.get(f"{base_url}/metrics", timeout=10.0).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def wait_counts(base_url: str, running: int, queued: int) -> None:
    """Poll the gauges until (running, queued) is reached; fail after 5 s."""
    deadline = time.monotonic() + 5.0
    while True:
        m = scrape(base_url)
        now = (m[("dflash_tfm_num_running_requests", ())], m[("dflash_tfm_num_queued_requests", ())])
        if now == (running, queued):
            return
        assert time.monotonic() < deadline, f"(running, queued) = {now}, expected {(running, queued)}"
        time.sleep(0.02)


@contextlib.contextmanager
def in_thread_server(engine, max_admitted_requests: int) -> Iterator[str]:
    """The app over `engine` (a fake one, usually) served by uvicorn on a thread of this process; yields its URL."""
    import threading

    import uvicorn

    from dflash_tfm.server.app import create_app
    from dflash_tfm.server.args import ServerArgs

    port = free_port()
    app = create_app(engine, ServerArgs(max_admitted_requests=max_admitted_requests))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


def in_flight(metrics: dict) -> float:
    """Running + queued requests according to the gauges."""
    return metrics[("dflash_tfm_num_running_requests", ())] + metrics[("dflash_tfm_num_queued_requests", ())]


def wait_idle(base_url: str, timeout: float = 20.0) -> dict:
    """Poll /metrics until no request is running or queued; returns that scrape."""
    deadline = time.monotonic() + timeout
    while True:
        metrics = scrape(base_url)
        if in_flight(metrics) == 0 or time.monotonic() > deadline:
            return metrics
        time.sleep(0.1)
