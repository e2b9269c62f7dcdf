"""The server at --tp-size 2, which starts its two ranks: rank 0 serves HTTP, rank 1 follows each request (or
each batched step of autoregressive requests decoding together). Greedy /generate
equals the tp 1 engine's tokens, before and after a streamed request that the client abandons early (rank 0
then decodes it to its end silently, so the ranks stay in lockstep for the next request)."""
from __future__ import annotations

import concurrent.futures
import contextlib
import os
import subprocess
import sys
import tempfile
import time

import httpx
import pytest

from dflash_tfm import Engine, SamplingParams
from dflash_tfm.config import ModelConfig
from dflash_tfm.loading.loader import open_checkpoint
from dflash_tfm.spec.fixtures import write_random_dflash_checkpoint
from dflash_tfm.speculative_config import SpeculativeConfig

from ..server import free_port
from ..train.tiny_chat import save_tiny_chat_model

PROMPTS = [[1, 7, 9, 12, 20], [1, 5, 6, 7, 8, 9, 10], [3, 4]]
NEW_TOKENS = 20


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp_server")
    path = save_tiny_chat_model(root)
    cfg = ModelConfig.from_dict(open_checkpoint(path)[1])
    drafter = write_random_dflash_checkpoint(root / "dflash", cfg, block_size=8,
                                             target_layer_ids=[0, cfg.num_layers - 1])
    return path, drafter


@contextlib.contextmanager
def tp2_server(path, *flags: str):
    """The server at --tp-size 2 on the tiny target with `flags`, started as a user would (it starts its two
    ranks); yields its URL, and on exit stops it and checks no rank still serves."""
    port = free_port()
    log = tempfile.NamedTemporaryFile("w+", suffix=".log")
    cmd = [sys.executable, "-m", "dflash_tfm.launch_server", "--tp-size", "2", "--model-path", str(path),
           "--device", "cpu", "--dtype", "float32", "--max-model-len", "256", "--host", "127.0.0.1", "--port",
           str(port), "--log-level", "warning", *flags]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "TQDM_DISABLE": "1", "OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, open(log.name).read()[-4000:]
            try:
                if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.5)
        yield url
    finally:
        proc.terminate()  # goes on to the ranks: none may keep serving the port
        proc.wait(30)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                httpx.get(f"{url}/health", timeout=1.0)
                time.sleep(0.5)
            except httpx.TransportError:
                break
        else:
            pytest.fail("a rank still serves after the server was stopped")


@pytest.fixture(scope="module")
def server(checkpoints):
    path, drafter = checkpoints
    with tp2_server(path, "--speculative-algorithm", "DDTREE", "--speculative-draft-model-path", str(drafter),
                    "--speculative-tree-budget", "8") as url:
        yield url


def generate(url: str, ids: list[int]) -> list[int]:
    body = {"input_ids": ids, "sampling_params": {"temperature": 0.0, "max_new_tokens": NEW_TOKENS}}
    response = httpx.post(f"{url}/generate", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["output_ids"]


def test_tp2_server_answers_as_the_tp1_engine(checkpoints, server: str) -> None:
    path, drafter = checkpoints
    engine = Engine(path, SpeculativeConfig("DDTREE", drafter, None, 8), device="cpu", dtype="float32",
                    max_model_len=256, progress=False)
    expected = [engine.generate(ids, SamplingParams(max_new_tokens=NEW_TOKENS)).token_ids for ids in PROMPTS]
    assert generate(server, PROMPTS[0]) == expected[0]
    body = {"input_ids": PROMPTS[1], "stream": True, "sampling_params": {"temperature": 0.0, "max_new_tokens": 200}}
    with httpx.stream("POST", f"{server}/generate", json=body, timeout=120) as response:
        next(response.iter_lines())  # the first chunk, then the client leaves
    assert generate(server, PROMPTS[2]) == expected[2]
    assert generate(server, PROMPTS[1]) == expected[1]


def test_tp2_server_batches_concurrent_requests_as_the_tp1_engine(checkpoints) -> None:
    """Autoregressive at tp 2: concurrent requests decode together (rank 1 follows each batched step) and each
    gets the tp 1 engine's tokens."""
    path, _ = checkpoints
    engine = Engine(path, device="cpu", dtype="float32", max_model_len=256, progress=False)
    expected = [engine.generate(ids, SamplingParams(max_new_tokens=NEW_TOKENS)).token_ids for ids in PROMPTS]
    with tp2_server(path, "--max-running-requests", "4") as url:
        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
            got = list(pool.map(lambda ids: generate(url, ids), PROMPTS))
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
    assert got == expected
    assert "dflash_tfm_max_running_requests 4.0" in metrics
    sample = dict(line.rsplit(" ", 1) for line in metrics.splitlines() if line.startswith("dflash_tfm_batch_size_"))
    assert float(sample['dflash_tfm_batch_size_bucket{le="1.0"}']) < float(sample["dflash_tfm_batch_size_count"])
